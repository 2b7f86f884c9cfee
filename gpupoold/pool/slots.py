"""A GPU's place in the pool (`Slot`) and the lease on it (`Lease`): the lease manager's state.

A slot is in exactly one of the five states below; pool/leases.py moves it between them (its
docstring draws the transitions), pool/watchdog.py, pool/views.py and the metrics only read it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from gpupoold.gpu.inventory import Gpu
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.waitqueue import ClientInfo, Waiter
from gpupoold.workers.supervisor import Worker

FREE, LEASED, SCRUBBING, QUARANTINED, DRAINED = (
    "free", "leased", "scrubbing", "quarantined", "drained")


@dataclass(eq=False)
class Lease:
    id: int
    slot: Slot
    token: str
    client: ClientInfo
    req: Requirements
    worker: Worker
    queued_s: float
    started: float = field(default_factory=time.time)
    end_override: tuple[str, str] | None = None  # (reason, detail) set when we end it
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class Slot:
    gpu: Gpu
    state: str = SCRUBBING
    since: float = field(default_factory=time.time)
    draining: bool = False
    lease: Lease | None = None
    reserved: Waiter | None = None  # granted, lease not started yet (state leased)
    idle_worker: Worker | None = None
    prestart_task: asyncio.Task[None] | None = None
    quarantine: dict[str, Any] | None = None
    last_scrub: dict[str, Any] | None = None
    # The task that moves the GPU on from `leased` or `scrubbing` (its lease's watcher, or a
    # scrub): the watchdog repairs a GPU in one of those states that has none.
    task: asyncio.Task[Any] | None = None
    reserved_at: float = 0.0  # time.monotonic() of the grant in `reserved`
    adopting: int | None = None  # the previous daemon's lease being taken over (state leased)
    stuck: dict[str, Any] | None = None  # {"since", "why"}: seen by the watchdog, not repaired yet
    repairs: list[float] = field(default_factory=list)  # monotonic times of watchdog repairs

    def set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.since = time.time()

    def holder(self) -> str | None:
        if self.lease is not None:
            return self.lease.token
        if self.reserved is not None:
            return self.reserved.token
        return None
