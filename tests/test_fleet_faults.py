"""The fleet under faults (issue 34, item 2): real gpupoold servers on one real PostgreSQL.

- A server cut off from the database but not from its clients: its running lease goes on, it
  grants nothing meanwhile, the others mark it down and give none of its GPUs away, and once the
  link is back it rejoins: a client that was waiting on it when the link went is served, and the
  lease history has every lease once, on one GPU at a time.
- A server cut off in the middle of its fleet sync (holding the fleet's lock) does not stall
  the others: PostgreSQL ends its session and the lock with it.
- PostgreSQL SIGKILLed while the servers are inside a fleet sync, then restarted (a guard:
  today's main was right here): the uncommitted write is gone, the lease across the crash is
  recorded once, both servers serve again.
- A server cut off from the other servers but not from the database (a guard): the fleet goes
  on through the database, nobody is marked down, an admin action forwarded between the two
  fails with a 502 until they reach each other again.
- A burst of 500 light protocol clients at once on one server's address (a guard): each is
  answered with its place in the fleet's queue, and the queue empties when they hang up.
- A server's wall clock jumping: heartbeats and the judgement of silence are the database's
  clock, so a server whose clock jumps ahead marks nobody down, and one whose clock jumps back
  is not marked down.

The cut: the server runs in a network namespace of its own (`Host`) and reaches PostgreSQL at
an address of its own ({NET}.2, a relay to the test server's loopback port); a blackhole route
to that address drops its packets silently, as a dead link does (nothing answers, nothing is
refused, the kernel's TCP timers run), while its clients and the other server reach it at
{NET}.11 all along. (No iptables or nft on the test machines: a route does it.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import psycopg
import pytest
from conftest import ApiError, GpupoolServer, native_paths, require, wait_until
from test_e2e_leases import hold_gpu, start_client  # noqa: F401  (hold_gpu is a fixture)
from test_e2e_token_limits import raw_hello
from test_fleet import assert_no_double_assignment, fleet, history, name_of
from test_fleet_netns import HOSTS, REMOTING_PORT, Lan, hosts, lan, sh, socket_url  # noqa: F401
from test_fleet_netns import NET as LAN
from test_fleet_netns import active as lan_active
from test_fleet_netns import client as lan_client
from test_fleet_netns import names as lan_names
from test_store import new_lease
from test_store_postgres import servers_by_name

from gpupoold.pool import membership
from gpupoold.store import postgres
from gpupoold.store.database import Store, StoreDB
from gpupoold.store.fleet import FLEET_LOCK, SyncInput

MIB = 1 << 20
NET = "10.202.0"


class Relay:
    """A plain TCP relay from `listen` (HOST, 0) to PostgreSQL's port on loopback: what a server
    in a namespace of its own reaches the database through (the test server listens only on
    127.0.0.1)."""

    def __init__(self, host: str, port: int) -> None:
        self._target = ("127.0.0.1", port)
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                down, _ = self._listener.accept()
                up = socket.create_connection(self._target)
            except OSError:
                if self._closed:
                    return
                continue
            self._sockets += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.close()


class Host:
    """A network namespace with one veth to this one: the server at {NET}.11, this side at
    {NET}.1 (where its clients and the other servers are) and {NET}.2 (where it reaches the
    database). `cut()` adds a blackhole route to {NET}.2 in the namespace: its packets to the
    database are dropped silently, as on a dead link, while its clients still reach it;
    `heal()` removes it."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.ns, self.veth = f"gpcut-{tag}", f"gpc{tag}"
        self._made: list[tuple[str, ...]] = []
        try:
            sh("ip", "netns", "add", self.ns)
            self._made.append(("ip", "netns", "del", self.ns))
            sh("ip", "link", "add", self.veth, "type", "veth", "peer", "name", f"{self.veth}n")
            self._made.append(("ip", "link", "del", self.veth))
            sh("ip", "link", "set", f"{self.veth}n", "netns", self.ns)
            for n in (1, 2):
                sh("ip", "addr", "add", f"{NET}.{n}/24", "dev", self.veth)
            sh("ip", "link", "set", self.veth, "up")
            sh("ip", "-n", self.ns, "addr", "add", f"{NET}.11/24", "dev", f"{self.veth}n")
            sh("ip", "-n", self.ns, "link", "set", f"{self.veth}n", "up")
            sh("ip", "-n", self.ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def wrapper(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def cut(self) -> None:
        sh("ip", "-n", self.ns, "route", "add", "blackhole", f"{NET}.2/32")

    def heal(self) -> None:
        sh("ip", "-n", self.ns, "route", "del", "blackhole", f"{NET}.2/32", check=False)

    def close(self) -> None:
        for cmd in reversed(self._made):
            sh(*cmd, check=False)
        self._made.clear()


@pytest.fixture
def host() -> Iterator[Host]:
    require(os.geteuid() == 0, "network namespaces need root")
    require(shutil.which("ip"), "ip (iproute2) makes the namespace")
    made = Host()
    yield made
    made.close()


@pytest.fixture
def cut_off(host: Host, pg_server: Any, pg_url: str, native_build: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpupoolServer]:
    """A gpupoold in `host`'s namespace on pg_url's database, reached through a relay at
    {NET}.2 (over a link the test can cut)."""
    relay = Relay(f"{NET}.2", pg_server.port)
    parts = urllib.parse.urlsplit(pg_url)
    url = urllib.parse.urlunsplit(parts._replace(netloc=f"gpupool@{relay.address}"))
    here = f"{NET}.11"
    state_dir = tmp_path_factory.mktemp("gpupoold-cut")
    config = state_dir / "gpupoold.toml"  # a test link: no TLS to the database
    config.write_text("database_insecure = true\n")
    args = ["--config", str(config), "--listen", f"{here}:0", "--http", f"{here}:0",
            "--simulated", "1", *native_paths(native_build), "--database", url]
    server = GpupoolServer(args, state_dir, native_build, wrapper=host.wrapper(),
                           public_host=here)
    try:
        yield server
    finally:
        host.heal()
        code = server.stop() if server.running else 0
        server.reap_group()
        relay.close()
        problems = server.problems()
        assert code == 0 and not problems, (code, problems)


def active(server: Any) -> list[dict[str, Any]]:
    return server.get_json("/api/v1/leases?state=active")["leases"]


def test_a_server_cut_off_from_the_database_keeps_its_lease_grants_nothing_and_rejoins(
        start_daemon: Any, native_build: Path, hold_gpu: Path, pg_url: str,  # noqa: F811
        host: Host, cut_off: GpupoolServer, clients: list[subprocess.Popen[str]]) -> None:
    a = cut_off
    b = start_daemon("--database", pg_url, build_dir=native_build)
    wait_until("A and B up", lambda: (s := servers_by_name(b), len(s) == 2 and all(
        v["state"] == "up" for v in s.values()))[-1])
    a_name = name_of(a)
    running = start_client(a, hold_gpu, MIB, 9000, 1)  # goes on through the cut
    clients.append(running)
    wait_until("a lease on A", lambda: active(a))
    on_b = start_client(b, hold_gpu, MIB, 16_000, 2)  # B's GPU stays busy through the cut
    clients.append(on_b)
    wait_until("a lease on B", lambda: [x for x in active(b) if x["server"] != a_name])
    waiting = start_client(a, hold_gpu, MIB, 100, 3)  # in the fleet's queue when the link goes
    clients.append(waiting)
    wait_until("a waiter in the fleet's queue", lambda: b.get_json("/api/v1/fleet")["queue"])
    host.cut()
    try:
        # A new client of A is told A cannot reach its database (within the link's timeouts),
        # not left hanging on a store call that waits for a dead link.
        refused = start_client(a, hold_gpu, MIB, 0, 4)
        clients.append(refused)
        # B marks A down, and gives none of A's GPUs away (A's lease is still running there).
        wait_until("A marked down", lambda: servers_by_name(b)[a_name]["state"] == "down",
                   timeout=30)
        assert not [g for g in b.get_json("/api/v1/fleet")["servers"]
                    if g["name"] == a_name and any(x["available"] for x in g["gpus"])]
        _, err = running.communicate(timeout=60)  # A's lease went on to its end
        assert running.returncode == 0, err
        time.sleep(1.5)  # A's GPU is free now: A gives it to nobody while it cannot coordinate
        assert waiting.poll() is None, "a waiter was granted while A was cut off"
        _, err = refused.communicate(timeout=40)
        assert refused.returncode != 0 and "cannot reach its database" in err, err
    finally:
        host.heal()
    wait_until("A up again", lambda: servers_by_name(b)[a_name]["state"] == "up", timeout=30)
    _, err = waiting.communicate(timeout=60)  # served after the rejoin
    assert waiting.returncode == 0, err
    _, err = on_b.communicate(timeout=60)
    assert on_b.returncode == 0, err
    pids = {p.pid for p in (running, on_b, waiting)}
    recs = wait_until("every lease ended in the history", lambda: (
        r := [x for x in history(pg_url) if x.client_pid in pids],
        len(r) == 3 and all(x.ended is not None for x in r) and r)[-1], timeout=30)
    assert_no_double_assignment(recs)
    by_pid = {r.client_pid: r for r in recs}
    assert by_pid[running.pid].end_reason == "client exit", by_pid[running.pid]


# ------------------------------------------------------------------- cut off inside a sync
def test_a_server_silent_inside_a_fleet_sync_does_not_stall_the_fleet(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session that took the fleet's lock and then says nothing more (its server cut off in
    the middle of a sync: to PostgreSQL, a session idle in its transaction) is ended by
    PostgreSQL after IDLE_IN_TRANSACTION_S, and the lock with it: another server's sync goes
    through rather than wait for ever."""
    monkeypatch.setattr(postgres, "IDLE_IN_TRANSACTION_S", 1)
    silent = postgres.PgConnection(pg_url)
    other = StoreDB(pg_url, server="b")
    try:
        silent.execute("BEGIN")
        silent.execute("SELECT pg_advisory_xact_lock(?)", (FLEET_LOCK,))
        done = threading.Event()
        threading.Thread(target=lambda: (other.fleet_sync(SyncInput("b", [], []),
                                                          lambda *_: []), done.set()),
                         daemon=True).start()
        assert done.wait(30), "the fleet's lock is still held by the silent session"
    finally:
        other.close()
        with contextlib.suppress(Exception):
            silent.close()


# ------------------------------------------------------------------------ a clock that jumps
class JumpedClock:
    """What membership.py uses of the `time` module, with the wall clock `offset` s off."""

    def __init__(self, offset: float) -> None:
        self.offset = offset
        self.monotonic = time.monotonic

    def time(self) -> float:
        return time.time() + self.offset


@pytest.mark.parametrize("jump", [3600.0, -3600.0])
async def test_a_servers_clock_jumping_marks_nobody_down(pg_url: str, tmp_path: Path,
                                                         jump: float) -> None:
    """Two servers' memberships on one PostgreSQL; one's wall clock jumps an hour ahead (it
    would see the other silent for an hour) or back (its heartbeats would look an hour old).
    Both heartbeat and look at each other: both stay up, with their leases open."""
    stores = {n: await Store.open(pg_url, server=n, state_dir=tmp_path / n) for n in "ab"}
    try:
        members = {n: membership.Membership(s, f"{n}:7070", f"{n}:7071")
                   for n, s in stores.items()}
        for m in members.values():
            await m.start()  # (registered; the heartbeats below are called by the test)
        lease = await stores["a"].lease_started(new_lease())
        jumper = "b" if jump > 0 else "a"  # ahead: B judges A; back: A's heartbeats are old
        for name in ("a", "b", "a", "b"):
            with mock.patch.object(membership, "time",
                                   JumpedClock(jump) if name == jumper else time):
                await members[name].beat()
        servers = {s["name"]: s["state"] for s in await stores["a"].servers()}
        assert servers == {"a": "up", "b": "up"}
        rec = await stores["b"].get_lease(lease)
        assert rec is not None and rec.ended is None
    finally:
        for m in members.values():
            await m.close()
        for s in stores.values():
            await s.close()


# ----------------------------------------------------------- PostgreSQL killed and restarted
def kill_postgresql(pg_server: Any) -> None:
    """SIGKILL to PostgreSQL's postmaster and every process of it, at once (a crash: no
    shutdown, no checkpoint; the next start recovers from the WAL)."""
    pid = int((pg_server.data / "postmaster.pid").read_text().split()[0])
    children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                and _parent(p) == pid]
    for p in (pid, *children):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    wait_until("PostgreSQL gone", lambda: not any(Path(f"/proc/{p}").exists()
                                                  for p in (pid, *children)))


def _parent(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def test_postgresql_killed_mid_transaction_and_restarted(
        start_daemon: Any, native_build: Path, hold_gpu: Path, pg_server: Any,  # noqa: F811
        pg_url: str, clients: list[subprocess.Popen[str]]) -> None:
    """PostgreSQL SIGKILLed while both servers are inside a fleet sync (they wait for the
    fleet's lock, which a test session holds with a write of its own not committed), then
    started again: the write is gone, the lease that ran across the crash is in the history
    once with its real end, both servers serve again on their own, and no GPU was given twice."""
    a, b = fleet(start_daemon, native_build, pg_url, 2)
    running = start_client(a, hold_gpu, MIB, 5000, 1)
    clients.append(running)
    wait_until("a lease on A", lambda: active(a))
    holder = psycopg.connect(pg_url, autocommit=True)
    holder.execute("BEGIN")
    holder.execute("SELECT pg_advisory_xact_lock(%s)", (FLEET_LOCK,))
    holder.execute("UPDATE servers SET down_reason = 'not committed'")
    waiting = start_client(b, hold_gpu, MIB, 100, 2)  # B's sync waits for the lock now
    clients.append(waiting)
    time.sleep(1.5)  # both servers' periodic syncs are waiting for the lock
    kill_postgresql(pg_server)
    with contextlib.suppress(psycopg.Error):
        holder.close()
    _, err = running.communicate(timeout=60)  # the running lease goes on to its end
    assert running.returncode == 0, err
    pg_server.start()
    _, err = waiting.communicate(timeout=60)  # served once the database is back
    assert waiting.returncode == 0, err
    after = start_client(a, hold_gpu, MIB, 100, 3)
    clients.append(after)
    _, err = after.communicate(timeout=60)
    assert after.returncode == 0, err
    pids = {p.pid for p in (running, waiting, after)}
    recs = wait_until("every lease ended in the history", lambda: (
        r := [x for x in history(pg_url) if x.client_pid in pids],
        len(r) == 3 and all(x.ended is not None for x in r) and r)[-1], timeout=30)
    assert_no_double_assignment(recs)
    assert next(r for r in recs if r.client_pid == running.pid).end_reason == "client exit"
    servers = servers_by_name(a)
    assert all(s["state"] == "up" and s["down_reason"] != "not committed"
               for s in servers.values()), servers


# ------------------------------------------------------- cut off from the others, not the store
def test_a_server_cut_off_from_the_other_servers_but_not_from_the_database(
        lan: Lan, hosts: dict[str, GpupoolServer], hold_gpu: Path,  # noqa: F811
        pg_url: str, clients: list[subprocess.Popen[str]]) -> None:
    """Three hosts on a LAN (tests/test_fleet_netns.py; B's GPU 0 quarantined, its GPU 1
    drained here); A and C cannot
    reach each other (blackhole routes both ways), all reach PostgreSQL and the clients reach
    all. The fleet goes on through the database: a client naming A while A's GPUs are taken is
    sent to C's, nobody is marked down, and an admin action for C sent to A fails with a 502
    that says C did not answer, and works again once they reach each other (a guard: today's
    main was right here)."""
    a, b, c = hosts["a"], hosts["b"], hosts["c"]
    wait_until("three servers up", lambda: (
        n := lan_names(a), len(n) == 3 and all(v["state"] == "up" for v in n.values()))[-1])
    name = {h: next(k for k, v in lan_names(s).items() if v["this"]) for h, s in hosts.items()}
    routes = [(lan.ns["a"], f"{LAN}.{HOSTS['c']}/32"), (lan.ns["c"], f"{LAN}.{HOSTS['a']}/32")]
    for ns, dest in routes:
        sh("ip", "-n", ns, "route", "add", "blackhole", dest)
    # A and B have 2 GPUs each since the netns fleet serves a lease of 2 (2e45575): B's second
    # is drained, so that C's GPU is the only one free in the fleet once A's two are leased.
    b.api("POST", "/api/v1/gpus/1/drain")
    try:
        cut_at = time.monotonic()
        on_a = lan_client(lan, a, hold_gpu, 8000, 1, env={"GPUPOOL_GPUS": "2"})  # both of A's
        clients.append(on_a)
        wait_until("a lease on A", lambda: lan_active(a))
        sent = lan_client(lan, a, hold_gpu, 0, 2)  # names A: sent to C's GPU
        clients.append(sent)
        _, err = sent.communicate(timeout=60)
        assert sent.returncode == 0 and f"gpf-c:{REMOTING_PORT}" in err, err
        with pytest.raises(ApiError) as refused:
            a.api("POST", f"/api/v1/servers/{name['c']}/gpus/0/drain")
        assert refused.value.status == 502 and "did not answer" in str(refused.value), \
            str(refused.value)
        # Past the time after which a silent server is marked down: nobody is.
        time.sleep(max(0.0, membership.DOWN_AFTER_S + 2 * membership.HEARTBEAT_S
                       - (time.monotonic() - cut_at)))
        for s in (a, c):
            assert {v["state"] for v in lan_names(s).values()} == {"up"}
    finally:
        for ns, dest in routes:
            sh("ip", "-n", ns, "route", "del", "blackhole", dest, check=False)
        b.api("POST", "/api/v1/gpus/1/undrain")
    reply = a.api("POST", f"/api/v1/servers/{name['c']}/gpus/0/drain")
    assert reply["server"] == name["c"] and reply["draining"] is True
    a.api("POST", f"/api/v1/servers/{name['c']}/gpus/0/undrain")
    _, err = on_a.communicate(timeout=60)
    assert on_a.returncode == 0, err
    pids = {on_a.pid, sent.pid}
    recs = [r for r in history(pg_url) if r.client_pid in pids]
    assert len(recs) == 2 and {r.server for r in recs} == {name["a"], name["c"]}
    assert_no_double_assignment(recs)


# ------------------------------------------------------------- a burst on one server's address
def test_a_burst_of_500_clients_at_once_on_one_servers_address(
        start_daemon: Any, native_build: Path, hold_gpu: Path, pg_url: str,  # noqa: F811
        tmp_path: Path, clients: list[subprocess.Popen[str]]) -> None:
    """Two servers of a fleet, both GPUs leased; 500 light protocol clients (a hello each, no
    CUDA program) connect to A at the same moment. Each is answered (its place in the fleet's
    queue), the other server sees all 500 in the one queue, and once they hang up the queue is
    empty again on both: a client after them is served as soon as a GPU is free, not after
    500 ghosts (a guard: today's main was right here)."""
    conf = tmp_path / "burst.toml"
    # The handshakes in progress at once (accept to the token's check) are capped against
    # floods: max_handshakes (256) in all, max_handshakes_per_address (32) from one address, and
    # all 500 come from this one; past the caps a connection is closed without a word (the
    # operator guide's "Faults" says so). Lifted here: this is the fleet's burst, not a flood.
    conf.write_text("max_queue = 1000\nmax_queue_per_token = 0\nmax_handshakes = 1000\n"
                    "max_handshakes_per_address = 1000\n")
    a = start_daemon("--config", str(conf), "--database", pg_url, build_dir=native_build,
                     tls=False)
    b = start_daemon("--database", pg_url, build_dir=native_build)
    wait_until("A and B up", lambda: (s := servers_by_name(b), len(s) == 2 and all(
        v["state"] == "up" for v in s.values()))[-1])
    holders = [start_client(s, hold_gpu, MIB, 6000, n) for n, s in enumerate((a, b))]
    clients += holders
    wait_until("both GPUs leased", lambda: len(active(a)) == 2)
    start = threading.Barrier(500)
    answers: list[Any] = [None] * 500
    sockets: list[socket.socket] = []

    def hello(n: int) -> None:
        start.wait()
        try:
            s, reply = raw_hello(a, a.token, 1_000_000 + n)
            sockets.append(s)
            answers[n] = "queued" if reply is None else reply
        except OSError as exc:
            answers[n] = exc

    threads = [threading.Thread(target=hello, args=(n,), daemon=True) for n in range(500)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert answers == ["queued"] * 500, [x for x in answers if x != "queued"][:5]
        wait_until("500 in the fleet's queue, seen from B",
                   lambda: len(b.get_json("/api/v1/fleet")["queue"]) == 500, timeout=30)
    finally:
        for s in sockets:
            s.close()
    for s in (a, b):
        wait_until("the fleet's queue empty", lambda s=s: not s.get_json("/api/v1/fleet")["queue"],
                   timeout=30)
    after = start_client(a, hold_gpu, MIB, 0, 9, env={"GPUPOOL_GPU": "0"})  # A's own GPU
    clients.append(after)
    _, err = after.communicate(timeout=60)
    assert after.returncode == 0, err
    for p in holders:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
