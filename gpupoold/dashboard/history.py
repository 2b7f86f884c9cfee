"""The web dashboard's short memory: the last hour of a few values, for its small charts.

One point per `telemetry_interval` (docs/configuration.md), kept in fixed-size rings:

- per GPU: utilisation (percent, None when the GPU does not report it) and memory used (bytes);
- for the pool: copy throughput (bytes per second, both directions), from the total bytes the
  workers have reported (ended leases' totals plus the active leases' latest stats).

`History.record` is called by the dashboard's sampler (dashboard/live.py) with values read from the
telemetry cache and the lease manager: no NVML call and no database access, so it runs on the
event loop. It also remembers when each GPU was last seen busy, for "idle while leased".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpupoold.dashboard.timeline import LeaseSpan, lease_event, per_device, stretches

SPAN_S = 3600.0  # what the charts show: the last hour
IDLE_WINDOW_S = 300.0  # leased and 0 % utilisation for this long: "idle while leased"


@dataclass(frozen=True)
class GpuPoint:
    at: float  # time.time()
    util: int | None  # percent
    memory_used: int | None  # bytes


@dataclass(frozen=True)
class PoolPoint:
    at: float
    copy_bps: float  # bytes per second over the interval before `at`


class History:
    def __init__(self, interval: float, span: float = SPAN_S) -> None:
        if interval <= 0:
            raise ValueError("the history interval must be positive")
        self.interval = interval
        self.span = span
        self.maxlen = max(2, int(span / interval) + 1)
        self._gpus: dict[int, deque[GpuPoint]] = {}
        self._pool: deque[PoolPoint] = deque(maxlen=self.maxlen)
        self._last_bytes: tuple[float, int] | None = None  # (at, total copy bytes)
        self._busy_at: dict[int, float] = {}  # GPU index -> time.time() last seen busy

    def record(self, at: float, gpus: Iterable[tuple[int, int | None, int | None]],
               copy_bytes_total: int) -> None:
        """Add one point: `gpus` as (index, utilisation percent, memory used bytes)."""
        for index, util, mem in gpus:
            ring = self._gpus.get(index)
            if ring is None:
                ring = self._gpus[index] = deque(maxlen=self.maxlen)
            ring.append(GpuPoint(at, util, mem))
            if util is None or util > 0 or index not in self._busy_at:
                # Unknown utilisation never makes a GPU "idle": only a measured 0 does.
                self._busy_at[index] = at
        if self._last_bytes is not None:
            then, before = self._last_bytes
            dt = at - then
            moved = max(0, copy_bytes_total - before)  # a restart of the totals is not negative
            if dt > 0:
                self._pool.append(PoolPoint(at, moved / dt))
        self._last_bytes = (at, copy_bytes_total)

    def gpu(self, index: int) -> list[GpuPoint]:
        return list(self._gpus.get(index, ()))

    def pool(self) -> list[PoolPoint]:
        return list(self._pool)

    def busy_at(self, index: int) -> float | None:
        """When GPU `index` was last seen with a utilisation above 0 (or unknown); None: never
        sampled."""
        return self._busy_at.get(index)

    def idle(self, index: int, leased_since: float | None, now: float,
             window: float = IDLE_WINDOW_S) -> bool:
        """Leased (since `leased_since`) and measured at 0 % for the whole last `window`."""
        if leased_since is None:
            return False
        busy = self._busy_at.get(index)
        if busy is None:
            return False
        return now - max(busy, leased_since) >= window


def polyline(values: list[tuple[float, float | None]], width: float, height: float,
             top: float, start: float, end: float) -> str:
    """SVG polyline points for (time, value) pairs scaled into width x height, `top` the value
    at the top edge; points with no value are left out."""
    span = max(end - start, 1e-9)
    top = top if top > 0 else 1.0
    out = []
    for at, v in values:
        if v is None:
            continue
        x = (at - start) / span * width
        y = height - min(max(v / top, 0.0), 1.0) * height
        out.append(f"{x:.1f},{y:.1f}")
    return " ".join(out)


# ------------------------------------------------------------------------------ the day view
DAY_S = 86400.0
HOUR_S = 3600.0


@dataclass(frozen=True)
class DayView:
    """The last 24 hours from the stored lease history, hour by hour (oldest first): each GPU's
    share of the hour it was leased (0 to 1), and the mean queue wait of the leases that started
    in the hour (None: none started)."""

    start: float  # the first hour's start (time.time())
    leased: dict[int, list[float]]
    wait: list[float | None]


def leased_stretches(r: Any, events: list[dict[str, Any]] | None,
                     now: float) -> list[tuple[int, float, float]]:
    """(GPU, start, end) of each stretch record `r` held a GPU: from the GPU it started on
    (gpu_index; and each of `gpus`, a lease of several) to its end, cut at its idle detaches
    when its lease events are given (a lease that came back elsewhere holds other GPUs from
    then on, each device its own: timeline.per_device; detached, it holds none)."""
    began, ended = float(r.started), r.ended
    gpus = list(getattr(r, "gpus", ()) or ()) or [r.gpu_index]  # (issue 37: program order)
    if not events:
        end = now if ended is None else float(ended)
        return [(g, began, end) for g in gpus]
    span = LeaseSpan(id=r.id, server="", gpu=r.gpu_index, token="", started=began, ended=ended,
                     events=tuple(lease_event(e) for e in events))
    return [(s.gpu, s.start, s.end) for device in per_device(span, gpus)
            for s in stretches(device, now) if s.kind == "leased"]


def day_view(records: Iterable[Any], gpus: Iterable[int], now: float,
             events: Mapping[int, list[dict[str, Any]]] | None = None) -> DayView:
    """records: lease records (id, gpu_index, started, ended or None while running, queued_s)
    that overlap the last day; events: the lease events of those that detached (by id), as far
    as they were read (a lease without them counts on the GPU it started on, throughout)."""
    start = now - DAY_S
    leased = {g: [0.0] * 24 for g in gpus}
    waits: list[list[float]] = [[] for _ in range(24)]
    for r in records:
        began = float(r.started)
        for gpu, lo_s, hi_s in leased_stretches(r, events.get(r.id) if events else None, now):
            hours = leased.get(gpu)
            for h in range(24):
                lo, hi = start + h * HOUR_S, start + (h + 1) * HOUR_S
                overlap = min(hi, hi_s) - max(lo, lo_s)
                if hours is not None and overlap > 0:
                    hours[h] += overlap / HOUR_S
        if start <= began < now:
            waits[min(23, int((began - start) // HOUR_S))].append(float(r.queued_s))
    return DayView(start, {g: [min(1.0, v) for v in hours] for g, hours in leased.items()},
                   [sum(w) / len(w) if w else None for w in waits])


def bars(values: list[float | None], width: float, height: float, top: float,
         ) -> list[tuple[float, float, float, float]]:
    """SVG rectangles (x, y, w, h) of a bar chart of `values` (None: no bar), `top` at the top
    edge."""
    n = max(1, len(values))
    w = width / n
    top = top if top > 0 else 1.0
    out = []
    for i, v in enumerate(values):
        if v is None or v <= 0:
            continue
        h = min(max(v / top, 0.0), 1.0) * height
        out.append((round(i * w + 0.5, 1), round(height - h, 1), round(w - 1.0, 1), round(h, 1)))
    return out
