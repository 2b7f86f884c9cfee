"""Fair admission, piece by piece: the handshake gate (remoting/admission.py), the failed-login
limit per address, the refused-token memory (auth/refused.py, auth/authenticator.py), the HTTP
connection cap (http/limits.py) and the open files limit (fdlimit.py). The whole, against a
flood, is tests/test_e2e_admission.py."""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys

from aiohttp import web
from conftest import daemon_env, require

from gpupoold.auth.authenticator import TokenAuthenticator
from gpupoold.auth.refused import RefusedTokens
from gpupoold.fdlimit import raise_open_files_limit
from gpupoold.http.limits import RUNNER_LIMITS, cap_connections
from gpupoold.pool.counters import Counters
from gpupoold.remoting.admission import FailedLogins, HandshakeGate, peer_host
from gpupoold.store.database import TokenCheck

TOKEN = "gpt_0123456789ab_" + "A" * 43


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_peer_host() -> None:
    assert peer_host("10.1.2.3:5555") == "10.1.2.3"
    # IPv6: a /64 counts as one address (a host or site has one whole, as it has one IPv4).
    assert peer_host("[2001:db8:1:2::1]:7070") == "2001:db8:1:2::/64"
    assert peer_host("[2001:db8:1:2:ffff::9]:7070") == "2001:db8:1:2::/64"
    assert peer_host("2001:db8:1:3::1") == "2001:db8:1:3::/64"  # bare (HTTP's request.remote)
    assert peer_host("[::ffff:10.1.2.3]:5555") == "10.1.2.3"
    assert peer_host("?") == "?"


# ------------------------------------------------------------------------------ handshake gate
def test_gate_caps_each_address_and_counts_the_refusals() -> None:
    counters = Counters()
    gate = HandshakeGate(total=10, per_address=3, counters=counters)
    places = [gate.admit("10.0.0.1", None) for _ in range(3)]
    assert all(places)
    assert gate.admit("10.0.0.1", None) is None  # the 4th from that address
    assert counters.get("admission_refused", reason="handshakes_per_address") == 1
    assert gate.admit("10.0.0.2", None) is not None  # another address is not concerned
    places[0].release()
    places[0].release()  # idempotent
    assert gate.in_progress("10.0.0.1") == 2 and gate.count == 3
    assert gate.admit("10.0.0.1", None) is not None


async def test_a_full_gate_drops_the_busiest_address_oldest_for_a_quieter_one() -> None:
    counters = Counters()
    gate = HandshakeGate(total=4, per_address=8, counters=counters)
    hang = [asyncio.create_task(asyncio.sleep(60)) for _ in range(4)]
    flood = [gate.admit("10.0.0.66", t) for t in hang]
    assert all(flood) and gate.count == 4
    # The flooding address itself gets nothing more: it is the busiest.
    assert gate.admit("10.0.0.66", None) is None
    assert counters.get("admission_refused", reason="handshakes") == 1
    # Anyone else takes the place of its oldest handshake, whose task is cancelled.
    newcomer = gate.admit("10.0.0.1", None)
    assert newcomer is not None and gate.count == 4
    assert flood[0] is not None and flood[0].evicted and flood[0].released
    await asyncio.sleep(0)
    assert hang[0].cancelled() and not any(t.done() for t in hang[1:])
    assert counters.get("admission_refused", reason="handshake_replaced") == 1
    for t in hang[1:]:
        t.cancel()
    # Spread evenly, no address is busier than the newcomer's: it is refused.
    even = HandshakeGate(total=2, per_address=4, counters=counters)
    a, b = even.admit("a", None), even.admit("b", None)
    assert a and b and even.admit("a", None) is None
    assert not a.evicted and not b.evicted


# ------------------------------------------------------------------------------ failed logins
def test_failed_logins_block_an_address_for_a_while() -> None:
    clock = Clock()
    logins = FailedLogins(limit=3, window=10.0, block=60.0, clock=clock)
    assert not logins.failed("10.0.0.9") and not logins.failed("10.0.0.9")
    assert logins.blocked_for("10.0.0.9") == 0
    assert logins.failed("10.0.0.9")  # the 3rd within 10 s
    assert logins.blocked_for("10.0.0.9") == 60.0
    assert logins.blocked_for("10.0.0.10") == 0  # only that address
    assert "too many failed logins from 10.0.0.9; retry in 45 s" in logins.message("10.0.0.9",
                                                                                  44.2)
    clock.now += 60.0
    assert logins.blocked_for("10.0.0.9") == 0


def test_failures_spread_over_more_than_the_window_do_not_block() -> None:
    clock = Clock()
    logins = FailedLogins(limit=3, window=10.0, block=60.0, clock=clock)
    for _ in range(10):
        assert not logins.failed("10.0.0.9")
        clock.now += 5.1
    assert not FailedLogins(limit=0, window=10.0, block=60.0).failed("x")  # 0: no limit


def test_failed_logins_remember_a_bounded_number_of_addresses() -> None:
    logins = FailedLogins(limit=2, window=10.0, block=60.0, max_addresses=100)
    for i in range(1000):
        logins.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(logins._by_address) == 100


# ------------------------------------------------------------------------------ refused tokens
def test_refused_tokens_expire_and_are_bounded() -> None:
    clock = Clock()
    refused: RefusedTokens[str] = RefusedTokens(ttl=60.0, size=3, clock=clock)
    refused.put(TOKEN, "no")
    assert refused.get(TOKEN) == "no" and refused.get(TOKEN + "x") is None
    assert TOKEN not in repr(refused._entries)  # a hash of the token, never its text
    clock.now += 60.0
    assert refused.get(TOKEN) is None and len(refused) == 0
    for i in range(10):
        refused.put(f"t{i}", str(i))
    assert len(refused) == 3 and refused.get("t9") == "9" and refused.get("t0") is None


class CountingStore:
    """verify_token answers from a table, counting the look-ups."""

    def __init__(self, results: dict[str, TokenCheck]) -> None:
        self.results = results
        self.lookups = 0

    async def verify_token(self, token: str) -> TokenCheck:
        self.lookups += 1
        return self.results.get(token, TokenCheck("malformed"))


async def test_a_refused_token_is_refused_from_memory() -> None:
    clock = Clock()
    store = CountingStore({TOKEN: TokenCheck("unknown", token_id="0123456789ab")})
    auth = TokenAuthenticator(store, clock=clock)  # type: ignore[arg-type]
    first = await auth.check(TOKEN, "10.0.0.1:1")
    assert not first.ok and first.reason == "unknown" and not first.remembered
    for _ in range(100):
        again = await auth.check(TOKEN, "10.0.0.2:2")
        assert not again.ok and again.remembered and again.message == first.message
    assert store.lookups == 1
    clock.now += 61
    assert not (await auth.check(TOKEN, "10.0.0.1:1")).remembered
    assert store.lookups == 2
    # A malformed token is never remembered (its check needs no store anyway).
    for _ in range(3):
        assert not (await auth.check("nonsense", "10.0.0.1:1")).remembered


# ------------------------------------------------------------------------------ HTTP listener
async def test_http_connections_over_the_cap_get_503_and_are_counted() -> None:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app, **RUNNER_LIMITS)
    await runner.setup()
    counters = Counters()
    assert runner.server is not None
    cap_connections(runner.server, 2, counters)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 5" in answer
        assert b"http_max_connections" in answer
        assert counters.get("http_admission_refused", reason="connections") == 1
        writer.close()
        # One of the held connections is still served as usual.
        r, w = held[0]
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r.readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
        for _, w in held:
            w.close()
        await asyncio.sleep(0.2)
        r, w = await asyncio.open_connection("127.0.0.1", port)  # room again
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r.readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
        w.close()
    finally:
        await runner.cleanup()


async def test_http_head_limits() -> None:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app, **RUNNER_LIMITS)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        for fields, status in ((60, b" 200 "), (100, b" 400 ")):  # RUNNER_LIMITS: 64 fields
            r, w = await asyncio.open_connection("127.0.0.1", port)
            head = b"".join(b"X-F%d: v\r\n" % i for i in range(fields - 1))
            w.write(b"GET / HTTP/1.1\r\nHost: x\r\n" + head + b"Connection: close\r\n\r\n")
            answer = await asyncio.wait_for(r.read(), 5)
            assert status in answer.split(b"\r\n")[0], (fields, answer[:200])
            w.close()
    finally:
        await runner.cleanup()


# ------------------------------------------------------------------------------ open files
def test_the_soft_open_files_limit_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    require(hard != resource.RLIM_INFINITY and hard >= 2, "no finite hard limit to test with")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard // 2, hard))
        assert raise_open_files_limit() == (hard, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_low_hard_limit_is_logged_with_what_to_do() -> None:
    # In a child: lowering the hard limit cannot be undone.
    code = ("import logging, resource\n"
            "logging.basicConfig(level=logging.INFO)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512))\n"
            "from gpupoold.fdlimit import raise_open_files_limit\n"
            "print(raise_open_files_limit())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=daemon_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(512, 512)"
    assert "the open files limit is 512 (hard limit 512)" in proc.stderr
    assert "LimitNOFILE=65536" in proc.stderr
