"""GPU time accounting (issue 33, item 1): how long each GPU was leased and how long it was busy,
integrated from the utilisation samples the telemetry takes, per lease and per GPU-minute.

`UsageMeter` is pure arithmetic over observations, with no clock and no I/O of its own: the
recorder (pool/usage_recorder.py) feeds it one `observe` per GPU per sampling round and writes what
`take` hands back. Between two observations of a GPU at t0 and t1 the span t1 - t0 counts
for the lease seen at t1 when it was also the lease seen at t0; a lease that started in between
counts from its start (`Observation.started`), one that ended in between until its end
(`ended`, from the pool's LeaseEnded event). An idle detach and a return are instants too: the
recorder calls `ended` at the pool's LeaseDetached and `observe` at its LeaseAttached. A lease
that came back to a GPU in between otherwise (a restart's takeover) counts from its first
observation, short by at most one sampling period, never long. Busy time is the span times
the utilisation share seen at t1:
NVML's utilisation, like the simulated device's, is the share of the last sample period in
which a kernel ran, so the product is the busy time of that period, not "utilisation > 0".
Where the GPU keeps a count of busy nanoseconds (the simulated device's worker), its difference
between the two observations is used instead: the sampled share lags a change by up to the
telemetry's idle timeout, the counter does not. Reused time is the leased time of a GPU while
a lease that idly detached from it is away: the GPU time idle detach handed on to others,
credited to the GPU's minute rows and to the detached lease (the first to have left, when
several did).

The meter is also the one integrator of the daemon's running totals: `gpus` (leased, busy and
reused seconds per GPU) and `token_busy_s` (busy seconds per token name) only ever grow, from
the same credited spans as the rows and lease totals (`take` leaves them), so the Prometheus
counters (http/metrics.py reads them at scrape) and the stored figures behind `gpupoold report`
cannot tell an operator two different things: per GPU and per token, the counters' growth is
the sum of the minute rows written.

Per-minute rows (not raw samples) are kept because they answer "this week, per GPU, per token"
from a table whose size does not grow with the sampling rate: one row per GPU, minute and token
that held it, however often it is sampled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MINUTE = 60.0
MAX_SPAN_S = 300.0  # a gap longer than this (the daemon paused, the clock jumped) is not counted


@dataclass(frozen=True)
class Observation:
    """What a sampling round saw of one GPU: the lease holding it (None: free) and its
    utilisation share in percent over the last sample period."""

    lease_id: int | None
    token: str
    util: float
    # The lease's own count of nanoseconds its GPU spent executing work, where the GPU keeps
    # one (the simulated device's worker: busy_ns); None: only the utilisation share is known.
    busy_ns: int | None = None
    started: float | None = None  # when the lease began (Unix time), where known
    # Leases that idly detached from this GPU and are still away (pool/detach.py): while
    # another lease holds it, the GPU serves others in their place ("detached and reused").
    away: tuple[int, ...] = ()


@dataclass
class MinuteUsage:
    """One GPU's leased and busy seconds in one minute, for one token."""

    gpu: int
    minute: float  # Unix time of the minute's start
    token: str
    leased_s: float = 0.0
    busy_s: float = 0.0
    reused_s: float = 0.0  # of leased_s, while a lease detached from this GPU was away


@dataclass
class LeaseUsage:
    """Seconds a lease held a GPU and kept it busy, and seconds its GPU served others while it
    was detached from it, since the last `take`."""

    leased_s: float = 0.0
    busy_s: float = 0.0
    reused_s: float = 0.0


@dataclass
class GpuTotals:
    """One GPU's seconds since the meter began (the daemon's start): they only grow."""

    leased_s: float = 0.0
    busy_s: float = 0.0
    reused_s: float = 0.0


@dataclass
class UsageDelta:
    """What accumulated since the last `take`: minute rows to add, lease totals to add."""

    minutes: list[MinuteUsage] = field(default_factory=list)
    leases: dict[int, LeaseUsage] = field(default_factory=dict)

    def empty(self) -> bool:
        return not self.minutes and not self.leases


class UsageMeter:
    def __init__(self) -> None:
        self._last: dict[int, tuple[float, Observation]] = {}
        self._minutes: dict[tuple[int, float, str], MinuteUsage] = {}
        self._leases: dict[int, LeaseUsage] = {}
        # Running totals since the meter began, read by the metrics adapter; never reset.
        self.gpus: dict[int, GpuTotals] = {}
        self.token_busy_s: dict[str, float] = {}  # busy seconds by token name

    def observe(self, now: float, gpu: int, seen: Observation) -> None:
        """GPU `gpu` at Unix time `now` is as `seen`; credits the span since its last one (a
        lease that started within it from its start on)."""
        last = self._last.get(gpu)
        self._last[gpu] = (now, seen)
        self.gpus.setdefault(gpu, GpuTotals())  # a GPU's counters exist (at 0) once observed
        if last is None or seen.lease_id is None:
            return
        then, before = last
        if before.lease_id != seen.lease_id:
            # A lease granted in the same instant as the last observation (then == started)
            # started "in between" too: that observation saw the GPU before the grant.
            if seen.started is None or not then <= seen.started <= now:
                return  # on this GPU since before the last observation: credited from now on
            # It started in between: from its start, its busy counter from zero.
            then, before = seen.started, Observation(seen.lease_id, seen.token, seen.util,
                                                     0 if seen.busy_ns is not None else None)
        self._credit(gpu, then, now, before, seen)

    def ended(self, now: float, gpu: int, lease_id: int, busy_ns: int | None) -> None:
        """Lease `lease_id` left GPU `gpu` at `now` (its worker's final `busy_ns`): the span
        since its last observation is its own, not the next observation's."""
        last = self._last.get(gpu)
        if last is None or last[1].lease_id != lease_id:
            return
        then, before = last
        seen = Observation(lease_id, before.token, before.util, busy_ns, away=before.away)
        self._credit(gpu, then, now, before, seen)
        self._last[gpu] = (now, Observation(None, "", 0.0))

    def _credit(self, gpu: int, then: float, now: float, before: Observation,
                seen: Observation) -> None:
        span = now - then
        if seen.lease_id is None or not 0 < span <= MAX_SPAN_S:
            return
        if seen.busy_ns is not None and before.busy_ns is not None:
            # A counter is exact where a sampled share is an estimate; it may run ahead of the
            # span (work reported late), never behind zero.
            share = max(0, seen.busy_ns - before.busy_ns) / 1e9 / span
        else:
            share = max(0.0, min(100.0, seen.util)) / 100.0
        lease = self._leases.setdefault(seen.lease_id, LeaseUsage())
        lease.leased_s += span
        lease.busy_s += span * share
        reused = bool(seen.away)
        if reused:  # the first to have left it is the one whose GPU this is serving
            self._leases.setdefault(min(seen.away), LeaseUsage()).reused_s += span
        total = self.gpus.setdefault(gpu, GpuTotals())
        total.leased_s += span
        total.busy_s += span * share
        if reused:
            total.reused_s += span
        self.token_busy_s[seen.token] = self.token_busy_s.get(seen.token, 0.0) + span * share
        start = then
        while start < now:  # split the span at minute boundaries
            minute = math.floor(start / MINUTE) * MINUTE
            end = min(now, minute + MINUTE)
            key = (gpu, minute, seen.token)
            row = self._minutes.get(key)
            if row is None:
                row = self._minutes[key] = MinuteUsage(gpu, minute, seen.token)
            row.leased_s += end - start
            row.busy_s += (end - start) * share
            if reused:
                row.reused_s += end - start
            start = end

    def take(self) -> UsageDelta:
        """Everything accumulated since the last take (then forgotten here; the running
        totals stay)."""
        delta = UsageDelta(sorted(self._minutes.values(), key=lambda r: (r.minute, r.gpu)),
                           self._leases)
        self._minutes = {}
        self._leases = {}
        return delta

    def restore(self, delta: UsageDelta) -> None:
        """Put back a delta that could not be written, to be written with the next one."""
        for row in delta.minutes:
            key = (row.gpu, row.minute, row.token)
            mine = self._minutes.setdefault(key, MinuteUsage(row.gpu, row.minute, row.token))
            mine.leased_s += row.leased_s
            mine.busy_s += row.busy_s
            mine.reused_s += row.reused_s
        for lease_id, usage in delta.leases.items():
            mine_l = self._leases.setdefault(lease_id, LeaseUsage())
            mine_l.leased_s += usage.leased_s
            mine_l.busy_s += usage.busy_s
            mine_l.reused_s += usage.reused_s
