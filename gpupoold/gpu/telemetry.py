"""Live GPU values: memory used, utilisation, temperature, power and clocks, sampled in the
background and cached for the views (API `/api/v1/gpus`, the `info` reply's json).

Every `telemetry_interval` seconds `Telemetry` reads every GPU once:

- real GPUs with NVML: `Nvml.sample` and `Nvml.power_limit` in a thread (NVML calls block; a
  sick GPU can take long), never on the event loop;
- simulated GPUs: the `stats` events of the worker of the GPU's active lease (worker/control.c):
  `memory_used` is the session's `mem_used` (0 without a lease), `gpu_util` the share of the time
  between the worker's last two events that it spent executing work (`busy_ns` over
  `duration_s`), 0 once the worker has reported nothing for `IDLE_AFTER` seconds (it only reports
  when something changed). `memory_util` is 0 and temperature, power and clocks are null: the
  simulator has none, and none are invented;
- real GPUs served without NVML: nothing but `memory_total` (when known) is reported.

`live(index)` returns the cached dict (docs/api.md, "GPU view"): a value the GPU does not report
is null.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gpupoold.config.settings import Settings
from gpupoold.gpu.inventory import Gpu, Inventory
from gpupoold.gpu.nvml import NvmlUnavailable
from gpupoold.gpu.sim import sim_sensors
from gpupoold.tasks import stop_task

log = logging.getLogger("gpupoold.telemetry")

SIM_CUDA_DRIVER_VERSION = 13000  # what the simulated device's cuDriverGetVersion answers
# The NVIDIA driver version a server of simulated GPUs reports (NVML's nvmlSystemGetDriverVersion
# through the NVML shim, the info reply, `gpupool smi`): the 580 branch is the one that ships
# CUDA 13.0, which the simulated device claims; ".00.00" says no real build is meant. NVML tools
# (nvitop, gpustat) ask for it first and give up when there is none.
SIM_DRIVER_VERSION = "580.00.00"
IDLE_AFTER = 2.5  # seconds without a worker stats event: the simulated GPU is idle
LIVE_FIELDS = ("at", "memory_total", "memory_used", "memory_free", "gpu_util", "memory_util",
               "temperature_c", "power_w", "power_limit_w", "energy_j", "sm_clock_mhz",
               "mem_clock_mhz", "cuda_driver_version",
               # health meters, real GPUs with NVML only (Nvml.health_counters)
               "ecc_uncorrected", "xid_errors", "remapped_rows_pending", "remapped_rows_failure")


# What the sampler reads of the lease manager (pool/leases.py): slots[i].lease.worker.stats, the
# last stats event of the worker serving GPU i (workers/supervisor.py, WorkerStats). Described
# here rather than imported: the GPU layer sits below the workers and the pool, which import it.
class SessionStats(Protocol):
    @property
    def duration_s(self) -> float: ...  # since the session started
    @property
    def busy_ns(self) -> int: ...  # ns spent executing work
    @property
    def mem_used(self) -> int: ...  # bytes of device memory the session holds


class LeaseWorker(Protocol):
    @property
    def stats(self) -> SessionStats: ...


class _Lease(Protocol):
    @property
    def worker(self) -> LeaseWorker | None: ...


class _Slot(Protocol):
    @property
    def lease(self) -> _Lease | None: ...


class LeaseTable(Protocol):
    @property
    def slots(self) -> Sequence[_Slot]: ...


def unknown_live(gpu: Gpu, cuda_driver_version: int = 0) -> dict[str, Any]:
    """The live values of a GPU nothing has been read from yet (or that reports nothing)."""
    out: dict[str, Any] = dict.fromkeys(LIVE_FIELDS)
    out["at"] = None
    out["memory_total"] = gpu.memory_total or None
    out["cuda_driver_version"] = cuda_driver_version
    return out


def _percent(value: float) -> int:
    return max(0, min(100, round(value)))


@dataclass
class _SimTrack:
    """What the sampler last saw of a simulated GPU's lease worker."""

    worker: LeaseWorker | None = None
    stats: SessionStats | None = None
    seen: float = 0.0  # monotonic time the last new stats event was seen
    util: int = 0
    read_at: float = 0.0  # monotonic time of the last reading (for the energy)
    energy_j: float = 0.0


class Telemetry:
    def __init__(self, inventory: Inventory,
                 leases: LeaseTable | Callable[[], LeaseTable | None] | None,
                 settings: Settings) -> None:
        self.inventory = inventory
        self._leases = leases
        self.interval = settings.telemetry_interval
        self.nvml = inventory.nvml
        self.driver_version = ""  # NVML's (simulated GPUs: SIM_DRIVER_VERSION); "": unknown
        self.cuda_driver_version = 0  # cuDriverGetVersion's number (sim: 13000); 0: unknown
        if self.nvml is None and inventory.gpus and all(g.simulated for g in inventory.gpus):
            self.cuda_driver_version = SIM_CUDA_DRIVER_VERSION
            self.driver_version = SIM_DRIVER_VERSION
        self._live: dict[int, dict[str, Any]] = {
            g.index: unknown_live(g, self.cuda_driver_version) for g in inventory.gpus}
        self._sim: dict[int, _SimTrack] = {}
        self._task: asyncio.Task[None] | None = None
        self._failed_once = False
        self.samples = 0  # completed rounds (tests wait on it)

    # ------------------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        """Read the driver versions and every GPU once, then keep sampling in the background."""
        if self.nvml is not None:
            try:
                self.driver_version, self.cuda_driver_version = await asyncio.to_thread(
                    self.nvml.driver_versions)
            except NvmlUnavailable as exc:
                log.info("driver versions unknown: %s", exc)
            except Exception:  # a bug or an odd driver must cost the versions, never the start
                log.exception("reading the driver versions failed; they are reported unknown")
        await self._sample_guarded()
        self._task = asyncio.create_task(self._run(), name="telemetry")

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self._sample_guarded()

    async def _sample_guarded(self) -> None:
        """sample_once, where a failure costs a reading (the values stay as they were: unknown
        until a reading succeeds), never the sampler or the daemon's start."""
        try:
            await self.sample_once()
        except asyncio.CancelledError:
            raise
        except Exception:
            if not self._failed_once:
                log.exception("reading the GPUs' live values failed (logged once); they stay "
                              "as last read until a reading succeeds")
                self._failed_once = True

    # ------------------------------------------------------------------------------ reading
    def live(self, index: int) -> dict[str, Any]:
        """The cached live values of GPU `index` (a copy)."""
        cached = self._live.get(index)
        if cached is None:
            return unknown_live(self.inventory.get(index), self.cuda_driver_version)
        return dict(cached)

    async def sample_once(self) -> None:
        """One reading of every GPU."""
        real = [g for g in self.inventory.gpus if not g.simulated]
        if real and self.nvml is not None:
            readings = await asyncio.to_thread(self._read_nvml, real)
            self._live.update(readings)
        elif real:
            for g in real:
                self._live[g.index] = {**unknown_live(g, self.cuda_driver_version),
                                       "at": time.time()}
        for g in self.inventory.gpus:
            if g.simulated:
                self._live[g.index] = self._read_sim(g)
        self.samples += 1

    def _read_nvml(self, gpus: list[Gpu]) -> dict[int, dict[str, Any]]:
        """Blocking: NVML readings of the real GPUs (in a thread)."""
        assert self.nvml is not None
        out = {}
        for g in gpus:
            live = unknown_live(g, self.cuda_driver_version)
            live["at"] = time.time()
            try:
                s = self.nvml.sample(g.ordinal)
                limit = self.nvml.power_limit(g.ordinal)
                health = self.nvml.health_counters(g.ordinal)
            except NvmlUnavailable as exc:  # paused for a reset, or gone: nothing to report
                log.debug("GPU %d: no live values (%s)", g.index, exc)
                out[g.index] = live
                continue
            total = s.memory_total if s.memory_total is not None else (g.memory_total or None)
            used = s.memory_used
            live.update(
                memory_total=total, memory_used=used,
                memory_free=total - used if total is not None and used is not None else None,
                gpu_util=s.gpu_util, memory_util=s.memory_util, temperature_c=s.temperature_c,
                power_w=s.power_w, power_limit_w=limit, energy_j=s.energy_j,
                sm_clock_mhz=s.sm_clock_mhz, mem_clock_mhz=s.mem_clock_mhz, **health)
            out[g.index] = live
        return out

    def _lease_worker(self, index: int) -> LeaseWorker | None:
        leases = self._leases() if callable(self._leases) else self._leases
        if leases is None or not 0 <= index < len(leases.slots):
            return None
        lease = leases.slots[index].lease
        return lease.worker if lease is not None else None

    def _read_sim(self, g: Gpu) -> dict[str, Any]:
        now = time.monotonic()
        track = self._sim.setdefault(g.index, _SimTrack())
        worker = self._lease_worker(g.index)
        if worker is None:
            track.worker, track.stats, track.util = None, None, 0
            used = 0
        else:
            stats = worker.stats
            if worker is not track.worker:  # a new lease: its average so far
                track.worker, track.stats, track.seen = worker, stats, now
                track.util = (_percent(100 * stats.busy_ns / (stats.duration_s * 1e9))
                              if stats.duration_s > 0 else 0)
            elif stats is not track.stats:  # a new stats event: the time since the last one
                prev = track.stats
                assert prev is not None
                span = stats.duration_s - prev.duration_s
                if span > 0:
                    track.util = _percent(100 * (stats.busy_ns - prev.busy_ns) / (span * 1e9))
                track.stats, track.seen = stats, now
            elif now - track.seen > max(IDLE_AFTER, 2.5 * self.interval):
                track.util = 0  # the worker reports only changes: nothing ran
            used = stats.mem_used
        total = g.memory_total
        sensors = sim_sensors(track.util)
        # Energy: the power drawn since the last reading, added up (as NVML's counter since the
        # driver loaded).
        if track.read_at:
            track.energy_j += sensors["power_w"] * max(0.0, now - track.read_at)
        track.read_at = now
        return {"at": time.time(), "memory_total": total, "memory_used": used,
                "memory_free": max(0, total - used), "gpu_util": track.util, "memory_util": 0,
                "temperature_c": sensors["temperature_c"], "power_w": sensors["power_w"],
                "power_limit_w": sensors["power_limit_w"], "energy_j": round(track.energy_j, 3),
                "sm_clock_mhz": sensors["sm_clock_mhz"], "mem_clock_mhz": sensors["mem_clock_mhz"],
                "cuda_driver_version": self.cuda_driver_version,
                # A healthy simulated part: no errors, no retired memory.
                "ecc_uncorrected": 0, "xid_errors": 0, "remapped_rows_pending": 0,
                "remapped_rows_failure": 0}
