"""Idle detach: a lease whose client idles gives its GPU back, and gets one back on its next call
with its memory intact (docs/architecture.md, "Idle detach").

A lease moves through its own states while its worker process lives on (pool/state.py draws
them and alone moves the lease; this module is the policy that decides when):

    attached ──idle, asked, parked──► detaching ──checkpointed──► detached
        ▲            └──not now / failed──► attached                 │ the client calls
        └──────── restored on a GPU ◄── attaching (queued first) ◄────┘

Idleness is the worker's word, never a guess from its statistics: the statistics only say when
asking is worth it (no change for `idle_detach_after`); the worker answers from its wait for the
client's next frame, with nothing half done and every stream complete, and then parks (reads no
client frame) until told to serve again (worker/detach.c). gpupool-checkpoint (gpu/checkpoint.py)
moves its device memory into its own host memory with the driver's process checkpoints; the GPU
is scrubbed and checked as after a lease and goes to the queue. The parked worker's client sends
a frame: the lease joins the queue in arrival order (pool/waitqueue.py says why), takes the GPU
it left when free, else another of the same model, and is restored there at the same addresses.
While detached it keeps its place in its token's `max_gpus_per_token`; a waiter that limit holds
back makes no lease detach (`_why_not_now`).

A lease that cannot detach keeps its GPU as before, and its view says why (`keep_gpu`): the
client asked to keep it (GPUPOOL_KEEP_GPU=1), the GPU's driver has no process checkpoints (before
CUDA 12.8), or a checkpoint failed. Saved state lives in the workers' host memory only, at most
`detach_memory_limit_gib` of it; a worker's exit frees it, so nothing is ever left on disk.
A detached lease outlives a gpupoold restart as an attached one does: its worker waits, parked,
for the next gpupoold (worker/adopt.c), which takes the lease over detached (pool/leases.py,
`start`) and brings it back on its client's next call (`resume`).

A share of a shared GPU (issue 32) detaches the same way, with the same settings: its worker's
checkpoint frees its memory (zeroed: a freed byte of a share always is, docs/architecture.md
"Memory quotas and zeroing"), its place among the GPU's shares (count and quota) goes to the
queue's shares at once, with no scrub (the GPU is scrubbed whole when its last share leaves, as
when it ends), and it comes back through pool/shares.py's placement: a share with room for its
quota, on the GPU it left first, else on another shared GPU of its model. Under `when-queued`
it detaches for the queue only when that placement, run as if it had left, puts a waiter in its
place (pool/share_leases.py, `share_place_wanted`): a waiter that would not fit there either
gains nothing, and the share would come back behind it. A shared GPU that a
whole-GPU waiter has claimed (pool/shares.py: no new share lands) asks its shares as soon as
they have been idle `DRAIN_IDLE_S` (not `idle_detach_after`), so that the waiter gets it sooner.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import gpupool_protocol as gp

from gpupoold.config.settings import Settings
from gpupoold.gpu.checkpoint import CheckpointResult, run_checkpoint
from gpupoold.gpu.inventory import Gpu
from gpupoold.log import journal_fields
from gpupoold.pool.counters import Counters
from gpupoold.pool.share_leases import share_place_wanted
from gpupoold.pool.shares import ShareSettings
from gpupoold.pool.slots import ATTACHED, ATTACHING, DETACHED, DETACHING, LEASED, Lease, Slot
from gpupoold.pool.state import PoolState
from gpupoold.pool.waitqueue import Waiter, WaitQueue
from gpupoold.store.database import Store

log = logging.getLogger("gpupoold.detach")

GIB = 1 << 30
STATS_EVERY = 1.0  # seconds: workers report changed counters at most this often
CHECKPOINT_TIMEOUT = 300.0  # seconds a checkpoint or restore may take before it is killed
LOCK_TIMEOUT_MS = 2000  # how long the driver may wait for work in flight when locking
# The idle time after which a share of a GPU claimed by a whole-GPU waiter is asked to detach,
# and how soon it is asked again after a "not now": the waiter should not wait for the idle
# timeout; a client silent this long between two calls of a busy loop is rare, and if it was
# one it only comes back on another shared GPU (or after the waiter).
DRAIN_IDLE_S = 0.5
DRAIN_RETRY_S = 0.5
# How long a failed checkpoint of a share waits to see whether its worker exited (its client left
# while it was parked: then the checkpoint fails because the process is gone, within moments).
EXIT_GRACE_S = 0.5


class Checkpointer:
    """Runs gpupool-checkpoint (replaced by a fake in the lease manager's unit tests)."""

    def __init__(self, binary: Path | None, timeout: float = CHECKPOINT_TIMEOUT) -> None:
        self.binary = binary
        self.timeout = timeout

    async def detach(self, gpu: Gpu, pid: int) -> CheckpointResult:
        if self.binary is None:
            return CheckpointResult(False, 0.0, error="the gpupool-checkpoint binary was not "
                                    "found (reinstall gpupoold)", unsupported=True)
        return await run_checkpoint(self.binary, gpu, pid, "detach", timeout=self.timeout,
                                    lock_timeout_ms=LOCK_TIMEOUT_MS)

    async def attach(self, gpu: Gpu, pid: int, moves: tuple[tuple[str, str], ...]) -> CheckpointResult:
        if self.binary is None:
            return CheckpointResult(False, 0.0, error="the gpupool-checkpoint binary was not found")
        return await run_checkpoint(self.binary, gpu, pid, "attach", timeout=self.timeout,
                                    moves=moves)


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def same_model(a: Gpu, b: Gpu) -> bool:
    """Whether a checkpoint taken on `a` can be restored on `b` (the driver wants the same chip;
    the same name, memory size and driver library stand for it)."""
    return a.name == b.name and a.memory_total == b.memory_total and a.driver == b.driver


class IdleDetacher:
    """The detach cycles of one lease manager's leases (its `detacher`). It moves leases through
    `pool`'s transitions and uses what it needs of the lease manager's, given at construction:
    `spawn(coro, name)` runs a task the manager stops at close, `scrub(slot, lease_ids, name)`
    scrubs a GPU a lease left, `seat(waiter, home)` grants a returning lease's waiter a GPU
    (the one it left first, else in queue order), `abandon(waiter)` gives a grant back,
    `may_take(waiter)` says whether its token's `max_gpus_per_token` lets a waiter take a GPU
    now, `dispatch()` grants what is free (a share's place it left) and `closing()` says the
    daemon stops."""

    def __init__(self, pool: PoolState, queue: WaitQueue, settings: Settings, store: Store,
                 counters: Counters, checkpointer: Checkpointer, *,
                 spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[Any]],
                 scrub: Callable[[Slot, list[int], str], None],
                 seat: Callable[[Waiter, Slot | None], None],
                 abandon: Callable[[Waiter], None], may_take: Callable[[Waiter], bool],
                 dispatch: Callable[[], None], closing: Callable[[], bool]) -> None:
        self.pool = pool
        self.queue = queue
        self.settings = settings
        self.store = store
        self.counters = counters
        self.checkpointer = checkpointer
        self._spawn = spawn
        self._scrub = scrub
        self._seat = seat
        self._abandon = abandon
        self._may_take = may_take
        self._dispatch = dispatch
        self._closing = closing
        # Shares of a claimed GPU asked early (lease id -> time.monotonic() of the next ask).
        self._drain_next: dict[int, float] = {}
        # Drivers found without process checkpoints: no lease on their GPUs is asked again.
        self.unsupported: dict[str, str] = {}

    def memory_limit(self) -> int:
        gib = self.settings.detach_memory_limit_gib
        return int(gib * GIB) if gib > 0 else physical_memory() // 2

    def held_bytes(self) -> int:
        """Device memory that detached leases hold in host memory now."""
        return sum(lease.saved_bytes for lease in self.pool.active()
                   if lease.state in (DETACHING, DETACHED, ATTACHING))

    # ------------------------------------------------------------------------- when to ask
    async def run(self) -> None:
        while True:
            after = self.settings.idle_detach_after
            await asyncio.sleep(min(1.0, max(0.05, after / 4)) if after > 0 else 1.0)
            if after <= 0 or self._closing():
                continue
            active = self.pool.active()
            for gone in self._drain_next.keys() - {le.id for le in active}:
                del self._drain_next[gone]
            for lease in active:
                try:
                    idle = self._asks_after(lease, after)
                    if self._worth_asking(lease, idle):
                        lease.cycle = self._spawn(self._cycle(lease, idle=idle),
                                                  f"detach-{lease.id}")
                except Exception:
                    log.exception("lease %d: idle detach check failed", lease.id)

    def _asks_after(self, lease: Lease, after: float) -> float:
        """The idle time after which `lease` is asked: `after`, but DRAIN_IDLE_S for a share of a
        GPU a whole-GPU waiter has claimed (its shares are drained for it)."""
        slot = lease.slot
        if lease.share and slot is not None and slot.kept_for is not None:
            return min(after, DRAIN_IDLE_S)
        return after

    def _worth_asking(self, lease: Lease, after: float) -> bool:
        slot = lease.slot
        on_gpu = slot is not None and (lease in slot.shares if lease.share else slot.lease is lease)
        if (lease.state != ATTACHED or lease.cycle is not None or lease.keep_gpu is not None
                or slot is None or not on_gpu or lease.worker.exited.done()):
            return False
        now = time.monotonic()
        draining = after < self.settings.idle_detach_after
        next_try = self._drain_next.get(lease.id, 0.0) if draining else lease.next_try
        # Counters arrive up to STATS_EVERY late: ask that much early, the worker has the last
        # word (and says how long it has been idle, for the next try).
        if now < next_try or now - lease.worker.active_at < after - STATS_EVERY:
            return False
        if slot.gpu.driver in self.unsupported:
            lease.keep_gpu = self.unsupported[slot.gpu.driver]
            self.pool.changed(slot)
            return False
        if not all(same_model(slot.gpu, s.gpu) for s in lease.other_slots):
            # It comes back on GPUs of its device 0's model (the restore wants the same chip
            # for every GPU it pairs).
            lease.keep_gpu = "its GPUs are not all of one model"
            self.pool.changed(slot)
            return False
        return self._why_not_now(lease, slot, 0) is None

    def _why_not_now(self, lease: Lease, slot: Slot, mem: int) -> str | None:
        if self.settings.idle_detach_after <= 0:
            return "idle detach was turned off"
        # Only a waiter that may take the GPU counts: one that its own token's
        # max_gpus_per_token holds back would not get it (a detached lease still counts for its
        # token), so a detach for it would only hand its token one more GPU through the back door.
        if self.settings.detach_policy == "when-queued":
            if lease.share and slot.kept_for is None:
                # A share's place (its count and quota) goes to the queue's shares: it leaves
                # only for a waiter the placement would put there (one that does not fit in its
                # place would gain nothing, and the share would come back behind it).
                if not share_place_wanted(self.pool, self.queue, ShareSettings.of(
                        self.settings.share, self.settings.share_gpus), self._may_take, lease):
                    return "nobody waits who may take its place on its GPU and fits there"
            elif self.queue.first(
                    lambda w: any(w.accepts(s.gpu) for s in lease.slots())
                    and w.returning != lease.id and self._may_take(w)) is None:
                return "nobody waits for its GPU who may take it"
        limit = self.memory_limit()
        held = self.held_bytes()
        if held + mem > limit:
            return (f"its {mem / GIB:.2f} GiB would not fit in detach_memory_limit_gib "
                    f"({held / GIB:.2f} of {limit / GIB:.2f} GiB held by detached leases)")
        return None

    def resume(self, lease: Lease) -> None:
        """A detached lease taken over from the previous gpupoold (pool/leases.py, start): its
        cycle goes on from waiting for its client's next call."""
        lease.cycle = self._spawn(self._cycle(lease, detached=True), f"detach-{lease.id}")

    # ------------------------------------------------------------------------- the cycle
    async def _cycle(self, lease: Lease, detached: bool = False, idle: float = 0.0) -> None:
        try:
            if detached or await self._detach(lease, idle or self.settings.idle_detach_after):
                await self._come_back(lease)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("lease %d: the detach cycle failed; ending the lease", lease.id)
            lease.end_override = lease.end_override or ("worker error", "idle detach failed "
                                                        "inside gpupoold (see its log)")
            lease.worker.kill()
        finally:
            lease.cycle = None

    def _retry_later(self, lease: Lease, why: str, wait: float | None = None) -> None:
        lease.not_now = why
        if wait is None:
            wait = max(1.0, self.settings.idle_detach_after / 2)
        lease.next_try = time.monotonic() + wait
        if lease.id in self._drain_next:  # drained for a waiter: asked again soon
            self._drain_next[lease.id] = time.monotonic() + min(wait, DRAIN_RETRY_S)

    async def _detach(self, lease: Lease, idle: float) -> bool:
        """Ask (idle for `idle` seconds?), park, checkpoint, hand the GPU (or the share's place)
        over. True when the lease is detached."""
        worker = lease.worker
        if idle < self.settings.idle_detach_after:
            self._drain_next[lease.id] = time.monotonic() + DRAIN_RETRY_S
        answer = await worker.ask_detach(int(idle * 1000))
        if answer is None:
            return False  # the worker exited: its watcher ends the lease
        if isinstance(answer, gp.WorkerDetachNo):
            if answer.lasting:
                lease.keep_gpu = answer.why
            # Silent but not long enough yet: ask again when it will have been; busy: later.
            self._retry_later(lease, answer.why, max(0.05, idle - answer.idle_ms / 1000)
                              if answer.idle_ms else None)
            return False
        slot = lease.slot
        assert slot is not None
        # Parked. Still worth it? Someone may have taken another GPU meanwhile.
        why = self._why_not_now(lease, slot, answer.mem_used)
        if why is None and worker.wants_gpu.is_set():
            why = "its client called again"
        if why is not None:
            self._retry_later(lease, why)
            await worker.tell_attached(slot.gpu, False)
            return False
        self.pool.park(lease, answer.mem_used)
        res = await self.checkpointer.detach(slot.gpu, worker.pid)
        if not res.ok:
            self.pool.unpark(lease)
            if lease.share and await exits_soon(worker.exited):
                # Its client left while it was parked (the checkpoint failed for that): a parked
                # worker exits without a driver call, so nothing zeroed the share's memory.
                log.warning("GPU %d: share %d ended while parked for a detach, its memory not "
                            "zeroed; no new share on the GPU until it is scrubbed whole, when its "
                            "other shares end", slot.gpu.index, lease.id,
                            extra=journal_fields(lease.id, slot.gpu.index))
                self.pool.close_shares(slot)
                return False
            if res.busy:
                self._retry_later(lease, "work was still running when the driver locked it")
            else:
                lease.keep_gpu = f"the checkpoint failed: {res.error}"
                if res.unsupported:
                    self.unsupported[slot.gpu.driver] = lease.keep_gpu
                log.warning("lease %d keeps GPU %d: %s", lease.id, slot.gpu.index,
                            lease.keep_gpu, extra=journal_fields(lease.id, slot.gpu.index))
            await worker.tell_attached(slot.gpu, False)
            self.pool.changed(slot)  # why it keeps its GPU
            return False
        # Detached: the GPUs leave the lease (every one of a lease of several), are scrubbed
        # (recorded as the lease's scrub: its last use by this lease, unless it comes back) and
        # go to the queue. A share leaves its place to the queue's shares (its memory was
        # zeroed as it left); its GPU is scrubbed whole once no share is left on it.
        self._drain_next.pop(lease.id, None)
        drained = idle < self.settings.idle_detach_after
        left = self.pool.detach(lease, res.seconds)
        await worker.tell_detached()
        for s in left:
            if not lease.share or (s.state == LEASED and not s.shares and not s.share_grants
                                   and s.lease is None and s.reserved is None):
                self._scrub(s, [lease.id], f"detach-scrub-{s.gpu.index}")
            else:
                self._dispatch()
        idle_s = answer.idle_ms / 1000
        log.info("lease %d detached from GPU %s%s after %.1f s idle: %d bytes of device memory "
                 "saved in %.3f s", lease.id, ", ".join(str(s.gpu.index) for s in left),
                 (" (a share, asked early: its GPU is kept for a whole-GPU request)" if drained
                  else " (a share)" if lease.share else ""), idle_s, answer.mem_used, res.seconds,
                 extra=journal_fields(lease.id, slot.gpu.index))
        self.counters.inc("detaches")
        await self._record(lease, DETACHED, [s.gpu.index for s in left],
                           f"idle {idle_s:.1f} s, {answer.mem_used} bytes saved in "
                           f"{res.seconds:.3f} s")
        return True

    async def _come_back(self, lease: Lease) -> None:
        """Wait for the client's next call, then a GPU, then restore the lease on it."""
        worker = lease.worker
        wants = asyncio.ensure_future(worker.wants_gpu.wait())
        try:
            await asyncio.wait([wants, worker.exited], return_when=asyncio.FIRST_COMPLETED)
        finally:
            wants.cancel()
        if worker.exited.done():
            return
        asked = time.monotonic()
        detached_for = self.pool.recall(lease)
        home = lease.home
        assert home is not None
        w = self.queue.join(lease.req, lease.token, lease.client, returning=lease.id,
                            only=lambda g: same_model(home, g))
        homes = lease.homes or [home]
        # One GPU: straight back onto the one it left when it can; several: the queue's grant
        # of as many at once (all or nothing, pool/leases.py), its own ones kept in place below;
        # a share: pool/shares.py's placement (the GPU it left first, when it has room).
        self._seat(w, next((s for s in self.pool.slots if s.gpu.uuid == home.uuid), None)
                   if len(homes) == 1 and not lease.share else None)
        done, _ = await asyncio.wait([w.future, worker.exited], return_when=asyncio.FIRST_COMPLETED)
        if w.future not in done or w.future.cancelled() or w.future.exception() is not None:
            self._abandon(w)
            return
        granted = in_program_order(homes, w.granted or [w.future.result()])
        slot, others = granted[0], granted[1:]
        moved = any(s.gpu.uuid != h.uuid for s, h in zip(granted, homes, strict=True))
        # Every GPU paired when one moves (the driver wants every checkpointed GPU named).
        moves = (tuple((h.uuid, s.gpu.uuid) for s, h in zip(granted, homes, strict=True))
                 if moved else ())
        res = await self.checkpointer.attach(slot.gpu, worker.pid, moves)
        if not res.ok:
            on = ", ".join(str(s.gpu.index) for s in granted)
            why = f"its state could not be restored on GPU {on}: {res.error}"
            log.error("lease %d: %s; ending it", lease.id, why,
                      extra=journal_fields(lease.id, slot.gpu.index))
            lease.end_override = lease.end_override or ("worker error", why)
            worker.kill()
            if lease.share:  # half restored: no new share there until the GPU is scrubbed whole
                self.pool.close_shares(slot)
                self._abandon(w)
                return
            for s in granted:  # (its grant ends there)
                self._scrub(s, [], f"attach-scrub-{s.gpu.index}")
            return
        # Its latency ends here: telling the worker to serve again is one control message.
        latency = time.monotonic() - asked
        saved = self.pool.attach(lease, slot, detached_for, latency, others)
        lease.next_try = time.monotonic() + self.settings.idle_detach_after
        await worker.tell_attached(slot.gpu, moved)
        gone = ", ".join(str(h.index) for h in homes)
        log.info("lease %d attached again on GPU %s%s, %.3f s after its client called (%d bytes "
                 "restored)", lease.id, ", ".join(str(s.gpu.index) for s in granted),
                 f" (moved from GPU {gone})" if moved else "", latency, saved,
                 extra=journal_fields(lease.id, slot.gpu.index))
        self.counters.inc("reattaches", moved="yes" if moved else "no")
        await self._record(lease, ATTACHED, [s.gpu.index for s in granted],
                           (f"moved from GPU {gone}, " if moved else "") +
                           f"{latency * 1000:.1f} ms after the call, {detached_for:.1f} s detached")

    async def _record(self, lease: Lease, state: str, gpus: list[int], detail: str) -> None:
        """The event in the store: `gpus`, program order, every GPU the lease left (detached) or
        came back on (attached), so that a restart and the history find all of a lease of
        several GPUs after it moved (issue 37); the store's `gpu` is device 0's."""
        try:
            await self.store.lease_event(lease.id, time.time(), state, gpus[0], detail,
                                           lease.detaches, lease.detached_s, gpus=gpus)
        except Exception:
            log.exception("lease %d: recording its %s state failed", lease.id, state)


async def exits_soon(exited: asyncio.Future[Any], within: float = EXIT_GRACE_S) -> bool:
    """Whether a worker's exit (`exited`) comes within `within` seconds (at once if it has)."""
    if not exited.done():
        await asyncio.wait([exited], timeout=within)
    return exited.done()


def in_program_order(homes: list[Gpu], granted: list[Slot]) -> list[Slot]:
    """The GPUs granted to a returning lease of len(homes) GPUs, in its program's device order:
    a GPU it left and got back keeps its ordinal (nothing moves there), the others take the
    remaining ordinals in the order granted."""
    by_uuid = {s.gpu.uuid: s for s in granted}
    placed: list[Slot | None] = [by_uuid.get(h.uuid) for h in homes]
    rest = iter(s for s in granted if s not in placed)
    return [s if s is not None else next(rest) for s in placed]


def detach_view(lease: Lease) -> dict[str, Any]:
    """The idle-detach part of a lease's view (pool/views.py)."""
    current = time.time() - lease.state_since if lease.state in (DETACHED, ATTACHING) else 0.0
    return {"state": lease.state, "state_since": lease.state_since,
            "detaches": lease.detaches, "detached_s": round(lease.detached_s + current, 3),
            "saved_bytes": lease.saved_bytes, "keep_gpu": lease.keep_gpu,
            "not_detached_because": lease.not_now or None}
