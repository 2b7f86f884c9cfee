"""`gpupool login` to one server of a real fleet (two gpupoold on one PostgreSQL store, each with
its own TLS identity): the other server is pinned from the first one's info reply, with the
identity it registered, and `gpupool status` then reaches both, each with its own pin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import wait_until
from gpupool import config as cc
from test_login import cli_env, gpupool, user_file
from test_store_postgres import servers_by_name


def test_login_to_one_server_pins_the_fleet(start_daemon: Any, native_build: Path, pg_url: str,
                                            tmp_path: Path) -> None:
    a, b = (start_daemon("--database", pg_url, build_dir=native_build) for _ in range(2))
    wait_until("both servers up", lambda: (s := servers_by_name(a), len(s) == 2 and all(
        v["state"] == "up" for v in s.values()))[-1])
    assert a.fingerprint and b.fingerprint and a.fingerprint != b.fingerprint
    token = a.api("POST", "/api/v1/tokens", {"name": "fleet-user"})["secret"]
    env = cli_env(tmp_path)

    def logged_in() -> Any:
        # The fleet's view of its members comes with its sync: until then a lists none.
        proc = gpupool(env, "login", a.address, "--token", token, "--fingerprint", a.fingerprint)
        assert proc.returncode == 0, proc.stderr
        return proc if "other server" in proc.stdout or "already pinned" in proc.stdout else None

    proc = wait_until("a login that pins b", logged_in, timeout=20, interval=0.5)
    assert f"at {b.address} ({b.fingerprint})" in proc.stdout, proc.stdout
    data, _ = cc.read_file(user_file(tmp_path))
    assert data["servers"] == [
        {"address": a.address, "token": token, "tls_fingerprint": a.fingerprint},
        {"address": b.address, "token": token, "tls_fingerprint": b.fingerprint}]
    proc = gpupool(env, "status")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for server in (a, b):
        assert f"{server.address}: gpupoold 0.1.0 on" in proc.stdout, proc.stdout
    assert proc.stdout.count("Fleet: 2 servers") == 1 and "Fleet: as above" in proc.stdout
