"""Utilisation counters for Prometheus: how long each GPU was leased, busy and reused
(docs/metrics.md, "Per GPU"; issue 33, item 4).

`UtilisationClock` integrates observations of the GPUs taken at moments the metrics adapter
chooses (every telemetry tick, every lease event and every scrape, http/metrics.py). Between two
observations of a GPU, what the earlier one saw is taken to have held ("sample and hold"): the
time is added to the counters it names. A lease that starts or ends between two observations is
therefore counted to within one observation period, and a scrape, being an observation itself,
counts an open lease's time up to the scrape. The counters only ever grow (the clock is
monotonic and a span is never negative), so Prometheus's `rate` and `increase` read them as
counters.

Busy time is the leased span weighted by the utilisation seen at the span's end (0 to 1): a GPU
leased for 10 s at 50 % counts 10 s leased and 5 s busy. NVML's utilisation is the share of the
last sample period in which a kernel was executing, and a simulated GPU's is its worker's
`busy_ns` over the same period (gpu/telemetry.py): the value read at a span's end describes the
span, and the integral is the time the GPU executed work. The stored accounting (pool/usage.py)
integrates the same way, so Prometheus and `gpupoold report` agree to within a sample period.

Reused time: the GPU was leased while a lease detached from it (idle detach, pool/detach.py) was
still in progress elsewhere in host memory: GPU time that idle detach handed on to another lease.

Pure logic on plain values: no import of the pool, prometheus_client or the event loop, so the
tests drive it with any sequence of observations and times.
"""

from __future__ import annotations

from dataclasses import dataclass

# `gpupool_gpu_lease_state`'s codes (docs/metrics.md lists them; the Grafana state timeline maps
# them to names and colours).
FREE = 0  # no lease, in service
LEASED_IDLE = 1  # leased, utilisation 0 in the last sample
LEASED_BUSY = 2  # leased, utilisation above 0
REUSED = 3  # leased by another while a lease detached from it waits in host memory
OUT_OF_SERVICE = 4  # scrubbing, quarantined or drained


@dataclass(frozen=True)
class Observation:
    """What one GPU was doing at one moment."""

    token: str | None  # the token name of the lease on it; None: not leased
    util: float = 0.0  # the telemetry's last utilisation sample, 0 to 1 (0 when unknown): the
    # share of the sample period before it that the GPU executed work
    reused: bool = False  # leased while a lease detached from this GPU waits
    in_service: bool = True  # False: scrubbing, quarantined or drained

    @property
    def code(self) -> int:
        """This observation as a `gpupool_gpu_lease_state` code."""
        if self.token is None:
            return FREE if self.in_service else OUT_OF_SERVICE
        if self.reused:
            return REUSED
        return LEASED_BUSY if self.util > 0 else LEASED_IDLE


@dataclass
class GpuTime:
    """Seconds counted for one GPU since the daemon started."""

    leased_s: float = 0.0
    busy_s: float = 0.0
    reused_s: float = 0.0


class UtilisationClock:
    """The counters, advanced by `observe(now, {gpu: Observation})` (now: time.monotonic())."""

    def __init__(self) -> None:
        self.gpus: dict[int, GpuTime] = {}
        self.token_busy_s: dict[str, float] = {}  # busy GPU-seconds by token name
        self._last: dict[int, tuple[float, Observation]] = {}

    def observe(self, now: float, seen: dict[int, Observation]) -> None:
        """Count the time since each GPU's previous observation as that observation said (its
        lease; the busy share from the new one's utilisation, which describes the span), then
        hold the new one. A GPU seen for the first time only starts its clock."""
        for gpu, obs in seen.items():
            at = now
            prev = self._last.get(gpu)
            if prev is None:
                self.gpus.setdefault(gpu, GpuTime())
            else:
                since, held = prev
                self._count(gpu, held, obs.util, now - since)
                at = max(now, since)  # an earlier reading than the last never counts back
            self._last[gpu] = (at, obs)

    def code(self, gpu: int) -> int | None:
        """The last observation of `gpu` as a `gpupool_gpu_lease_state` code (None: never seen)."""
        last = self._last.get(gpu)
        return last[1].code if last is not None else None

    def _count(self, gpu: int, held: Observation, util: float, span: float) -> None:
        if held.token is None or span <= 0:
            return
        t = self.gpus.setdefault(gpu, GpuTime())
        t.leased_s += span
        busy = span * min(1.0, max(0.0, util))
        t.busy_s += busy
        self.token_busy_s[held.token] = self.token_busy_s.get(held.token, 0.0) + busy
        if held.reused:
            t.reused_s += span
