"""The watchdog: finds GPUs that cannot move on by themselves, reports them, and has them
repaired (docs/architecture.md, "Reliability").

A leased or scrubbing GPU always has a task that will move it on (its lease's watcher, a scrub);
a free one holds nothing. A GPU in any other situation is "stuck": a bug, or a failure nothing
else caught (a failing store once left GPUs leased forever). Every WATCHDOG_INTERVAL each GPU is
checked; a stuck one is reported at once (`Slot.stuck`: /healthz answers 503, the GPU view and
gpupool_gpu_stuck show it) and repaired when it is still stuck, for the same reason, at the next
check; a GPU repaired more than REPAIR_LIMIT times in REPAIR_WINDOW is quarantined instead.

What a repair does belongs to the lease manager (it knows leases and scrubs): this module only
decides when, through the two callbacks it is given.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpupoold.pool.slots import Slot

log = logging.getLogger("gpupoold.leases")

WATCHDOG_INTERVAL = 0.5  # seconds between checks of every GPU
# A grant's lease must start within this: a worker spawn (60 s at most), the store, the hello.
GRANT_LIMIT = 120.0
# A lease's end must be recorded (the store: a thread, or PostgreSQL over the network) within this
# before its watcher scrubs the GPU; until then the GPU is leased with no lease, legitimately.
END_RECORD_LIMIT = 60.0
REPAIR_WINDOW = 600.0  # seconds: more than REPAIR_LIMIT repairs in this window quarantine a GPU
REPAIR_LIMIT = 3


def stuck_reason(slot: Slot) -> str | None:
    """Why `slot` cannot move on by itself (None: it can)."""
    task_alive = slot.task is not None and not slot.task.done()
    if slot.state == "leased":
        if slot.reserved is not None:
            waited = time.monotonic() - slot.reserved_at
            if waited > GRANT_LIMIT:
                return f"granted to a client {waited:.0f} s ago but its lease never started"
            return None
        if slot.lease is None:
            if slot.shares or slot.share_grants:  # a shared GPU: each share's watcher moves it on
                return None
            if slot.adopting is not None and task_alive:
                return None  # a previous daemon's lease being taken over
            if (slot.ended_at is not None and task_alive
                    and time.monotonic() - slot.ended_at < END_RECORD_LIMIT):
                return None  # its lease ended: the watcher records the end, then scrubs
            return "leased, but no lease holds it"
        if not task_alive:
            return f"lease {slot.lease.id} has nobody watching its worker"
        return None
    if slot.state == "scrubbing" and not task_alive:
        return "scrubbing, but no scrub is running"
    if slot.state in ("free", "drained") and (slot.lease is not None or slot.reserved is not None):
        return f"{slot.state}, but still held by a lease or a grant"
    return None


class Watchdog:
    """Checks `slots` until stopped. `repair(slot, why)` and `quarantine(slot, reason)` are the
    lease manager's; `changed(slot)` tells the views' listeners; `count()` counts a repair."""

    def __init__(self, slots: Sequence[Slot], repair: Callable[[Slot, str], None],
                 quarantine: Callable[[Slot, str], None], changed: Callable[[Slot], None],
                 count: Callable[[], None]) -> None:
        self.slots = slots
        self._repair = repair
        self._quarantine = quarantine
        self._changed = changed
        self._count = count

    async def run(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL)
            for slot in self.slots:
                try:
                    self.check(slot)
                except Exception:
                    log.exception("watchdog: checking GPU %d failed", slot.gpu.index)

    def check(self, slot: Slot) -> None:
        why = stuck_reason(slot)
        if why is None:
            if slot.stuck is not None:
                slot.stuck = None
                self._changed(slot)
            return
        if slot.stuck is None or slot.stuck.get("why") != why:
            log.error("watchdog: GPU %d is stuck (%s)", slot.gpu.index, why)
            slot.stuck = {"since": time.time(), "why": why}
            self._changed(slot)
            return
        now = time.monotonic()
        slot.repairs = [t for t in slot.repairs if now - t < REPAIR_WINDOW] + [now]
        self._count()
        if len(slot.repairs) > REPAIR_LIMIT:
            self._quarantine(slot, f"the watchdog repaired this GPU {len(slot.repairs)} times in "
                                   f"{REPAIR_WINDOW:g} s (last: {why})")
        else:
            self._repair(slot, why)
        slot.stuck = None
        self._changed(slot)
