"""Fair admission on the remoting port: how many connections may be in their handshake at once,
and which addresses are refused for a while after too many failed logins.

A connection is "in its handshake" from its accept to the answer to its hello (TLS handshake,
hello, token check): `HandshakeGate` admits at most `max_handshakes` of them, and at most
`max_handshakes_per_address` from one peer address. Past the per-address cap a connection is
closed at once. When the total is full, a newcomer from an address that holds fewer handshakes
than the busiest one takes the place of that address's oldest handshake (which is dropped): so
an attacker who fills the gate from a few addresses cannot keep out a client from anywhere else,
and one who spreads over many addresses must keep replacing its own connections.

`FailedLogins` counts refused tokens per peer address: `limit` failures within `window` seconds
block that address's hellos for `block` seconds ("too many failed logins from ADDR; retry in N s"),
before its token is checked, so that a flood of bogus tokens costs no store look-up.

An address is an IPv4 address or an IPv6 /64 (`peer_host`). Both keep bounded state (a few
thousand addresses) and run on the event loop only.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpupoold.pool.counters import Counters

log = logging.getLogger("gpupoold.remoting")

MAX_ADDRESSES = 4096  # peer addresses FailedLogins remembers; the least recent go first
LOG_EVERY = 10.0  # seconds: refusals of one kind are logged once per this, with their count

# The `reason` label of the counter `admission_refused` (metric gpupool_admission_refusals).
OVER_TOTAL = "handshakes"
OVER_ADDRESS = "handshakes_per_address"
EVICTED = "handshake_replaced"
FAILED_LOGINS = "failed_logins"


def peer_host(peer: str) -> str:
    """The address the limits count a peer under: "HOST:PORT" -> HOST; "[V6]:PORT" (or a bare
    IPv6 address) -> its /64, which one site or host usually holds whole (as one IPv4 address),
    or its IPv4 address when it is an IPv4-mapped one; anything else ("?") as it is."""
    if peer.startswith("["):
        host = peer[1:].partition("]")[0]
    else:
        host, sep, port = peer.rpartition(":")
        if not (sep and ":" not in host and port.isdigit()):
            host = peer
    if ":" not in host:
        return host
    try:
        v6 = ipaddress.IPv6Address(host.partition("%")[0])
    except ValueError:
        return host
    if v6.ipv4_mapped is not None:
        return str(v6.ipv4_mapped)
    return str(ipaddress.IPv6Network((v6, 64), strict=False))


@dataclass(eq=False)
class Handshake:
    """One admitted connection's place in the gate; `release` gives it back (idempotent)."""

    gate: HandshakeGate
    address: str
    task: asyncio.Task[object] | None  # cancelled when another connection takes the place
    evicted: bool = False
    released: bool = False

    def release(self) -> None:
        self.gate.release(self)


@dataclass
class Quiet:
    """Logs a kind of refusal at most once per LOG_EVERY seconds, with the count meanwhile, so
    that a flood cannot flood the journal too."""

    text: str
    clock: Callable[[], float] = time.monotonic
    last: float = -math.inf
    missed: int = 0

    def note(self, *args: object) -> None:
        now = self.clock()
        if now - self.last < LOG_EVERY:
            self.missed += 1
            return
        more = f" ({self.missed} more since the last such line)" if self.missed else ""
        log.warning(self.text + more, *args)
        self.last, self.missed = now, 0


class HandshakeGate:
    def __init__(self, total: int, per_address: int, counters: Counters,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.per_address = per_address
        self._counters = counters
        self._by_address: dict[str, list[Handshake]] = {}  # each list oldest first
        self.count = 0
        self._log_address = Quiet(
            "connection from %s closed at once: %d handshakes from that address are in "
            "progress (max_handshakes_per_address)", clock)
        self._log_total = Quiet(
            "connection from %s closed at once: %d handshakes are in progress (max_handshakes), "
            "none of them from an address with more than this one", clock)
        self._log_evicted = Quiet(
            "handshakes full (max_handshakes = %d): dropped the oldest of %s's %d for a "
            "connection from %s", clock)

    def in_progress(self, address: str) -> int:
        return len(self._by_address.get(address, ()))

    def admit(self, address: str, task: asyncio.Task[object] | None) -> Handshake | None:
        """A place for a new connection from `address` (its task is cancelled should the place
        be taken back), or None: close the connection at once (counted and logged)."""
        mine = self._by_address.get(address, [])
        if len(mine) >= self.per_address:
            self._refused(OVER_ADDRESS)
            self._log_address.note(address, len(mine))
            return None
        if self.count >= self.total:
            busiest = max(self._by_address, key=lambda a: len(self._by_address[a]))
            held = len(self._by_address[busiest])
            if held <= len(mine):
                self._refused(OVER_TOTAL)
                self._log_total.note(address, self.count)
                return None
            victim = self._by_address[busiest][0]
            self._log_evicted.note(self.total, busiest, held, address)
            self._counters.inc("admission_refused", reason=EVICTED)
            victim.evicted = True
            self.release(victim)
            if victim.task is not None:
                victim.task.cancel()
        place = Handshake(self, address, task)
        self._by_address.setdefault(address, []).append(place)
        self.count += 1
        return place

    def release(self, place: Handshake) -> None:
        if place.released:
            return
        place.released = True
        mine = self._by_address[place.address]
        mine.remove(place)
        if not mine:
            del self._by_address[place.address]
        self.count -= 1

    def _refused(self, reason: str) -> None:
        self._counters.inc("admission_refused", reason=reason)


@dataclass
class _Failures:
    times: deque[float] = field(default_factory=deque)
    blocked_until: float = 0.0


class FailedLogins:
    """Refused logins per peer address, and the addresses blocked for a while because of them.
    `limit` 0: no limit."""

    def __init__(self, limit: int, window: float, block: float,
                 clock: Callable[[], float] = time.monotonic,
                 max_addresses: int = MAX_ADDRESSES) -> None:
        self.limit = limit
        self.window = window
        self.block = block
        self._clock = clock
        self._max = max_addresses
        self._by_address: OrderedDict[str, _Failures] = OrderedDict()

    def blocked_for(self, address: str) -> float:
        """Seconds until `address` may try again; 0 when it may now."""
        entry = self._by_address.get(address)
        if entry is None:
            return 0.0
        return max(0.0, entry.blocked_until - self._clock())

    def failed(self, address: str) -> bool:
        """Note a refused login from `address`; True when this one blocks it."""
        if self.limit <= 0:
            return False
        now = self._clock()
        entry = self._by_address.pop(address, None) or _Failures()
        self._by_address[address] = entry  # the most recent last
        while len(self._by_address) > self._max:
            self._by_address.popitem(last=False)
        times = entry.times
        times.append(now)
        while times and times[0] <= now - self.window:
            times.popleft()
        if len(times) < self.limit:
            return False
        times.clear()
        entry.blocked_until = now + self.block
        return True

    def message(self, address: str, wait: float) -> str:
        return (f"too many failed logins from {address}; retry in {math.ceil(wait)} s (check "
                "GPUPOOL_TOKEN: the server refused its last tokens)")
