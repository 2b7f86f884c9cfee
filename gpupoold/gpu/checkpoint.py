"""Run gpupool-checkpoint on a worker and read its result (worker/checkpoint/README.md).

Idle detach (pool/detach.py) moves a parked worker's device state into its host memory and back
with the driver's process checkpoints; the calls need `cuInit` in the calling process, which the
daemon must not do, and a driver that hangs in them must not hang the daemon: hence a process of
its own, killed after a timeout, like gpupool-scrub.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from gpupoold.gpu.environment import driver_environment
from gpupoold.gpu.inventory import Gpu

log = logging.getLogger("gpupoold.checkpoint")

EXIT_BUSY = 3  # the lock was not taken in time: work still ran; nothing changed
OUTPUT_LIMIT = 65536


@dataclass(frozen=True)
class CheckpointResult:
    ok: bool
    seconds: float  # wall time of the whole tool run
    busy: bool = False  # detach only: work was still running, try later
    error: str = ""
    # The driver lacks the calls (older than CUDA 12.8): no lease on this GPU can detach.
    unsupported: bool = False


async def run_checkpoint(binary: Path, gpu: Gpu, pid: int, action: str, *,
                         timeout: float, lock_timeout_ms: int = 0,
                         moves: tuple[tuple[str, str], ...] = ()) -> CheckpointResult:
    """`gpupool-checkpoint --pid PID detach|attach` against `gpu`'s driver."""
    cmd = [str(binary), "--driver", gpu.driver, "--pid", str(pid), action]
    if action == "detach" and lock_timeout_ms > 0:
        cmd += ["--timeout-ms", str(lock_timeout_ms)]
    for old, new in moves:
        cmd += ["--move", f"{old}={new}"]
    start = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=driver_environment(gpu))
    except OSError as exc:
        return CheckpointResult(False, 0.0, error=f"cannot start {binary}: {exc}; reinstall "
                                "gpupoold", unsupported=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except (TimeoutError, asyncio.CancelledError) as exc:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        if isinstance(exc, asyncio.CancelledError):
            raise
        return CheckpointResult(False, time.monotonic() - start, error=f"gpupool-checkpoint "
                                f"{action} did not finish within {timeout:g} s and was killed")
    wall = time.monotonic() - start
    for line in err.decode(errors="replace").splitlines()[-5:]:
        if line.strip():
            log.info("checkpoint pid %d: %s", pid, line.strip())
    try:
        result = json.loads(out[-OUTPUT_LIMIT:].decode(errors="replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        return CheckpointResult(False, wall, error=f"gpupool-checkpoint {action} exited with "
                                f"code {proc.returncode} without a result")
    if result.get("ok") is True and proc.returncode == 0:
        return CheckpointResult(True, wall)
    error = str(result.get("error") or f"exit code {proc.returncode}")
    return CheckpointResult(False, wall, busy=proc.returncode == EXIT_BUSY, error=error,
                            unsupported="lacks" in error or "cannot load the driver" in error)
