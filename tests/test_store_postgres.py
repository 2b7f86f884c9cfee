"""gpupoold on a shared PostgreSQL store (`database = "postgresql://..."`), end to end: the first
part of a fleet (docs/operator-guide.md, "PostgreSQL"). Two daemons on one database share their
tokens and write one lease history; a revocation made on one is refused on the other at the next
connection; a URL carrying a password stops the daemon with a configuration error. The store's
own tests run on PostgreSQL too (tests/test_store.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import REPO, daemon_env, wait_until
from test_e2e_leases import facts, hold_gpu, start_client  # noqa: F401  (hold_gpu is a fixture)

from gpupoold.store.database import StoreDB

MIB = 1 << 20


def run_hold(server: Any, hold_gpu: Path, token: str, seed: int) -> subprocess.CompletedProcess[str]:  # noqa: F811
    proc = start_client(server, hold_gpu, MIB, 0, seed, env={"GPUPOOL_TOKEN": token})
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def token_create(url: str, name: str, tmp_path: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "gpupoold", "token", "create", "--name", name,
                           "--database", url, "--state-dir", str(tmp_path / "cli")],
                          capture_output=True, text=True, env=daemon_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_two_daemons_share_tokens_and_lease_history(start_daemon: Any, native_build: Path,
                                                    hold_gpu: Path, pg_url: str,  # noqa: F811
                                                    tmp_path: Path) -> None:
    a = start_daemon("--database", pg_url, build_dir=native_build)
    # B's start must not spoil A's admin token: each server has a local admin token of its own.
    b = start_daemon("--database", pg_url, build_dir=native_build)
    assert a.get_json("/api/v1/gpus")["gpus"] and b.get_json("/api/v1/gpus")["gpus"]
    names = {t["name"] for t in a.get_json("/api/v1/tokens")["tokens"]}
    assert len([n for n in names if n.startswith("local-admin@")]) == 2, names
    assert f"database: {pg_url}" in a.log_text()
    token = token_create(pg_url, "shared", tmp_path)  # made with the CLI against the store
    for server, seed in ((a, 1), (b, 2)):
        proc = run_hold(server, hold_gpu, token, seed)
        assert proc.returncode == 0 and facts(proc.stdout)["exact"] == "1", proc.stderr
    # One lease history: each daemon's lease is in the shared database.
    db = StoreDB(pg_url)
    try:
        wait_until("both leases ended in the shared history", lambda: len(
            [r for r in db.leases("ended") if r.token_name == "shared"]) == 2)
        # Revoked through B's API, refused by A at the next connection.
        b.api("DELETE", "/api/v1/tokens/shared")
        assert db.get_token("shared").revoked is not None
    finally:
        db.close()
    proc = run_hold(a, hold_gpu, token, 3)
    assert proc.returncode != 0 and "revoked" in proc.stderr, proc.stderr


def test_a_password_in_the_database_url_stops_the_daemon(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "gpupoold", "serve", "--simulated", "1",
                           "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--state-dir",
                           str(tmp_path), "--database", "postgresql://gp:hunter2@db.example/gp"],
                          capture_output=True, text=True, env=daemon_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 78, proc.stderr  # EX_CONFIG: systemd does not restart it
    assert "PGPASSWORD" in proc.stderr and "hunter2" not in proc.stderr


def servers_by_name(server: Any) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in server.get_json("/api/v1/servers")["servers"]}


def test_a_killed_server_is_marked_down_and_its_lease_ended(start_daemon: Any, native_build: Path,
                                                            hold_gpu: Path,  # noqa: F811
                                                            pg_url: str) -> None:
    """Servers on one store register and heartbeat; SIGKILL one during a lease and, within 10 s
    of its last heartbeat, the others show it down and its lease ended ("server down"), while
    they go on serving; a clean stop marks a server down at once."""
    a = start_daemon("--database", pg_url, build_dir=native_build)
    c = start_daemon("--database", pg_url, build_dir=native_build)
    up = wait_until("both servers up", lambda: (
        s := servers_by_name(a), len(s) == 2 and all(v["state"] == "up" for v in s.values())
        and s)[-1])
    me = [n for n, v in up.items() if v["this"]]
    assert len(me) == 1 and up[me[0]]["remoting"] == a.address
    c_name = next(n for n in up if n not in me)
    holder = start_client(c, hold_gpu, MIB, 15_000, 4)  # holds C's GPU for 15 s
    wait_until("a lease on C", lambda: c.get_json("/api/v1/leases?state=active")["leases"])
    c.kill()  # the daemon and its workers: the client loses its connection
    seen = wait_until("C marked down", lambda: servers_by_name(a)[c_name]["state"] == "down",
                      timeout=20)
    assert seen
    down = servers_by_name(a)[c_name]
    assert down["down_since"] - up[c_name]["heartbeat"] < 12 and "no heartbeat" in down["down_reason"]
    db = StoreDB(pg_url)
    try:
        ended = [r for r in db.leases("all") if r.server == c_name]
        assert len(ended) == 1 and ended[0].end_reason == "server down", ended
    finally:
        db.close()
    # C's client gets the usual error at its next call; A goes on serving.
    _, err = holder.communicate(timeout=120)
    assert holder.returncode != 0, err
    proc = run_hold(a, hold_gpu, a.token, 5)
    assert proc.returncode == 0, proc.stderr
    # A clean stop: down at once, with its reason.
    a_name = me[0]
    b = start_daemon("--database", pg_url, build_dir=native_build)
    assert a.stop() == 0
    states = servers_by_name(b)
    assert states[a_name]["state"] == "down" and states[a_name]["down_reason"] == "stopped"
