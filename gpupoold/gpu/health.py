"""Is a GPU fit for the next tenant? The health half of the check between leases.

`evaluate(report)` turns NVML's health fields (`gpupoold.gpu.nvml.HealthReport`) into problems in
words; `check_gpu` gathers the report for one GPU without blocking the event loop. A GPU with any
problem is quarantined by the caller until an operator clears it (or a reset fixes it).

What counts as a problem:
- uncorrectable ECC errors since the driver was loaded (volatile count > 0),
- remapped rows pending (a reset is needed) or a failed row remap (the GPU needs service),
- retired pages pending (a reset is needed),
- NVML's recovery action field other than "none",
- XID errors since the previous check, except the ones an application causes on its own
  (13, 31, 43, 45: a tenant's bad kernel must not take the GPU out of service),
- a compute process still on the GPU after its tenant is gone,
- an NVML query failing with a real error (for example "GPU is lost").

Simulated GPUs have no NVML. Their health is read from an optional fault-injection file
`<state_dir>/sim/gpu<N>.health` (N = the inventory index): a JSON object with HealthReport fields,
for example `{"xid_errors": [79]}` or `{"processes": [{"pid": 1234, "used_memory": 576716800}]}`.
No file: healthy. It is a TEST AND DEMO HOOK, so that tests and a demo can drive the quarantine
path; it is read at every check and never deleted (like a real fault, it stays until someone
removes it). A file that is not valid JSON, or has unknown fields, is itself reported as a problem.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpupoold.gpu.inventory import Gpu
from gpupoold.gpu.nvml import HealthReport, Nvml, NvmlUnavailable

log = logging.getLogger("gpupoold.health")

MIB = 1 << 20

# NVIDIA's XID catalogue, for the messages (well-known numbers only; others print as "XID n").
XID_TEXT = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    32: "invalid or corrupted push buffer stream",
    38: "driver firmware error",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapping recording failure",
    68: "video processor exception",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU fell off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}

# XIDs that a faulty application triggers by itself (illegal address, exception in its kernel,
# its context torn down): reported in the details, not a reason to quarantine.
APPLICATION_XIDS = frozenset({13, 31, 43, 45})

# NVML_GPU_RECOVERY_ACTION_* (nvml.h)
RECOVERY_ACTIONS = {
    0: "none",
    1: "reset",
    2: "node reboot",
    3: "drain P2P",
    4: "drain and reset",
    5: "recover IMEX domain",
    6: "bus reset",
    7: "system reboot",
}


@dataclass(frozen=True)
class HealthResult:
    ok: bool
    problems: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)  # the report as JSON, and its source


def describe_xid(xid: int) -> str:
    text = XID_TEXT.get(xid)
    return f"XID {xid}: {text}" if text else f"XID {xid}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def evaluate(report: HealthReport) -> list[str]:
    """The problems in `report`, in words, each naming the field and its value. [] = healthy."""
    problems: list[str] = []
    if report.ecc_volatile_uncorrected:
        problems.append(f"{_plural(report.ecc_volatile_uncorrected, 'volatile uncorrectable ECC error')}"
                        " since the driver was loaded")
    if report.remapped_rows_pending:
        problems.append("remapped rows pending (a reset is needed)")
    if report.remapped_rows_failure:
        problems.append("row remapping failed (the GPU needs service)")
    if report.retired_pages_pending:
        problems.append("retired pages pending (a reset is needed)")
    if report.recovery_action:
        action = RECOVERY_ACTIONS.get(report.recovery_action,
                                      f"unknown action {report.recovery_action}")
        problems.append(f"recovery action: {action}")
    for xid in dict.fromkeys(report.xid_errors):  # each XID once, in order
        if xid not in APPLICATION_XIDS:
            count = report.xid_errors.count(xid)
            problems.append(describe_xid(xid) + (f" ({count} times)" if count > 1 else ""))
    for proc in report.processes or ():
        mem = f" ({proc.used_memory // MIB} MiB)" if proc.used_memory is not None else ""
        problems.append(f"leftover process pid {proc.pid}{mem} still on the GPU")
    for err in report.errors:
        problems.append(f"NVML error: {err}")
    return problems


def fault_file(state_dir: Path, index: int) -> Path:
    """The fault-injection file of simulated GPU `index` (see the module docstring)."""
    return state_dir / "sim" / f"gpu{index}.health"


def _read_fault_file(path: Path) -> tuple[HealthReport | None, str | None]:
    """(report, None), or (None, problem) for a broken file; (HealthReport(), None) if absent."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return HealthReport(), None
    except OSError as exc:
        return None, f"cannot read the fault-injection file {path}: {exc.strerror}"
    try:
        return HealthReport.from_json(json.loads(text)), None
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        return None, (f"the fault-injection file {path} is not a valid health report ({exc}): "
                      "fix or delete it")


def _result(report: HealthReport, source: str) -> HealthResult:
    problems = evaluate(report)
    return HealthResult(ok=not problems, problems=problems,
                        details={"source": source, **report.to_json()})


async def check_gpu(gpu: Gpu, nvml: Nvml | None, state_dir: Path) -> HealthResult:
    """The health of `gpu`, right now. Never raises; NVML runs in a thread."""
    if gpu.simulated:
        path = fault_file(state_dir, gpu.index)
        report, problem = await asyncio.to_thread(_read_fault_file, path)
        if report is None:
            assert problem is not None
            return HealthResult(ok=False, problems=[problem],
                                details={"source": "fault file", "path": str(path)})
        source = "fault file" if path.exists() else "simulated"
        return _result(report, source)
    if nvml is None or not gpu.uuid:
        # Real GPUs served without NVML (the inventory warned at start; such GPUs have no UUID):
        # nothing to read.
        return HealthResult(ok=True, details={
            "source": "none", "checked": False,
            "note": "health not checked: NVML is not available (install the NVIDIA driver's "
                    "libnvidia-ml.so.1 and nvidia-ml-py)"})
    try:
        report = await asyncio.to_thread(nvml.health, gpu.ordinal)
    except NvmlUnavailable as exc:
        return HealthResult(ok=False, problems=[f"NVML cannot check the GPU: {exc}"],
                            details={"source": "nvml"})
    except Exception as exc:  # a bug or a broken binding: quarantine, do not crash the daemon
        log.exception("GPU %d: health check failed", gpu.index)
        return HealthResult(ok=False, problems=[f"health check failed: {exc}"],
                            details={"source": "nvml"})
    return _result(report, "nvml")
