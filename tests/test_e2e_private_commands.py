"""Private command lines, end to end (issue 29, item 3): a tenant runs `prog ... --api-key=SECRET`;
another user token's info reply (`gpupool status`, `gpupool smi`), HTTP API and dashboard show
the program's name and never the secret; the owner's token and an admin see the whole line. The
program's name holds an escape sequence and a newline: no view and no log line gets them. The
rule itself (pool/privacy.py) is unit-tested in tests/test_privacy.py.
"""

from __future__ import annotations

import http.cookiejar
import json
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

from conftest import GpupoolServer, wait_until
from test_e2e_leases import MIB, hold_gpu  # noqa: F401 (fixture)
from test_status_smi import cli_env, gpupool

SECRET = "SECRET123"
ARGV0 = "prog\x1b[31m\nforged"  # a name with an escape sequence and a newline
NAME = "prog?[31m?forged"  # as every view shows it (gpupoold/log.py printable)
API_VIEWS = ("/api/v1/status", "/api/v1/gpus", "/api/v1/gpus/0", "/api/v1/leases",
             "/api/v1/leases?state=active", "/api/v1/queue", "/api/v1/fleet")
PAGES = ("/ui/", "/ui/leases", "/ui/queue", "/ui/fleet", "/ui/history")


def api_text(server: GpupoolServer, token: str, lease_id: int) -> str:
    """Every API view of leases and clients, as `token` gets them (JSON, escapes as sent)."""
    paths = (*API_VIEWS, f"/api/v1/leases/{lease_id}")
    return "\n".join(json.dumps(server.get_json(p, token=token), ensure_ascii=False)
                     for p in paths)


def dashboard_text(server: GpupoolServer, token: str) -> str:
    """The dashboard's pages and first state event for a session logged in with `token`."""
    opener = urllib.request.build_opener(
        urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    form = urllib.parse.urlencode({"token": token}).encode()
    login = urllib.request.Request(server.http_url + "/ui/login", data=form,
                                   headers={"Origin": server.http_url})
    with opener.open(login, timeout=10) as resp:  # 303 to /ui/: the overview, logged in
        out = [resp.read().decode()]
    assert 'action="/ui/logout"' in out[0], out[0][:2000]
    for path in PAGES:
        with opener.open(server.http_url + path, timeout=10) as resp:
            out.append(resp.read().decode())
    with opener.open(server.http_url + "/ui/events", timeout=10) as resp:
        while not (line := resp.readline().decode()).startswith("data: "):
            assert line, "the event stream ended without a state event"
        out.append(line)
    return "\n".join(out)


def test_other_tenants_see_the_program_name_only(gpupool_server: GpupoolServer,
                                                  hold_gpu: Path) -> None:  # noqa: F811
    server = gpupool_server
    owner, admin = server.token, server.admin_token
    other = server.create_token("other-tenant")
    proc = subprocess.Popen([ARGV0, str(MIB), "60000", "1", "0", f"--api-key={SECRET}"],
                            executable=str(hold_gpu), env=server.client_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None and "holding" in proc.stdout.readline()
        [lease] = server.get_json("/api/v1/leases?state=active")["leases"]
        views: dict[str, dict[str, str]] = {}
        for who, token in (("other", other), ("owner", owner), ("admin", admin)):
            env = cli_env([server.address], token, server.fingerprint)
            views[who] = {"api": api_text(server, token, lease["id"]),
                          "dashboard": dashboard_text(server, token)}
            for args in (("status",), ("status", "--json"), ("smi",), ("smi", "--json")):
                run = gpupool(env, *args)
                assert run.returncode == 0, run.stderr
                views[who][" ".join(args)] = run.stdout

        for where, text in views["other"].items():
            assert SECRET not in text, where
        assert f'"program": "{NAME}"' in views["other"]["api"]  # the name, without arguments
        assert f'"program": "{NAME}"' in views["other"]["status --json"]
        assert NAME in views["other"]["dashboard"]
        # `gpupool status` lists the caller's own leases only: the admin's has none.
        for who, where in [("owner", "status"), *[(w, v) for w in ("owner", "admin") for v in
                                                  ("api", "dashboard", "status --json",
                                                   "smi --json")]]:
            assert f"--api-key={SECRET}" in views[who][where], (who, where)
        # smi's table has no room for arguments: the owner's shows the name too.
        assert NAME in views["owner"]["smi"]

        # Escapes and newlines: in no view and no log line; the log names the program only.
        log = wait_until("the lease's log line", lambda: (t := server.log_text()) and
                         NAME in t and t)
        for who, texts in views.items():
            for where, text in texts.items():
                assert "\x1b" not in text and "prog\nforged" not in text, (who, where)
        assert "\x1b" not in log and not [ln for ln in log.splitlines() if ln.startswith("forged")]
        assert SECRET not in log, [ln for ln in log.splitlines() if SECRET in ln]
    finally:
        proc.kill()
        proc.communicate()
