"""The queue of clients waiting for a GPU: fair between tokens, first come first served within one.

A free GPU goes to the first waiter, in turn, that may take it: one whose requirements the GPU
meets and whose token is under its GPU limit. The turn is taken by tokens, least recently served
first, and within a token in arrival order: the first waiter of every token comes before the
second of any, and a token that was just given a GPU goes to the back. So one tenant's many
clients cannot make another tenant's single client wait behind all of them (a token's queued
clients are many only up to `max_queue_per_token`; the turn makes even those cost another tenant
no more than one lease of the current holder), nobody is overtaken by a later client of the same
token who wants the same GPU, and a waiter who wants a GPU that is busy does not block the ones
behind it who would take another. With one token (or `auth = "none"`) this is arrival order.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpupoold.gpu.inventory import Gpu
from gpupoold.log import printable
from gpupoold.pool.privacy import program_name
from gpupoold.pool.requirements import Requirements


@dataclass(frozen=True)
class ClientInfo:
    """Who a client is, from its hello and its connection; the texts made printable (every
    way in: the hello, the store's records of a lease taken over, the fleet's queue)."""

    host: str
    user: str
    pid: int
    program: str
    peer: str
    # How long the client waits for a connection (its hello's connect_timeout_ms, protocol 1.5;
    # 0: no limit, or a client that does not say): a fleet holds a GPU for its redirect no longer.
    connect_timeout_ms: int = 0

    def __post_init__(self) -> None:
        for name in ("host", "user", "program", "peer"):
            object.__setattr__(self, name, printable(getattr(self, name)))

    def describe(self) -> str:
        """For log lines: the program's name without its arguments (they may hold secrets, and
        logs are kept long and shipped to collectors; the lease record keeps the arguments for
        the owner and the admins)."""
        name = program_name(self.program)
        return f"{self.user}@{self.host} pid {self.pid} ({name or '?'}) from {self.peer}"

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "user": self.user, "pid": self.pid, "program": self.program,
                "peer": self.peer}


@dataclass(eq=False)
class Waiter:
    ticket: int
    req: Requirements
    token: str  # token name (identity)
    client: ClientInfo
    future: asyncio.Future[Any]  # resolved with the GPU slot handed to this waiter
    joined: float = field(default_factory=time.monotonic)
    joined_wall: float = field(default_factory=time.time)
    # A detached lease coming back (pool/detach.py): only GPUs its saved state can be restored
    # on (`only`); max_gpus_per_token counts it while detached, so it takes its own place back
    # and waits only when its token holds more than the limit otherwise.
    returning: int | None = None  # the lease id
    only: Callable[[Gpu], bool] | None = None
    # A fleet (pool/fleet.py) may send it to another server's GPU: its client understands
    # GP_EREDIRECT (protocol 1.3).
    redirectable: bool = False
    # Every GPU (pool/slots.py's Slot, which imports this module) granted to it, program order (a
    # request of several GPUs, `req.gpus`, is granted all at once); the future resolves with the
    # first.
    granted: list[Any] = field(default_factory=list)
    # When it was granted (WaitQueue.granted): its lease starts then, not when the worker that
    # serves it is ready (that takes longer on some GPUs than others, and the history would
    # show two clients granted in turn as started out of turn).
    granted_at: float | None = None  # monotonic
    granted_wall: float | None = None

    def accepts(self, gpu: Gpu) -> bool:
        return self.req.matches(gpu) and (self.only is None or self.only(gpu))

    def waited(self) -> float:
        """Seconds in the queue: until its grant, or until now while it waits."""
        end = self.granted_at if self.granted_at is not None else time.monotonic()
        return end - self.joined

    def started_wall(self) -> float:
        """The wall-clock start of its lease: the grant (now, for one never granted)."""
        return self.granted_wall if self.granted_wall is not None else time.time()


class WaitQueue:
    def __init__(self) -> None:
        self._waiters: list[Waiter] = []  # in arrival order
        self._tickets = itertools.count(1)
        # token -> the number of the grant that last served it (least recently served first;
        # a token never served here: 0). One entry per token name, which the operator makes.
        self._last_served: dict[str, int] = {}
        self._grants = itertools.count(1)

    def join(self, req: Requirements, token: str, client: ClientInfo, *,
             returning: int | None = None, only: Callable[[Gpu], bool] | None = None,
             redirectable: bool = False) -> Waiter:
        """A new waiter at the end. A detached lease coming back (`returning`: its id) too: the
        queue is served in the order the requests were made, a returning lease's when its client
        called again. Putting returning leases first would starve new arrivals whenever the
        tenants take turns (two leases detaching and returning in turn would keep a GPU between
        them forever); in arrival order every client gets its turn (bench/detach_bench.py)."""
        w = Waiter(next(self._tickets), req, token, client,
                   asyncio.get_running_loop().create_future(), returning=returning, only=only,
                   redirectable=redirectable)
        self._waiters.append(w)
        return w

    def leave(self, w: Waiter) -> None:
        if w in self._waiters:
            self._waiters.remove(w)

    def granted(self, w: Waiter) -> None:
        """`w` got its GPU: it leaves, and its token goes to the back of the turn."""
        self.leave(w)
        w.granted_at, w.granted_wall = time.monotonic(), time.time()
        self._last_served[w.token] = next(self._grants)

    def in_turn(self) -> list[Waiter]:
        """The waiters in the order they will be served when every one of them may take every
        GPU: in rounds, each round the next waiter of every token, tokens least recently served
        first (ties: whose first waiter came first). After a round the tokens were served in that
        same order, so the next round keeps it."""
        by_token: dict[str, list[Waiter]] = {}
        for w in self._waiters:
            by_token.setdefault(w.token, []).append(w)
        tokens = sorted(by_token, key=lambda t: (self._last_served.get(t, 0), by_token[t][0].ticket))
        rounds = max((len(ws) for ws in by_token.values()), default=0)
        return [by_token[t][r] for r in range(rounds) for t in tokens if r < len(by_token[t])]

    def position(self, w: Waiter) -> int:
        """1-based place in the turn (0: not waiting any more)."""
        try:
            return self.in_turn().index(w) + 1
        except ValueError:
            return 0

    def waiting(self, token: str) -> int:
        """How many new clients of `token` wait (its detached leases coming back not counted:
        they are not new clients, and `max_queue_per_token` does not refuse them)."""
        return sum(1 for w in self._waiters if w.token == token and w.returning is None)

    def first(self, may_take: Callable[[Waiter], bool]) -> Waiter | None:
        """The first waiter in turn that `may_take` accepts."""
        return next((w for w in self.in_turn() if may_take(w)), None)

    def __len__(self) -> int:
        return len(self._waiters)

    def __iter__(self) -> Iterator[Waiter]:
        return iter(list(self._waiters))

    def view(self) -> list[dict[str, Any]]:
        return [{"position": i + 1, "ticket": w.ticket, "token": w.token,
                 "client": w.client.to_json(), "request": w.req.describe(),
                 "returning_lease": w.returning,
                 "since": w.joined_wall, "waiting_s": round(w.waited(), 3)}
                for i, w in enumerate(self.in_turn())]
