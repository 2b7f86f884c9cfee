"""Writes the GPU time accounting (pool/usage.py) into the store: every sampling round it reads,
for each GPU, the lease holding it (pool/leases.py's slots) and its utilisation (gpu/telemetry.py's
cached live values) and feeds `UsageMeter`; the pool's LeaseEnded and LeaseDetached events close
a lease's stretch on a GPU at the instant it ends, and LeaseAttached opens one at the instant a
detached lease is back (else each detach and each return lost up to a sampling period: a 10 %
shortfall of leased time on a replayed day with frequent idle detaches); every `FLUSH_S` seconds
(and at close) it adds what accumulated to the store: the per-minute rows and the leases' totals.

Store calls run on the store's own thread (store/database.py), never on the event loop. A delta
the store refuses for itself is logged and put back into the meter, to be written with the next;
with the database unreachable it waits in the store's record spool on disk (`record_usage` is a
record; store/spool.py).
A restart therefore loses at most the time since the last flush of a daemon that was killed;
a clean stop flushes first. The time no daemon ran (a restart's gap) is not observed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from gpupoold.pool.events import EventBus, LeaseAttached, LeaseDetached, LeaseEnded
from gpupoold.pool.usage import Observation, UsageMeter
from gpupoold.store.database import Store
from gpupoold.tasks import stop_task

log = logging.getLogger("gpupoold.usage")

FLUSH_S = 10.0  # seconds between two writes of the accumulated usage
DAY = 86400.0


class _Stats(Protocol):
    @property
    def busy_ns(self) -> int: ...


class _Worker(Protocol):
    @property
    def stats(self) -> _Stats: ...


class _Gpu(Protocol):
    @property
    def index(self) -> int: ...


class _Lease(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def token(self) -> str: ...
    @property
    def worker(self) -> _Worker | None: ...
    @property
    def started(self) -> float: ...
    @property
    def slot(self) -> object | None: ...  # None: off a GPU (detached)
    @property
    def home(self) -> _Gpu | None: ...  # the GPU it detached from


class _Slot(Protocol):
    @property
    def lease(self) -> _Lease | None: ...


class _Leases(Protocol):
    @property
    def slots(self) -> Sequence[_Slot]: ...
    def active(self) -> Sequence[_Lease]: ...


class _Live(Protocol):
    def live(self, index: int) -> dict[str, Any]: ...


class UsageRecorder:
    def __init__(self, store: Store, leases: _Leases, telemetry: _Live, interval: float,
                 retention_days: float, clock: Callable[[], float] = time.time,
                 flush_s: float = FLUSH_S, counted: Collection[int] = ()) -> None:
        """`counted`: the GPUs whose lease worker's busy_ns is the busy time (simulated ones);
        the others' busy time comes from their sampled utilisation."""
        self.counted = frozenset(counted)
        self.store = store
        self.leases = leases
        self.telemetry = telemetry
        self.interval = interval
        self.retention_s = retention_days * DAY
        self.clock = clock
        self.flush_s = flush_s
        self.meter = UsageMeter()
        self._task: asyncio.Task[None] | None = None
        self._flushes: set[asyncio.Task[None]] = set()  # flush_soon's writes in progress
        self._last_flush = 0.0
        # A detached lease's busy counter as last credited: its work counted late (a worker
        # reports its counters at most once a second) is credited after it comes back.
        self._parked_busy: dict[int, int] = {}

    def subscribe(self, events: EventBus) -> Callable[[], None]:
        """Follow the pool's lease ends, detaches and attaches; returns the unsubscribe."""
        offs = [events.subscribe(LeaseEnded, self.lease_ended),
                events.subscribe(LeaseDetached, self.lease_detached),
                events.subscribe(LeaseAttached, self.lease_attached)]

        def unsubscribe() -> None:
            for off in offs:
                off()
        return unsubscribe

    def _away(self) -> dict[int, list[int]]:
        """GPU index: the leases that idly detached from it and are still away."""
        away: dict[int, list[int]] = {}
        for le in self.leases.active():
            if le.slot is None and le.home is not None:
                away.setdefault(le.home.index, []).append(le.id)
        return away

    def _busy_ns(self, gpu: int, lease: _Lease | None) -> int | None:
        if lease is None or gpu not in self.counted or lease.worker is None:
            return None
        return lease.worker.stats.busy_ns

    def observe_all(self) -> None:
        """One sampling round: every GPU's lease and utilisation as seen now."""
        now = self.clock()
        away = self._away()
        for index, slot in enumerate(self.leases.slots):
            lease = slot.lease
            util = self.telemetry.live(index).get("gpu_util")
            # A lease of several GPUs (issue 37) is leased on each; its worker's busy time is
            # one count for all its devices, credited on its device 0, the others by utilisation
            busy_ns = self._busy_ns(index, lease) if lease is None or lease.slot is slot else None
            self.meter.observe(now, index, Observation(
                lease.id if lease is not None else None,
                lease.token if lease is not None else "",
                float(util) if isinstance(util, (int, float)) else 0.0, busy_ns,
                lease.started if lease is not None else None, tuple(away.get(index, ()))))

    def lease_ended(self, event: LeaseEnded) -> None:
        """The pool's LeaseEnded: the lease's last stretch is its own."""
        self._parked_busy.pop(event.lease_id, None)
        now = self.clock()
        self.meter.ended(now, event.gpu, event.lease_id,
                         event.stats.busy_ns if event.gpu in self.counted else None)
        for gpu in event.gpus:  # a lease of several GPUs ends on each of them at once
            if gpu != event.gpu:
                self.meter.ended(now, gpu, event.lease_id, None)
        self.flush_soon()  # its record's figures complete now, not at the next flush

    def lease_detached(self, event: LeaseDetached) -> None:
        """The pool's LeaseDetached: the lease held its GPU until now, not until the last
        sampling round."""
        lease = next((le for le in self.leases.active() if le.id == event.lease_id), None)
        busy_ns = self._busy_ns(event.gpu, lease)
        self.meter.ended(self.clock(), event.gpu, event.lease_id, busy_ns)
        if busy_ns is not None:
            self._parked_busy[event.lease_id] = busy_ns

    def lease_attached(self, event: LeaseAttached) -> None:
        """The pool's LeaseAttached: a detached lease holds a GPU again from now, not from the
        next sampling round; its busy counter goes on from where it was credited last."""
        lease = next((le for le in self.leases.active() if le.id == event.lease_id), None)
        parked = self._parked_busy.pop(event.lease_id, None)
        if lease is None:
            return
        busy_ns = self._busy_ns(event.gpu, lease)
        if busy_ns is not None and parked is not None:
            busy_ns = parked
        # The GPU's last observation is another lease's end or a free GPU: this one sets where
        # the lease's next span on it starts, and credits nothing itself.
        self.meter.observe(self.clock(), event.gpu, Observation(
            lease.id, lease.token, 0.0, busy_ns, lease.started,
            tuple(self._away().get(event.gpu, ()))))

    async def flush(self) -> None:
        """Add what accumulated to the store (and drop rows past the retention)."""
        delta = self.meter.take()
        now = self.clock()
        self._last_flush = now
        if delta.empty():
            return
        try:
            await self.store.record_usage(delta, now - self.retention_s)
        except asyncio.CancelledError:
            self.meter.restore(delta)
            raise
        except Exception:  # the store refused it for itself: keep it for the next try
            self.meter.restore(delta)
            log.exception("writing the GPU usage failed; it is kept and tried again")

    def flush_soon(self) -> None:
        """Write what accumulated now, not at the next periodic flush (at each lease's end), so
        an ended lease's record and minute rows are complete moments after its end: for this
        server's report and, on a shared store, every other server's (which flushes only its
        own recorder before it answers)."""
        task = asyncio.get_running_loop().create_task(self.flush(), name="usage-flush")
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    def start(self) -> None:
        self._last_flush = self.clock()
        self.observe_all()
        self._task = asyncio.create_task(self._run(), name="usage")

    async def close(self) -> None:
        """Stop sampling; one last round and flush, so a clean stop loses nothing."""
        await stop_task(self._task)
        self._task = None
        if self._flushes:  # flush_soon's writes go first: the store closes after this
            await asyncio.gather(*self._flushes, return_exceptions=True)
        try:
            self.observe_all()
        except Exception:  # the stop goes on; what was observed before is still written
            log.exception("the last GPU usage round failed")
        await self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.observe_all()
                if self.clock() - self._last_flush >= self.flush_s:
                    await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("GPU usage sampling failed in this round")
