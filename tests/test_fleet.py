"""A fleet: several gpupoold servers on one PostgreSQL store give their GPUs out as one pool
(pool/fleet.py, store/fleet.py). First the decisions alone (`match`), then end to end with three
real daemons of one simulated GPU each and real clients (tests/clients/hold_gpu.c) that all name
the first server: they are spread over the three GPUs by redirects, wait in one FIFO queue, and no
GPU is ever given to two of them (checked in the lease history)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ApiError, wait_until
from test_dashboard_browser import artifacts, chromium  # noqa: F401  (fixtures)
from test_e2e_leases import hold_gpu, start_client  # noqa: F401  (hold_gpu is a fixture)
from test_store_postgres import run_hold, servers_by_name

from gpupoold.pool.fleet import match
from gpupoold.store.database import StoreDB
from gpupoold.store.fleet import GpuRow, QueueRow

MIB = 1 << 20


# ----------------------------------------------------------------------------- the decisions
def gpu(server: str, index: int = 0, *, free: bool = True, name: str = "H100",
        holder: int | None = None, token: str = "") -> GpuRow:
    return GpuRow(server=server, index=index, uuid=f"GPU-{server}-{index}", name=name,
                  memory_total=80 << 30, simulated=True, state="free" if free else "leased",
                  free=free, lease_id=None, token=token, updated=0.0, holder=holder,
                  holder_token="x" if holder else "")


def waiter(ticket: int, server: str, *, token: str = "t", model: str = "",
           only: tuple[int, ...] | None = None, redirectable: bool = True,
           state: str = "waiting") -> QueueRow:
    return QueueRow(ticket=ticket, server=server, token=token, client={"host": "h", "pid": ticket},
                    request={"gpu": "", "model": model, "min_memory": 0}, only=only,
                    redirectable=redirectable, joined=0.0, state=state)


UP = {"a", "b", "c"}


def test_a_waiter_takes_a_gpu_of_its_own_server_first_then_another() -> None:
    gpus = [gpu("a", free=False), gpu("b"), gpu("c")]
    assert match(gpus, [waiter(1, "a")], UP) == [(1, "b", 0)]
    gpus = [gpu("a"), gpu("b"), gpu("c")]
    assert match(gpus, [waiter(1, "b"), waiter(2, "b")], UP) == [(1, "b", 0), (2, "a", 0)]


def test_the_first_waiter_in_ticket_order_that_accepts_a_gpu_gets_it() -> None:
    gpus = [gpu("a", free=False), gpu("b", name="A100")]
    queue = [waiter(1, "a", model="H100"), waiter(2, "c", model="A100"), waiter(3, "a")]
    # Ticket 1 wants an H100 (none free): it keeps its place; 2 takes the A100 before 3.
    assert match(gpus, queue, UP) == [(2, "b", 0)]


def test_held_gpus_down_servers_and_assigned_waiters_are_skipped() -> None:
    gpus = [gpu("a", holder=9), gpu("b"), gpu("c")]
    queue = [waiter(1, "a", state="assigned"), waiter(2, "c"), waiter(3, "a")]
    assert match(gpus, queue, {"a", "c"}) == [(2, "c", 0)]  # b is down: its GPU is not offered


def test_a_waiter_that_cannot_be_redirected_stays_on_its_server() -> None:
    gpus = [gpu("a", free=False), gpu("a", 1), gpu("b")]
    queue = [waiter(1, "a", redirectable=False), waiter(2, "a", only=(0,))]
    assert match(gpus, queue, UP) == [(1, "a", 1)]


def test_a_token_at_its_fleet_wide_limit_waits() -> None:
    gpus = [gpu("a", free=False, token="t"), gpu("b"), gpu("c")]
    assert match(gpus, [waiter(1, "a"), waiter(2, "a", token="u")], UP, 1) == [(2, "b", 0)]
    assert match(gpus, [waiter(1, "a"), waiter(2, "b")], UP, 2) == [(1, "b", 0)]


# ---------------------------------------------------------------------------------- end to end
def fleet(start_daemon: Any, native_build: Path, pg_url: str, n: int = 3) -> list[Any]:
    servers = [start_daemon("--database", pg_url, build_dir=native_build) for _ in range(n)]
    wait_until("every server up", lambda: (s := servers_by_name(servers[0]), len(s) == n and all(
        v["state"] == "up" for v in s.values()))[-1])
    return servers


def name_of(server: Any) -> str:
    return next(n for n, v in servers_by_name(server).items() if v["this"])


def history(pg_url: str) -> list[Any]:
    db = StoreDB(pg_url)
    try:
        return db.leases("all", limit=1000)
    finally:
        db.close()


def test_one_token_for_the_fleet_and_revocation_everywhere(start_daemon: Any, native_build: Path,
                                                          hold_gpu: Path, pg_url: str,  # noqa: F811
                                                          tmp_path: Path) -> None:
    a, b, c = fleet(start_daemon, native_build, pg_url)
    token = a.api("POST", "/api/v1/tokens", {"name": "fleet-user"})["secret"]
    for server, seed in ((b, 1), (c, 2)):
        proc = run_hold(server, hold_gpu, token, seed)
        assert proc.returncode == 0, proc.stderr
    b.api("DELETE", "/api/v1/tokens/fleet-user")
    revoked = time.monotonic()
    for server in (a, c):  # every server checks the token at the store: refused at once
        proc = run_hold(server, hold_gpu, token, 3)
        assert proc.returncode != 0 and "revoked" in proc.stderr, proc.stderr
        with pytest.raises(ApiError) as refused:
            server.get_json("/api/v1/gpus", token=token)
        assert refused.value.status == 401
    assert time.monotonic() - revoked < 2 + 10  # two client runs; the refusal itself is at once


def test_nine_clients_naming_one_server_spread_over_the_fleet_in_fifo_order(
        start_daemon: Any, native_build: Path, hold_gpu: Path, pg_url: str,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    a, b, c = fleet(start_daemon, native_build, pg_url)
    names = {name_of(s): s for s in (a, b, c)}
    procs = []
    for seed in range(9):
        procs.append(start_client(a, hold_gpu, MIB, 2500, seed + 10))
        clients.append(procs[-1])
        time.sleep(0.4)  # a known arrival order
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    order = {p.pid: i for i, p in enumerate(procs)}
    leases = sorted((r for r in history(pg_url) if r.client_pid in order),
                    key=lambda r: order[r.client_pid])
    assert len(leases) == 9
    used = {r.server for r in leases}
    assert used == set(names), used  # all three GPUs served them
    assert {leases[i].server for i in range(3)} == set(names)  # the first three at once
    # FIFO across the fleet: no client started long before one that arrived earlier (a
    # redirect's reconnect may reorder starts by a moment, never by a whole lease of 2.5 s).
    for i in range(9):
        for j in range(i + 1, 9):
            assert leases[j].started > leases[i].started - 1.0, (i, j, leases)
    assert_no_double_assignment(leases)
    log = a.log_text()
    assert "sent to GPU 0 of server" in log


def assert_no_double_assignment(leases: list[Any]) -> None:
    by_gpu: dict[tuple[str, int], list[Any]] = {}
    for r in leases:
        by_gpu.setdefault((r.server, r.gpu_index), []).append(r)
    for key, recs in by_gpu.items():
        recs.sort(key=lambda r: r.started)
        for x, y in zip(recs, recs[1:], strict=False):
            assert x.ended is not None and x.ended <= y.started, (key, x, y)


def test_thirty_two_clients_on_three_servers_never_share_a_gpu(
        start_daemon: Any, native_build: Path, hold_gpu: Path, pg_url: str,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    servers = fleet(start_daemon, native_build, pg_url)
    procs = []
    for seed in range(32):  # all at once, naming the three servers in turn
        procs.append(start_client(servers[seed % 3], hold_gpu, MIB, 100, seed + 100))
        clients.append(procs[-1])
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    pids = {p.pid for p in procs}
    leases = [r for r in history(pg_url) if r.client_pid in pids]
    assert len(leases) == 32
    assert_no_double_assignment(leases)
    assert len({r.server for r in leases}) == 3


def test_a_killed_server_leaves_the_fleet_and_the_queue_moves_on(
        start_daemon: Any, native_build: Path, hold_gpu: Path, pg_url: str,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    a, b, c = fleet(start_daemon, native_build, pg_url)
    c_name = name_of(c)
    on_c = start_client(c, hold_gpu, MIB, 30_000, 1)
    clients.append(on_c)
    wait_until("a lease on C", lambda: c.get_json("/api/v1/leases?state=active")["leases"])
    on_a = start_client(a, hold_gpu, MIB, 4000, 2)
    on_b = start_client(b, hold_gpu, MIB, 4000, 3)
    waiting = start_client(a, hold_gpu, MIB, 100, 4)  # queued behind them
    clients += [on_a, on_b, waiting]
    wait_until("A and B leased", lambda: all(
        s.get_json("/api/v1/leases?state=active")["leases"] for s in (a, b)))
    c.kill()
    t0 = time.monotonic()
    wait_until("C down", lambda: servers_by_name(a)[c_name]["state"] == "down", timeout=20)
    assert time.monotonic() - t0 < 12
    view = a.get_json("/api/v1/fleet")
    c_view = next(s for s in view["servers"] if s["name"] == c_name)
    assert c_view["state"] == "down" and all(not g["available"] for g in c_view["gpus"])
    recs = [r for r in history(pg_url) if r.server == c_name]
    assert recs and all(r.end_reason == "server down" for r in recs)
    for p in (on_a, on_b, waiting):
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    on_c.communicate(timeout=120)
    assert on_c.returncode != 0


def test_postgresql_stopped_and_started_during_a_run(start_daemon: Any, native_build: Path,
                                                     hold_gpu: Path, pg_server: Any,  # noqa: F811
                                                     pg_url: str,
                                                     clients: list[subprocess.Popen[str]]) -> None:
    a, b = fleet(start_daemon, native_build, pg_url, 2)
    running = start_client(a, hold_gpu, MIB, 8000, 1)
    clients.append(running)
    wait_until("a lease on A", lambda: a.get_json("/api/v1/leases?state=active")["leases"])
    pg_server.stop()
    try:
        refused = run_hold(b, hold_gpu, b.token, 2)  # a new connection: a clear error
        assert refused.returncode != 0 and "cannot reach its database" in refused.stderr, \
            refused.stderr
        _, err = running.communicate(timeout=120)  # the running lease finishes
        assert running.returncode == 0, err
    finally:
        pg_server.start()
    # Both servers recover by themselves: new leases work, and the lease that ended while the
    # database was down is in the history.
    wait_until("B serves again", lambda: run_hold(b, hold_gpu, b.token, 3).returncode == 0,
               timeout=60)
    ended = wait_until("the outage's lease recorded", lambda: [
        r for r in history(pg_url) if r.client_pid == running.pid and r.ended is not None],
        timeout=30)
    assert ended[0].end_reason == "client exit"
    # The spool's replay says so once all its records are in (the lease end above is one of
    # them: the line may come a moment after it).
    a.wait_for_log(r"the store is reachable again: \d+ record\(s\) written from the spool")


def test_the_fleet_page_of_one_server_follows_and_acts_on_the_whole_fleet(
        start_daemon: Any, native_build: Path, hold_gpu: Path, pg_url: str,  # noqa: F811
        chromium: Any, artifacts: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    """Server A's Fleet page, in headless Chromium, as an admin (tests/browser.py; the markup:
    docs/dashboard.md): all three servers with their health; a lease starting on C appears by
    itself; the Drain button of B's GPU drains it on B (B's API says so, B audits it) and the page,
    never reloaded, shows it drained."""
    from test_dashboard_browser import login

    a, b, c = fleet(start_daemon, native_build, pg_url)
    a_name, b_name, c_name = name_of(a), name_of(b), name_of(c)
    page = chromium.new_page(1280, 900)
    login(page, a, a.admin_token)
    page.goto(a.http_url + "/ui/fleet")
    try:
        page.wait_for("document.body.dataset.live === 'connected'", what="the Fleet page's stream")
        page.evaluate("window.__gpupoolMarker = 'kept'")
        cards = page.evaluate("[...document.querySelectorAll('article.fleet-gpu')]"
                              ".map(e => [e.dataset.server, e.dataset.state])")
        assert sorted(cards) == sorted([[n, "free"] for n in (a_name, b_name, c_name)]), cards
        # Each server's health: B's HTTP listener (where A sends actions on B's GPUs) reachable.
        health = f"document.querySelector('section.fleet-server[data-server=\"{b_name}\"] p.health')"
        page.wait_for(f"{health}.dataset.reachable === '1'", what="B reachable from A")
        assert "last heartbeat" in page.evaluate(f"{health}.innerText")

        # ---- a lease starting on C appears on A's page by itself
        clients.append(start_client(c, hold_gpu, MIB, 20_000, 1))
        lease = wait_until("a lease on C",
                           lambda: c.get_json("/api/v1/leases?state=active")["leases"])[0]
        page.wait_for(f"!!document.querySelector('#fleet-leases tr[data-server=\"{c_name}\"]"
                      f"[data-lease=\"{lease['id']}\"]') && document.querySelector("
                      f"'article.fleet-gpu[data-server=\"{c_name}\"]').dataset.state === "
                      "'leased'", timeout=10, what="C's lease on A's page")

        # ---- drain B's GPU from A's page: done on B, shown on A's page without a reload
        page.evaluate("window.confirm = q => { window.__asked = q; return true; }")
        drain = f'article.fleet-gpu[data-server="{b_name}"] button[data-action="drain"]'
        page.wait_for(f"!!document.querySelector('{drain}')",
                      what="the Drain button of B's GPU")
        page.click(drain)
        page.wait_for("document.getElementById('fleet-action').dataset.result === 'done'",
                      what="the drain to be done")
        assert b_name in page.evaluate("window.__asked")
        assert b.get_json("/api/v1/gpus/0")["draining"] is True
        audit = b.get_json("/api/v1/audit")["audit"][0]
        assert audit["action"] == "gpu.drain" and audit["actor"].startswith("local-admin@"), audit
        page.wait_for(f"document.querySelector('article.fleet-gpu[data-server=\"{b_name}\"]')"
                      ".dataset.state === 'drained'", timeout=10, what="B's GPU drained on A's page")
        assert page.evaluate(f"!!document.querySelector('article.fleet-gpu[data-server="
                             f"\"{b_name}\"] button[data-action=\"undrain\"]')")
        assert page.evaluate("window.__gpupoolMarker") == "kept", "the page was reloaded"
        page.screenshot(artifacts / "fleet.png")
    except Exception:
        page.screenshot(artifacts / "fleet-failure.png")
        (artifacts / "fleet-failure.html").write_text(page.html())
        raise


def test_gpupool_status_and_smi_show_the_fleet(start_daemon: Any, native_build: Path,
                                               hold_gpu: Path, pg_url: str,  # noqa: F811
                                               clients: list[subprocess.Popen[str]]) -> None:
    """A user who knows server A only sees every server of its fleet and their GPUs."""
    import json

    from test_status_smi import cli_env, gpupool

    a, b = fleet(start_daemon, native_build, pg_url, 2)
    b_name = name_of(b)
    holder = start_client(b, hold_gpu, MIB, 20_000, 1)
    clients.append(holder)
    wait_until("a lease on B", lambda: b.get_json("/api/v1/leases?state=active")["leases"])
    env = cli_env([a.address], a.token, a.fingerprint)

    def status_shows_it() -> str | None:
        out = gpupool(env, "status").stdout
        return out if "Fleet: 2 servers" in out and "lease" in out.split(b_name)[-1] else None

    out = wait_until("gpupool status shows B's lease", status_shows_it, timeout=15)
    assert f"{b_name} at {b.address}: up" in out, out
    smi = json.loads(gpupool(env, "smi", "--json").stdout)
    assert {g["server"] for g in smi["gpus"]} == {a.address, b.address}, smi["gpus"]
    assert [g["state"] for g in smi["gpus"] if g["server"] == b.address] == ["leased"]


def test_admin_actions_reach_any_server_of_the_fleet(start_daemon: Any, native_build: Path,
                                                     hold_gpu: Path, pg_url: str,  # noqa: F811
                                                     clients: list[subprocess.Popen[str]],
                                                     ) -> None:
    """Through A's API: drain and undrain B's GPU, end the lease running on B; refused for a
    user token and for a server that is not in the fleet."""
    a, b = fleet(start_daemon, native_build, pg_url, 2)
    b_name = name_of(b)
    gpu = a.api("POST", f"/api/v1/servers/{b_name}/gpus/0/drain")
    assert gpu["draining"] is True and b.get_json("/api/v1/gpus/0")["draining"] is True
    audit = b.get_json("/api/v1/audit")["audit"]
    assert audit[0]["action"] == "gpu.drain" and audit[0]["actor"].startswith("local-admin@") \
        and audit[0]["actor"] != name_of(b).join(("local-admin@", "")), audit[0]
    a.api("POST", f"/api/v1/servers/{b_name}/gpus/0/undrain")
    wait_until("B's GPU back in service", lambda: b.get_json("/api/v1/gpus/0")["state"] == "free")
    holder = start_client(b, hold_gpu, MIB, 6_000, 1)  # ended long before it would exit
    clients.append(holder)
    lease = wait_until("a lease on B",
                       lambda: b.get_json("/api/v1/leases?state=active")["leases"])[0]
    ended = a.api("POST", f"/api/v1/servers/{b_name}/leases/{lease['id']}/end",
                  {"reason": "fleet test"})
    assert ended["id"] == lease["id"]
    holder.communicate(timeout=60)
    assert holder.returncode != 0
    with pytest.raises(ApiError) as refused:
        a.api("POST", f"/api/v1/servers/{b_name}/gpus/0/drain", token=a.token)
    assert refused.value.status == 403
    with pytest.raises(ApiError) as missing:
        a.api("POST", "/api/v1/servers/nobody/gpus/0/drain")
    assert missing.value.status == 404 and b_name in missing.value.body
