"""Between tenants: scrub a GPU's memory, check its health, reset it if the policy says so.

`GpuCleaner.clean(gpu)` is what the lease manager runs after every lease and at start-up. It
never raises: every outcome is a `CleanResult`, whose `ok` decides between `free` and
`quarantined`, and whose `to_json()` is stored with the lease record.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpupoold.gpu.health import check_gpu
from gpupoold.gpu.inventory import Gpu
from gpupoold.gpu.nvml import Nvml
from gpupoold.gpu.reset import request_reset, should_reset
from gpupoold.gpu.scrub import ScrubResult, run_scrub

log = logging.getLogger("gpupoold.scrub")

RESET_TIMEOUT = 120.0


@dataclass
class CleanResult:
    ok: bool
    problems: list[str] = field(default_factory=list)
    scrub: dict[str, Any] = field(default_factory=dict)
    health: dict[str, Any] = field(default_factory=dict)
    reset: dict[str, Any] | None = None
    duration_s: float = 0.0

    def summary(self) -> str:
        if self.ok:
            return (f"scrubbed {self.scrub.get('bytes', 0) / (1 << 30):.2f} GiB in "
                    f"{self.scrub.get('duration_s', 0):.2f} s, healthy")
        return "; ".join(self.problems)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "problems": self.problems, "scrub": self.scrub,
                "health": self.health, "reset": self.reset,
                "duration_s": round(self.duration_s, 3)}


def _scrub_json(r: ScrubResult) -> dict[str, Any]:
    out = dict(r.detail)
    out.update(ok=r.ok, bytes=r.bytes, duration_s=r.duration_s)
    if r.error:
        out["error"] = r.error
    return out


class GpuCleaner:
    def __init__(self, scrub_binary: Path | None, nvml: Nvml | None, state_dir: Path,
                 reset_policy: str, reset_socket: Path, scrub_timeout: float) -> None:
        self.scrub_binary = scrub_binary
        self.nvml = nvml
        self.state_dir = state_dir
        self.reset_policy = reset_policy
        self.reset_socket = reset_socket
        self.scrub_timeout = scrub_timeout

    async def _scrub_and_check(self, gpu: Gpu) -> CleanResult:
        problems: list[str] = []
        if self.scrub_binary is None:
            scrub: dict[str, Any] = {"ok": False, "error": "the gpupool-scrub binary was not found"}
            problems.append("memory not scrubbed: the gpupool-scrub binary was not found "
                            "(reinstall gpupoold)")
        else:
            r = await run_scrub(self.scrub_binary, gpu, self.scrub_timeout)
            scrub = _scrub_json(r)
            if not r.ok:
                problems.append(f"memory scrub failed: {r.error}")
        health = await check_gpu(gpu, self.nvml, self.state_dir)
        problems.extend(health.problems)
        return CleanResult(ok=not problems, problems=problems, scrub=scrub,
                           health={"ok": health.ok, "problems": health.problems,
                                   **health.details})

    async def clean(self, gpu: Gpu) -> CleanResult:
        t0 = time.monotonic()
        try:
            result = await self._scrub_and_check(gpu)
            if should_reset(self.reset_policy, bool(result.scrub.get("ok")),
                            not result.problems or bool(result.health.get("ok"))):
                log.warning("GPU %d: full reset (reset_policy = %s)", gpu.index, self.reset_policy)
                reset = await request_reset(self.reset_socket, gpu, RESET_TIMEOUT, nvml=self.nvml)
                reset_json = {"ok": reset.ok, "error": reset.error,
                              "duration_s": reset.duration_s}
                if reset.ok:
                    result = await self._scrub_and_check(gpu)
                else:
                    result.problems.append(f"reset failed: {reset.error}")
                    result.ok = False
                result.reset = reset_json
        except Exception as exc:  # a bug here must quarantine the GPU, not crash the daemon
            log.exception("GPU %d: error while cleaning", gpu.index)
            result = CleanResult(ok=False, problems=[f"internal error while cleaning: {exc}"])
        result.duration_s = time.monotonic() - t0
        return result
