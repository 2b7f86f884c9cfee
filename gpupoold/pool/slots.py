"""A GPU's place in the pool (`Slot`) and the lease on it (`Lease`): the pool's state.

A slot is in exactly one of the five states below, a lease in one of its four; pool/state.py
alone moves them (its docstring draws the transitions), the policies call it, and
pool/watchdog.py, pool/views.py and the metrics only read them. The fields marked "policy" are
bookkeeping of the policy named beside them, not the state.
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
# A lease's own states (idle detach, pool/detach.py): on its GPU; parked and being checkpointed;
# its state in server host memory, no GPU; its client called again and it waits for a GPU or is
# being restored on one.
ATTACHED, DETACHING, DETACHED, ATTACHING = "attached", "detaching", "detached", "attaching"


@dataclass(eq=False)
class Lease:
    id: int
    slot: Slot | None  # None while detached (or attaching, until its GPU is restored)
    token: str
    client: ClientInfo
    req: Requirements
    worker: Worker
    queued_s: float
    started: float = field(default_factory=time.time)
    end_override: tuple[str, str] | None = None  # (reason, detail) set when we end it
    timer: asyncio.TimerHandle | None = None
    watcher: asyncio.Task[Any] | None = None  # waits for the worker's exit (pool/leases.py)
    # Idle detach (pool/detach.py)
    state: str = ATTACHED
    state_since: float = field(default_factory=time.time)
    keep_gpu: str | None = None  # why this lease never detaches (None: it may)
    not_now: str = ""  # why the last try did not detach it
    cycle: asyncio.Task[Any] | None = None  # the detach cycle running, if any
    next_try: float = 0.0  # time.monotonic() before which no detach is tried again
    home: Gpu | None = None  # the GPU it was detached from (the model its state needs)
    homes: list[Gpu] = field(default_factory=list)  # every GPU it left, program order
    detaches: int = 0
    detached_s: float = 0.0  # total time detached, the current detach not included
    saved_bytes: int = 0  # device memory held in host memory while detached
    # A lease of several GPUs (GPUPOOL_GPUS, issue 37): its GPUs after `slot`, in the order its
    # program sees them (`slot` is device 0, whose worker serves the client). Each of them holds
    # the lease (`Slot.lease`) as `slot` does; it detaches from all of them at once and comes
    # back on as many (pool/detach.py).
    other_slots: list[Slot] = field(default_factory=list)
    # A share of a shared GPU (issue 32): on its GPU's `shares`, not `lease`; detached, it comes
    # back through pool/shares.py's placement (room for its quota) rather than a whole GPU.
    share: bool = False

    def slots(self) -> list[Slot]:
        """Every GPU it is on, program order (none while detached)."""
        return ([self.slot] if self.slot is not None else []) + self.other_slots

    def gpu_indexes(self) -> list[int]:
        """The indexes of every GPU it is on, program order; detached: the one it left."""
        on = [s.gpu.index for s in self.slots()]
        return on or [self.gpu_index()]

    def gpu_index(self) -> int:
        """The GPU it is on, or (detached) the one it left."""
        if self.slot is not None:
            return self.slot.gpu.index
        return self.home.index if self.home is not None else -1


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
    # time.monotonic() when its lease ended and the watcher went on to record the end; the GPU
    # stays leased, with no lease, until the watcher starts its scrub (pool/state.py `end`)
    ended_at: float | None = None
    stuck: dict[str, Any] | None = None  # {"since", "why"}: seen by the watchdog, not repaired yet
    repairs: list[float] = field(default_factory=list)  # monotonic times of watchdog repairs
    # A shared GPU (`share` > 1, issue 32; pool/shares.py places them): its shares' leases (each
    # with its own worker; `lease` stays None) and the share grants whose lease has not started.
    # While it has either it is `leased`; its last share's end scrubs it whole.
    shares: list[Lease] = field(default_factory=list)
    share_grants: list[Waiter] = field(default_factory=list)
    share_closed: bool = False  # a share's worker died: no new share until the whole scrub
    kept_for: int | None = None  # the ticket of the whole-GPU waiter it is drained of shares for

    def share_quotas(self) -> dict[int, int]:
        """Its shares' and share grants' memory (lease id, or minus the waiter's ticket)."""
        quotas = {le.id: le.req.quota(self.gpu) for le in self.shares}
        quotas.update({-w.ticket: w.req.quota(self.gpu) for w in self.share_grants})
        return quotas

    def holder(self) -> str | None:
        if self.lease is not None:
            return self.lease.token
        if self.reserved is not None:
            return self.reserved.token
        if self.shares:  # a shared GPU: its first share's token (the GPU views name it alone)
            return self.shares[0].token
        if self.share_grants:
            return self.share_grants[0].token
        return None
