"""The link to a shared PostgreSQL (issue 35): a database on another host must be reached with
`sslmode=verify-full` (libpq's default `prefer` falls back to clear text, `require` accepts any
certificate), or the operator says `database_insecure = true`, warned at every start."""

from __future__ import annotations

import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, daemon_env

from gpupoold.store.postgres import link_parameters, link_problem, url_hosts


def test_a_dead_link_is_bounded_unless_the_url_says_otherwise() -> None:
    """gpupoold's connections give a dead link up (keepalives, tcp_user_timeout) and have
    PostgreSQL end a session idle in its transaction (issue 34, item 2); a URL's own values win,
    and its `options` keep theirs."""
    plain = link_parameters("postgresql://u@db.example/g")
    assert plain["keepalives"] == 1 and plain["tcp_user_timeout"] == 10_000
    assert plain["options"] == "-c idle_in_transaction_session_timeout=10000"
    own = link_parameters("postgresql://u@db.example/g?tcp_user_timeout=3000&keepalives_idle=1"
                          "&options=-c%20statement_timeout%3D5000")
    assert "tcp_user_timeout" not in own and "keepalives_idle" not in own
    assert own["keepalives_count"] == 3
    assert own["options"] == ("-c statement_timeout=5000 "
                              "-c idle_in_transaction_session_timeout=10000")
    mine = link_parameters("postgresql://u@db.example/g?options=-c%20"
                           "idle_in_transaction_session_timeout%3D0")
    assert "options" not in mine


@pytest.mark.parametrize("url, env, hosts", [
    ("postgresql://u@db.example:5432/g", {}, ["db.example"]),
    ("postgresql://u@[2001:db8::1]:5432/g", {}, ["2001:db8::1"]),
    ("postgresql://u@a.example:5432,b.example:5433/g", {}, ["a.example", "b.example"]),
    ("postgresql://u@/g?host=/run/postgresql", {}, ["/run/postgresql"]),
    ("postgresql://u@/g", {"PGHOST": "db.example"}, ["db.example"]),
    ("postgresql:///g", {}, [""]),
])
def test_the_hosts_a_url_connects_to(url: str, env: dict[str, str], hosts: list[str]) -> None:
    assert url_hosts(url, env) == hosts


@pytest.mark.parametrize("url, env", [
    ("postgresql://u@localhost/g", {}),
    ("postgresql://u@127.0.0.1:5432/g", {}),
    ("postgresql://u@[::1]:5432/g", {}),
    ("postgresql://u@/g?host=/run/postgresql", {}),
    ("postgresql:///g", {}),
    ("postgresql://u@db.example/g?sslmode=verify-full&sslrootcert=/etc/ca.crt", {}),
    ("postgresql://u@db.example/g", {"PGSSLMODE": "verify-full"}),
])
def test_a_local_or_verified_link_is_accepted(url: str, env: dict[str, str]) -> None:
    assert link_problem(url, False, env) is None


@pytest.mark.parametrize("url, env, now", [
    ("postgresql://u@db.example/g", {}, "no sslmode (libpq's default, prefer)"),
    ("postgresql://u@db.example/g?sslmode=require", {}, "sslmode=require"),
    ("postgresql://u@db.example/g?sslmode=verify-ca", {}, "sslmode=verify-ca"),
    ("postgresql://u@/g", {"PGHOST": "db.example"}, "no sslmode"),
    ("postgresql://u@localhost,db.example/g", {}, "no sslmode"),
])
def test_an_unverified_link_to_another_host_is_refused_unless_insecure(
        url: str, env: dict[str, str], now: str) -> None:
    problem = link_problem(url, False, env)
    assert problem is not None and now in problem and "db.example" in problem
    assert "sslmode=verify-full" in problem and "database_insecure = true" in problem
    assert link_problem(url, True, env) is None


def serve(tmp_path: Path, database: str, config: str = "") -> subprocess.Popen[str]:
    conf = tmp_path / "gpupoold.toml"
    conf.write_text(config)
    return subprocess.Popen(
        [sys.executable, "-m", "gpupoold", "serve", "--config", str(conf), "--simulated", "1",
         "--state-dir", str(tmp_path / "state"), "--listen", "127.0.0.1:0", "--http",
         "127.0.0.1:0", "--database", database], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=daemon_env(), cwd=REPO)


def test_gpupoold_refuses_such_a_link_with_the_fix_and_starts_when_told(
        tmp_path: Path, pg_url: str) -> None:
    # The session's PostgreSQL, named by a host name that is not this machine's (libpq
    # connects to `hostaddr`): to gpupoold a database on another host.
    parts = urllib.parse.urlsplit(pg_url)
    remote = (f"postgresql://{parts.username}@db.example:{parts.port}{parts.path}"
              f"?hostaddr=127.0.0.1")
    refused = serve(tmp_path, remote)
    out, _ = refused.communicate(timeout=60)
    assert refused.returncode == 78, out
    assert "setting 'database': the PostgreSQL at db.example is on another host" in out
    assert "sslmode=verify-full" in out and "database_insecure = true" in out

    told = serve(tmp_path, remote, "database_insecure = true\n")
    lines: list[str] = []
    try:
        assert told.stdout is not None
        for line in told.stdout:
            lines.append(line)
            if line.startswith("gpupoold: http on "):
                break
        text = "".join(lines)
        assert "gpupoold: remoting on " in text, text
        assert "database_insecure = true: the link to the PostgreSQL of" in text
        assert "is not verified" in text
    finally:
        told.terminate()
        rest: Any = told.communicate(timeout=60)[0]
    assert told.returncode == 0, "".join(lines) + (rest or "")
