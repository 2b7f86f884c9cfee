"""A fake `pynvml` module: the NVML functions gpupoold calls, over settable fake GPUs.

Errors are the real binding's exception classes (`pynvml.NVMLError(code)` picks the subclass),
so code under test sees exactly what it would see from nvidia-ml-py. Pass an instance wherever a
pynvml module is expected: `Nvml(module=FakePynvml([FakeGpu(...)]))`.

Knobs: `FakePynvml.init_error` (an NVML code nvmlInit fails with), `missing` (function names the
"binding" lacks), and per GPU `unsupported` (function names that fail NOT_SUPPORTED), `failing`
(function name -> NVML code), plus the fields below. `inject_xid(index, xid)` queues an XID event.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml as _real

MIB = 1 << 20
GIB = 1 << 30


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    pci_bus_id: str = "00000000:18:00.0"
    memory_total: int = 80 * GIB
    memory_used: int = 0
    minor: int = 0
    util_gpu: int = 0
    util_memory: int = 0
    temperature: int = 35
    power_mw: int = 70_000
    energy_mj: int = 1_000_000
    sm_clock: int = 1980
    mem_clock: int = 2619
    ecc_volatile_uncorrected: int = 0
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)  # corrected, uncorrected, pending, failure
    retired_pending: int = 0
    recovery_action: int = 0
    recovery_action_return: int = 0  # per-field nvmlReturn of the recovery-action field
    compute: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, used bytes)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)
    persistence: int = 0
    supported_events: int = _real.nvmlEventTypeXidCriticalError
    unsupported: set[str] = field(default_factory=set)
    failing: dict[str, int] = field(default_factory=dict)
    index: int = -1  # set by FakePynvml


def gpus(n: int) -> list[FakeGpu]:
    """n distinct fake GPUs."""
    return [FakeGpu(uuid=f"GPU-{i:08x}-1111-2222-3333-444444444444",
                    pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0", minor=i)
            for i in range(n)]


class FakePynvml:
    """Module-like: attribute access gives the fake functions and the real binding's constants."""

    NVMLError = _real.NVMLError

    def __init__(self, devices: list[FakeGpu] | None = None) -> None:
        self.devices = devices if devices is not None else gpus(1)
        for i, d in enumerate(self.devices):
            d.index = i
        self.init_error: int | None = None
        self.missing: set[str] = set()
        self.calls: list[str] = []
        self.inits = 0
        self.shutdowns = 0
        self.initialized = False
        self.registered: dict[int, int] = {}  # index -> event mask
        self.events: list[SimpleNamespace] = []
        self.event_sets_freed = 0
        self.set_persistence_calls: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml") and name in object.__getattribute__(self, "missing"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str) -> Any:
        # Constants only (NVML_*, nvmlEventType*); an unfaked function must not reach the real one.
        if name.startswith(("NVML_", "nvmlEventType", "NVMLError_")):
            return getattr(_real, name)
        raise AttributeError(name)

    # ------------------------------------------------------------------ plumbing
    def _check(self, fn: str, dev: FakeGpu | None = None) -> None:
        self.calls.append(fn)
        if not self.initialized:
            raise _real.NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        if dev is not None:
            if fn in dev.unsupported:
                raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
            if fn in dev.failing:
                raise _real.NVMLError(dev.failing[fn])

    def inject_xid(self, index: int, xid: int) -> None:
        with self.lock:
            if self.devices[index].index in self.registered:
                self.events.append(SimpleNamespace(
                    device=self.devices[index], eventType=_real.nvmlEventTypeXidCriticalError,
                    eventData=xid, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF))

    # ------------------------------------------------------------------ session
    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise _real.NVMLError(self.init_error)
        self.inits += 1
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        self.shutdowns += 1
        self.initialized = False
        self.registered.clear()

    # ------------------------------------------------------------------ devices
    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.devices):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self.devices[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        self._check("nvmlDeviceGetHandleByUUID")
        for d in self.devices:
            if d.uuid == uuid:
                return d
        raise _real.NVMLError(_real.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetIndex", h)
        return h.index

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:
        self._check("nvmlDeviceGetName", h)
        return h.name

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        self._check("nvmlDeviceGetUUID", h)
        return h.uuid

    def nvmlDeviceGetPciInfo(self, h: FakeGpu) -> SimpleNamespace:
        self._check("nvmlDeviceGetPciInfo", h)
        return SimpleNamespace(busId=h.pci_bus_id.encode())  # bytes, as the real binding gives

    def nvmlDeviceGetMinorNumber(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetMinorNumber", h)
        return h.minor

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> SimpleNamespace:
        self._check("nvmlDeviceGetMemoryInfo", h)
        return SimpleNamespace(total=h.memory_total, used=h.memory_used,
                               free=h.memory_total - h.memory_used)

    # ------------------------------------------------------------------ meters
    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> SimpleNamespace:
        self._check("nvmlDeviceGetUtilizationRates", h)
        return SimpleNamespace(gpu=h.util_gpu, memory=h.util_memory)

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        self._check("nvmlDeviceGetTemperature", h)
        assert sensor == _real.NVML_TEMPERATURE_GPU
        return h.temperature

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetPowerUsage", h)
        return h.power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetTotalEnergyConsumption", h)
        return h.energy_mj

    def nvmlDeviceGetClockInfo(self, h: FakeGpu, kind: int) -> int:
        self._check("nvmlDeviceGetClockInfo", h)
        return {_real.NVML_CLOCK_SM: h.sm_clock, _real.NVML_CLOCK_MEM: h.mem_clock}[kind]

    # ------------------------------------------------------------------ health
    def nvmlDeviceGetTotalEccErrors(self, h: FakeGpu, error_type: int, counter: int) -> int:
        self._check("nvmlDeviceGetTotalEccErrors", h)
        assert error_type == _real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter == _real.NVML_VOLATILE_ECC
        return h.ecc_volatile_uncorrected

    def nvmlDeviceGetRemappedRows(self, h: FakeGpu) -> tuple[int, int, int, int]:
        self._check("nvmlDeviceGetRemappedRows", h)
        return h.remapped

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetRetiredPagesPendingStatus", h)
        return h.retired_pending

    def nvmlDeviceGetFieldValues(self, h: FakeGpu, field_ids: list[int]) -> list[SimpleNamespace]:
        self._check("nvmlDeviceGetFieldValues", h)
        out = []
        for fid in field_ids:
            if fid == _real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                out.append(SimpleNamespace(
                    fieldId=fid, valueType=_real.NVML_VALUE_TYPE_UNSIGNED_INT,
                    nvmlReturn=h.recovery_action_return,
                    value=SimpleNamespace(uiVal=h.recovery_action)))
            else:
                out.append(SimpleNamespace(fieldId=fid, valueType=0,
                                           nvmlReturn=_real.NVML_ERROR_NOT_SUPPORTED,
                                           value=SimpleNamespace(dVal=0.0)))
        return out

    def _procs(self, fn: str, h: FakeGpu, procs: list[tuple[int, int | None]]) -> list[Any]:
        self._check(fn, h)
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in procs]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h: FakeGpu) -> list[Any]:
        return self._procs("nvmlDeviceGetComputeRunningProcesses_v3", h, h.compute)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: FakeGpu) -> list[Any]:
        return self._procs("nvmlDeviceGetComputeRunningProcesses_v2", h, h.compute)

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu) -> list[Any]:
        return self._procs("nvmlDeviceGetComputeRunningProcesses", h, h.compute)

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, h: FakeGpu) -> list[Any]:
        return self._procs("nvmlDeviceGetGraphicsRunningProcesses_v3", h, h.graphics)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, h: FakeGpu) -> list[Any]:
        return self._procs("nvmlDeviceGetGraphicsRunningProcesses_v2", h, h.graphics)

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: FakeGpu) -> list[Any]:
        return self._procs("nvmlDeviceGetGraphicsRunningProcesses", h, h.graphics)

    def nvmlDeviceGetPersistenceMode(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetPersistenceMode", h)
        return h.persistence

    def nvmlDeviceSetPersistenceMode(self, h: FakeGpu, mode: int) -> None:
        self._check("nvmlDeviceSetPersistenceMode", h)
        self.set_persistence_calls.append((h.index, mode))
        h.persistence = mode

    # ------------------------------------------------------------------ events
    def nvmlEventSetCreate(self) -> object:
        self._check("nvmlEventSetCreate")
        return object()

    def nvmlDeviceGetSupportedEventTypes(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetSupportedEventTypes", h)
        return h.supported_events

    def nvmlDeviceRegisterEvents(self, h: FakeGpu, mask: int, event_set: object) -> None:
        self._check("nvmlDeviceRegisterEvents", h)
        self.registered[h.index] = mask

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> SimpleNamespace:
        self._check("nvmlEventSetWait")
        assert timeout_ms == 0, "gpupoold must never block on NVML events"
        with self.lock:
            if not self.events:
                raise _real.NVMLError(_real.NVML_ERROR_TIMEOUT)
            return self.events.pop(0)

    def nvmlEventSetFree(self, event_set: object) -> None:
        self._check("nvmlEventSetFree")
        self.event_sets_freed += 1
