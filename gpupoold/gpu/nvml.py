"""NVML, the NVIDIA management library: the one module that talks to `pynvml`.

`pynvml` is NVIDIA's own binding (PyPI package `nvidia-ml-py`). Everything else in gpupoold asks
this module's `Nvml` for GPU facts: the inventory (`devices`), metrics (`sample`) and the health
fields checked between tenants (`health`). The reset helper uses it too, so this module imports
nothing but the standard library (and `pynvml`, lazily).

Every method BLOCKS (NVML calls into the kernel driver and can take milliseconds, or much longer
on a sick GPU): the daemon calls them through `asyncio.to_thread`, never on the event loop. One
lock serialises them, so one `Nvml` may be shared by any number of threads.

NVML is initialised lazily, on the first call that needs it. All queries go through one choke
point (`Nvml._call`): a function the GPU or driver does not support (NOT_SUPPORTED,
FUNCTION_NOT_FOUND, NO_PERMISSION, or missing from an older binding) gives None for that field and
is logged once per function, not on every poll. Any other NVML error also gives None, and is
collected in `HealthReport.errors` where the caller passed a list, because on a health check an
error such as "GPU is lost" is itself the finding.

`pynvml` is injectable (`Nvml(module=...)`): the tests pass `tests/fake_nvml.py`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("gpupoold.nvml")

# NVML return codes (nvml.h); constants, so that a fake module need not provide them.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
# The value of a field we could not read because NVML does not offer it here: not a finding.
_UNKNOWN_CODES = frozenset({NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NO_PERMISSION,
                            NVML_ERROR_FUNCTION_NOT_FOUND})

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_EVENT_TYPE_XID_CRITICAL_ERROR = 0x8
# nvml.h's NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (driver r550+); used when the binding lacks it.
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
NVML_VALUE_TYPE_UNSIGNED_INT = 1

# How many queued XID events one health() call reads at most (a storm must not stall it).
MAX_EVENTS_PER_POLL = 1000

_MISSING = object()


class NvmlUnavailable(Exception):
    """NVML cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class NvmlDevice:
    index: int  # NVML index = nvidia-smi's index = CUDA ordinal under CUDA_DEVICE_ORDER=PCI_BUS_ID
    name: str
    uuid: str  # "GPU-..."
    pci_bus_id: str  # "00000000:18:00.0"
    memory_total: int  # bytes
    minor_number: int | None  # /dev/nvidia<N>


@dataclass(frozen=True)
class GpuSample:
    """One reading of a GPU's meters; a field is None where the GPU or driver does not report it."""

    gpu_util: int | None = None  # percent of time a kernel ran, over the driver's sample period
    memory_util: int | None = None  # percent of time device memory was read or written
    memory_used: int | None = None  # bytes
    memory_total: int | None = None  # bytes
    temperature_c: int | None = None
    power_w: float | None = None
    energy_j: float | None = None  # since the driver was loaded
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory: int | None  # bytes; None when NVML does not say


@dataclass(frozen=True)
class HealthReport:
    """The health fields of one GPU. None: not reported by this GPU/driver (not a problem)."""

    ecc_volatile_uncorrected: int | None = None  # uncorrectable ECC errors since the driver load
    remapped_rows_pending: bool | None = None  # a row remap waits for a GPU reset
    remapped_rows_failure: bool | None = None  # a row could not be remapped
    retired_pages_pending: bool | None = None  # a page retirement waits for a GPU reset
    recovery_action: int | None = None  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (0: none)
    xid_errors: tuple[int, ...] = ()  # XIDs seen since the previous health() of this GPU
    processes: tuple[GpuProcess, ...] | None = ()  # compute processes; None: unknown
    errors: tuple[str, ...] = ()  # NVML queries that failed with a real error ("GPU is lost")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["xid_errors"] = list(self.xid_errors)
        out["errors"] = list(self.errors)
        out["processes"] = (None if self.processes is None
                            else [asdict(p) for p in self.processes])
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HealthReport:
        """The inverse of to_json. ValueError names the first bad or unknown field."""
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object with HealthReport fields")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        kw: dict[str, Any] = {}
        for name in ("ecc_volatile_uncorrected", "recovery_action"):
            if data.get(name) is not None:
                kw[name] = _json_int(name, data[name])
        for name in ("remapped_rows_pending", "remapped_rows_failure", "retired_pages_pending"):
            if data.get(name) is not None:
                if not isinstance(data[name], bool):
                    raise ValueError(f"{name} must be true, false or null, got {data[name]!r}")
                kw[name] = data[name]
        if "xid_errors" in data:
            kw["xid_errors"] = tuple(_json_int("xid_errors", x) for x in _json_list(data, "xid_errors"))
        if "errors" in data:
            kw["errors"] = tuple(str(e) for e in _json_list(data, "errors"))
        if "processes" in data:
            if data["processes"] is None:
                kw["processes"] = None
            else:
                procs = []
                for p in _json_list(data, "processes"):
                    if not isinstance(p, dict) or "pid" not in p:
                        raise ValueError(f"processes: each entry needs a pid, got {p!r}")
                    mem = p.get("used_memory")
                    procs.append(GpuProcess(_json_int("pid", p["pid"]),
                                            None if mem is None else _json_int("used_memory", mem)))
                kw["processes"] = tuple(procs)
        return cls(**kw)


def _json_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _json_list(data: dict[str, Any], name: str) -> list[Any]:
    value = data[name]
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return value


# c_nvmlValue_t member for each NVML_VALUE_TYPE_* (nvml.h order)
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def _field_value(v: Any) -> int:
    """The integer in an nvmlFieldValue_t, read through the member its valueType names."""
    vtype = int(getattr(v, "valueType", NVML_VALUE_TYPE_UNSIGNED_INT))
    member = _VALUE_MEMBERS[vtype] if 0 <= vtype < len(_VALUE_MEMBERS) else "uiVal"
    return int(getattr(v.value, member))


def _text(value: Any) -> str:
    """Older bindings return bytes for strings, newer ones str."""
    if isinstance(value, bytes):
        return value.decode(errors="replace").rstrip("\0")
    return str(value)


def init_failure_reason(exc: BaseException) -> str:
    """What a user should read when nvmlInit fails."""
    code = getattr(exc, "value", None)
    if code == NVML_ERROR_LIBRARY_NOT_FOUND:
        return "libnvidia-ml.so.1 not found (is the NVIDIA driver installed?)"
    if code == NVML_ERROR_DRIVER_NOT_LOADED:
        return "the NVIDIA kernel driver is not loaded (check `nvidia-smi` and `dmesg`)"
    if code == NVML_ERROR_NO_PERMISSION:
        return "no permission to use NVML (check the permissions of /dev/nvidia*)"
    return f"nvmlInit failed: {exc}"


class Nvml:
    """The NVML session of this process. Blocking; thread-safe; see the module docstring."""

    def __init__(self, module: Any = None) -> None:
        self._nv = module  # the pynvml module (or a fake); imported on first use when None
        self._lock = threading.RLock()
        self._initialized = False
        self._paused: str | None = None  # why NVML is released on purpose (a GPU reset)
        self._last_reason: str | None = None
        self._logged: set[str] = set()  # functions (and errors) already logged once
        self._event_set: Any = None
        self._events_tried = False
        self._pending_xids: dict[int, list[int]] = {}
        self._xid_totals: dict[int, int] = {}  # XIDs seen per NVML index since this daemon began

    # ------------------------------------------------------------------ session
    def _ensure(self) -> Any:
        """The initialised module; NvmlUnavailable with the reason otherwise. Lock held."""
        if self._paused is not None:
            raise NvmlUnavailable(self._paused)
        if self._initialized:
            return self._nv
        if self._nv is None:
            try:
                self._nv = importlib.import_module("pynvml")
            except ImportError:
                raise NvmlUnavailable("the Python package nvidia-ml-py is not installed "
                                      "(pip install nvidia-ml-py)") from None
        try:
            self._nv.nvmlInit()
        except Exception as exc:  # NVMLError or, from a broken install, anything
            reason = init_failure_reason(exc)
            if reason != self._last_reason:
                log.info("NVML unavailable: %s", reason)
                self._last_reason = reason
            raise NvmlUnavailable(reason) from None
        lib = getattr(self._nv, "nvmlLib", None)  # pynvml's ctypes handle of the library
        if lib is not None and hasattr(lib, "gpupool_shim_version"):
            # gpupool's CLIENT NVML library (the client package's lib folder is on this
            # process's LD_LIBRARY_PATH): it would describe the pool, not this machine's GPUs.
            with contextlib.suppress(Exception):
                self._nv.nvmlShutdown()
            reason = ("the libnvidia-ml.so.1 loaded is gpupool's client NVML library, not the "
                      "NVIDIA driver's: remove the gpupool client's lib folder from gpupoold's "
                      f"LD_LIBRARY_PATH ({os.environ.get('LD_LIBRARY_PATH', '')})")
            if reason != self._last_reason:
                log.error("NVML unavailable: %s", reason)
                self._last_reason = reason
            raise NvmlUnavailable(reason)
        self._initialized = True
        self._last_reason = None
        return self._nv

    def available(self) -> str | None:
        """None when NVML works, else the reason (e.g. 'libnvidia-ml.so.1 not found ...')."""
        with self._lock:
            try:
                self._ensure()
            except NvmlUnavailable as exc:
                return str(exc)
            return None

    def shutdown(self) -> None:
        """Release NVML (and the XID event set). The next query initialises it again."""
        with self._lock:
            self._release()

    def _release(self) -> None:
        if not self._initialized:
            return
        if self._event_set is not None:
            self._drain_events()  # keep what was queued: the next health() still reports it
            self._call("nvmlEventSetFree", self._event_set)
            self._event_set = None
        self._events_tried = False
        try:
            self._nv.nvmlShutdown()
        except Exception as exc:  # shutting down must not fail the caller
            log.warning("nvmlShutdown failed: %s", exc)
        self._initialized = False

    def pause(self, reason: str) -> None:
        """Release NVML and refuse to initialise it again until resume(): `nvidia-smi -r` fails
        while any process, monitoring tools included, holds an NVML session on the GPU. XIDs
        raised while paused are not seen (the event set is gone); queued ones are kept."""
        with self._lock:
            self._release()
            self._paused = reason

    def resume(self) -> None:
        with self._lock:
            self._paused = None

    # ------------------------------------------------------------- choke point
    def _once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.info(message, *args)

    def _call(self, name: str, *args: Any, errors: list[str] | None = None,
              missing: Any = None) -> Any:
        """Call pynvml.`name`. Unsupported/missing -> `missing` (logged once per function);
        another NVML error -> `missing` too, appended to `errors` when given. Lock held."""
        fn: Callable[..., Any] | None = getattr(self._nv, name, None)
        if fn is None:
            self._once(name, "NVML: %s is not in this nvidia-ml-py version; field left empty", name)
            return missing
        nvml_error = getattr(self._nv, "NVMLError", None)
        try:
            return fn(*args)
        except Exception as exc:
            if nvml_error is None or not isinstance(exc, nvml_error):
                # NVMLLibraryMismatchError: an unversioned function the driver lacks
                if type(exc).__name__ == "NVMLLibraryMismatchError":
                    self._once(name, "NVML: %s is not in this driver; field left empty", name)
                    return missing
                raise
            code = getattr(exc, "value", None)
            if code in _UNKNOWN_CODES:
                self._once(name, "NVML: %s: %s; field left empty", name, exc)
                return missing
            self._once(f"{name}/{code}", "NVML: %s failed: %s", name, exc)
            if errors is not None:
                errors.append(f"{name}: {exc}")
            return missing

    def _handle(self, index: int) -> Any:
        """The device handle of NVML index `index`; NvmlUnavailable when there is none."""
        errors: list[str] = []
        handle = self._call("nvmlDeviceGetHandleByIndex", index, errors=errors)
        if handle is None:
            why = errors[0] if errors else "not supported"
            raise NvmlUnavailable(f"NVML has no GPU with index {index} ({why})")
        return handle

    # ------------------------------------------------------------------ queries
    def devices(self) -> list[NvmlDevice]:
        """Every GPU NVML sees, in NVML index order. NvmlUnavailable if NVML cannot be used."""
        with self._lock:
            self._ensure()
            count = self._call("nvmlDeviceGetCount")
            if count is None:
                raise NvmlUnavailable("nvmlDeviceGetCount failed (see the log)")
            out = []
            for i in range(count):
                h = self._handle(i)
                pci = self._call("nvmlDeviceGetPciInfo", h)
                mem = self._call("nvmlDeviceGetMemoryInfo", h)
                name = self._call("nvmlDeviceGetName", h)
                uuid = self._call("nvmlDeviceGetUUID", h)
                out.append(NvmlDevice(
                    index=i,
                    name=_text(name) if name is not None else f"GPU {i}",
                    uuid=_text(uuid) if uuid is not None else "",
                    pci_bus_id=_text(pci.busId) if pci is not None else "",
                    memory_total=int(mem.total) if mem is not None else 0,
                    minor_number=self._call("nvmlDeviceGetMinorNumber", h)))
            self._ensure_events()
            return out

    def sample(self, index: int) -> GpuSample:
        with self._lock:
            self._ensure()
            h = self._handle(index)
            util = self._call("nvmlDeviceGetUtilizationRates", h)
            mem = self._call("nvmlDeviceGetMemoryInfo", h)
            power_mw = self._call("nvmlDeviceGetPowerUsage", h)
            energy_mj = self._call("nvmlDeviceGetTotalEnergyConsumption", h)
            return GpuSample(
                gpu_util=int(util.gpu) if util is not None else None,
                memory_util=int(util.memory) if util is not None else None,
                memory_used=int(mem.used) if mem is not None else None,
                memory_total=int(mem.total) if mem is not None else None,
                temperature_c=self._call("nvmlDeviceGetTemperature", h, NVML_TEMPERATURE_GPU),
                power_w=power_mw / 1000.0 if power_mw is not None else None,
                energy_j=energy_mj / 1000.0 if energy_mj is not None else None,
                sm_clock_mhz=self._call("nvmlDeviceGetClockInfo", h, NVML_CLOCK_SM),
                mem_clock_mhz=self._call("nvmlDeviceGetClockInfo", h, NVML_CLOCK_MEM))

    def power_limit(self, index: int) -> float | None:
        """The enforced power limit in watts; None where not reported."""
        with self._lock:
            self._ensure()
            h = self._handle(index)
            mw = self._call("nvmlDeviceGetEnforcedPowerLimit", h)
            return mw / 1000.0 if mw is not None else None

    def driver_versions(self) -> tuple[str, int]:
        """(the driver's version, e.g. "580.65.06"; the CUDA version its libcuda speaks, e.g.
        13000 as cuDriverGetVersion gives it): "" and 0 where NVML does not say."""
        with self._lock:
            self._ensure()
            version = self._call("nvmlSystemGetDriverVersion")
            cuda = self._call("nvmlSystemGetCudaDriverVersion_v2")
            if cuda is None:
                cuda = self._call("nvmlSystemGetCudaDriverVersion")
            return (_text(version) if version is not None else "",
                    int(cuda) if isinstance(cuda, int) else 0)

    def health(self, index: int) -> HealthReport:
        """The health fields of GPU `index`, and the XIDs seen since the last call for it.
        The XID event set is polled with timeout 0: this never waits for an event."""
        with self._lock:
            self._ensure()
            h = self._handle(index)
            errors: list[str] = []
            ecc = self._call("nvmlDeviceGetTotalEccErrors", h, NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                             NVML_VOLATILE_ECC, errors=errors)
            rows = self._call("nvmlDeviceGetRemappedRows", h, errors=errors)
            pages = self._call("nvmlDeviceGetRetiredPagesPendingStatus", h, errors=errors)
            procs = self._processes(h, "Compute", errors)
            self._ensure_events()
            self._drain_events()
            xids = tuple(self._pending_xids.pop(index, []))
            return HealthReport(
                ecc_volatile_uncorrected=int(ecc) if ecc is not None else None,
                remapped_rows_pending=bool(rows[2]) if rows is not None else None,
                remapped_rows_failure=bool(rows[3]) if rows is not None else None,
                retired_pages_pending=bool(pages) if pages is not None else None,
                recovery_action=self._recovery_action(h, errors),
                xid_errors=xids,
                processes=procs,
                errors=tuple(errors))

    def health_counters(self, index: int) -> dict[str, Any]:
        """The health meters for metrics (telemetry, every sample): uncorrected ECC errors
        (volatile), remapped rows pending/failed, and the XIDs counted since this daemon began.
        Unlike health() this takes no XIDs away from the next health check: queued events are
        moved to the pending list that health() reads, and only counted here. A value NVML
        does not report is None."""
        with self._lock:
            self._ensure()
            h = self._handle(index)
            ecc = self._call("nvmlDeviceGetTotalEccErrors", h, NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                             NVML_VOLATILE_ECC)
            rows = self._call("nvmlDeviceGetRemappedRows", h)
            self._ensure_events()
            self._drain_events()
            return {"ecc_uncorrected": int(ecc) if ecc is not None else None,
                    "remapped_rows_pending": bool(rows[2]) if rows is not None else None,
                    "remapped_rows_failure": bool(rows[3]) if rows is not None else None,
                    "xid_errors": self._xid_totals.get(index, 0) if self._event_set is not None
                    else None}

    def processes(self, index: int, graphics: bool = False,
                  errors: list[str] | None = None) -> tuple[GpuProcess, ...] | None:
        """Compute (and with `graphics`, graphics) processes on GPU `index`; None if unknown."""
        with self._lock:
            self._ensure()
            h = self._handle(index)
            compute = self._processes(h, "Compute", errors)
            if not graphics:
                return compute
            gfx = self._processes(h, "Graphics", errors)
            if compute is None or gfx is None:
                return None
            seen = {p.pid for p in compute}
            return compute + tuple(p for p in gfx if p.pid not in seen)

    def device_count(self) -> int:
        with self._lock:
            self._ensure()
            count = self._call("nvmlDeviceGetCount")
            if count is None:
                raise NvmlUnavailable("nvmlDeviceGetCount failed (see the log)")
            return int(count)

    def index_of_uuid(self, uuid: str, errors: list[str] | None = None) -> int | None:
        """The NVML index of the GPU with this UUID, None if none of this machine's GPUs has it
        (or, with a message in `errors`, if a GPU's UUID could not be read)."""
        with self._lock:
            self._ensure()
            count = self._call("nvmlDeviceGetCount", errors=errors) or 0
            for i in range(count):
                h = self._call("nvmlDeviceGetHandleByIndex", i, errors=errors)
                found = self._call("nvmlDeviceGetUUID", h, errors=errors) if h is not None else None
                if found is not None and _text(found) == uuid:
                    return i
            return None

    def persistence_mode(self, index: int) -> bool | None:
        with self._lock:
            self._ensure()
            mode = self._call("nvmlDeviceGetPersistenceMode", self._handle(index))
            return None if mode is None else bool(mode)

    def set_persistence_mode(self, index: int, enabled: bool) -> str | None:
        """None when done, else the error (root only)."""
        with self._lock:
            self._ensure()
            errors: list[str] = []
            missing = object()
            done = self._call("nvmlDeviceSetPersistenceMode", self._handle(index), int(enabled),
                              errors=errors, missing=missing)
            if done is missing:
                return errors[0] if errors else "not supported on this GPU"
            return None

    # ---------------------------------------------------------------- helpers
    def _processes(self, h: Any, kind: str,
                   errors: list[str] | None) -> tuple[GpuProcess, ...] | None:
        # The unversioned name raises NVMLLibraryMismatchError on drivers without _v3: try the
        # versioned names first, newest first.
        for name in (f"nvmlDeviceGet{kind}RunningProcesses_v3",
                     f"nvmlDeviceGet{kind}RunningProcesses_v2",
                     f"nvmlDeviceGet{kind}RunningProcesses"):
            if getattr(self._nv, name, None) is None:
                continue
            failed: list[str] = []
            procs = self._call(name, h, errors=failed, missing=_MISSING)
            if failed:  # a real error: older versions would not answer better
                if errors is not None:
                    errors.extend(failed)
                return None
            if procs is _MISSING:  # not in this driver: try the older version
                continue
            return tuple(GpuProcess(int(p.pid), None if getattr(p, "usedGpuMemory", None) is None
                                    else int(p.usedGpuMemory)) for p in procs)
        return None

    def _recovery_action(self, h: Any, errors: list[str]) -> int | None:
        fid = getattr(self._nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION",
                      NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)
        values = self._call("nvmlDeviceGetFieldValues", h, [fid], errors=errors)
        if not values:
            return None
        v = values[0]
        ret = int(getattr(v, "nvmlReturn", 0))
        if ret != 0:  # per-field status: NOT_SUPPORTED on drivers before r550
            self._once("recovery-action", "NVML: the GPU recovery action field is not "
                       "available (return code %d); field left empty", ret)
            return None
        return _field_value(v)

    def _ensure_events(self) -> None:
        """Create the XID event set once per session and register every GPU that supports it."""
        if self._events_tried:
            return
        self._events_tried = True
        mask = getattr(self._nv, "nvmlEventTypeXidCriticalError", NVML_EVENT_TYPE_XID_CRITICAL_ERROR)
        es = self._call("nvmlEventSetCreate")
        if es is None:
            return
        count = self._call("nvmlDeviceGetCount") or 0
        registered = 0
        for i in range(count):
            h = self._call("nvmlDeviceGetHandleByIndex", i)
            supported = self._call("nvmlDeviceGetSupportedEventTypes", h) if h is not None else None
            if not supported or not supported & mask:
                self._once(f"xid/{i}", "NVML: GPU %d does not report XID events", i)
                continue
            missing = object()
            if self._call("nvmlDeviceRegisterEvents", h, mask, es, missing=missing) is not missing:
                registered += 1
        self._event_set = es
        log.debug("NVML: XID events registered on %d of %d GPUs", registered, count)

    def _drain_events(self) -> None:
        """Move every queued XID event into _pending_xids (per NVML index). Never waits."""
        if self._event_set is None:
            return
        wait = getattr(self._nv, "nvmlEventSetWait", None)
        nvml_error = getattr(self._nv, "NVMLError", Exception)
        if wait is None:
            return
        for _ in range(MAX_EVENTS_PER_POLL):
            try:
                data = wait(self._event_set, 0)
            except nvml_error as exc:
                if getattr(exc, "value", None) != NVML_ERROR_TIMEOUT:  # TIMEOUT: queue empty
                    self._once(f"eventwait/{getattr(exc, 'value', None)}",
                               "NVML: nvmlEventSetWait failed: %s", exc)
                return
            index = self._call("nvmlDeviceGetIndex", data.device)
            if index is not None:
                self._pending_xids.setdefault(int(index), []).append(int(data.eventData))
                self._xid_totals[int(index)] = self._xid_totals.get(int(index), 0) + 1
