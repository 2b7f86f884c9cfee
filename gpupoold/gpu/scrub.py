"""Run gpupool-scrub on a GPU and read its result (worker/scrub/README.md).

The scrub is a separate process with a fresh CUDA context: it takes all free device memory,
zeroes it, verifies samples and frees it, then prints one JSON line:

    {"ok":true,"bytes":N,"allocations":K,"free_before":F,"total":T,"samples":S,"duration_s":D,"init_s":I}
    {"ok":false,"stage":"init|alloc|memset|sync|verify|free","error":"TEXT"}

`run_scrub` never raises (cancellation aside): a binary that cannot start, crashes, hangs past the
timeout or prints nonsense is a `ScrubResult` with ok=False and an error saying what happened.
Its progress lines (stderr) go to the log as they come.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpupoold.gpu.environment import driver_environment
from gpupoold.gpu.inventory import Gpu

log = logging.getLogger("gpupoold.scrub")

STDERR_TAIL_LINES = 20  # kept for the error text when the scrub dies without a result
STDOUT_LIMIT = 1 << 20  # bytes; the result is one short line
KILL_WAIT = 10.0  # seconds to wait for a killed scrub to be reaped
STAGES = ("init", "alloc", "memset", "sync", "verify", "free")


@dataclass(frozen=True)
class ScrubResult:
    ok: bool
    bytes: int
    duration_s: float
    error: str  # "" when ok
    detail: dict[str, Any] = field(default_factory=dict)  # the JSON line as parsed ({} if none)


def scrub_command(binary: Path, gpu: Gpu) -> list[str]:
    cmd = [str(binary), "--driver", gpu.driver, "--device", str(gpu.ordinal)]
    if gpu.simulated:
        cmd.append("--simulated")
    return cmd


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _last_json(stdout: bytes) -> dict[str, Any] | None:
    for line in reversed(stdout.decode(errors="replace").splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            value = json.loads(line)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None
    return None


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


def interpret(exit_code: int, stdout: bytes, stderr_tail: list[str], wall_s: float) -> ScrubResult:
    """The ScrubResult for a finished scrub process."""
    detail = _last_json(stdout)
    tail = "; ".join(stderr_tail[-3:]) or "no output"
    if detail is None:
        return ScrubResult(False, 0, wall_s, f"gpupool-scrub {_describe_exit(exit_code)} without a result "
                           f"(last output: {tail}); check the daemon log", {})
    if detail.get("ok") is True:
        size, duration = _number(detail.get("bytes")), _number(detail.get("duration_s"))
        if exit_code != 0 or size is None or duration is None:
            return ScrubResult(False, 0, wall_s, f"gpupool-scrub {_describe_exit(exit_code)} with an "
                               f"inconsistent result {json.dumps(detail)[:300]}; is the binary from "
                               "another gpupool version?", detail)
        return ScrubResult(True, int(size), float(duration), "", detail)
    stage = detail.get("stage")
    error = detail.get("error")
    if stage not in STAGES or not isinstance(error, str):
        return ScrubResult(False, 0, wall_s, f"gpupool-scrub {_describe_exit(exit_code)} with an "
                           f"unexpected result {json.dumps(detail)[:300]}", detail)
    return ScrubResult(False, 0, wall_s, f"stage {stage}: {error}", detail)


async def _read_stderr(stream: asyncio.StreamReader, prefix: str, tail: deque[str]) -> None:
    pending = b""
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace").rstrip()
            if line:
                tail.append(line)
                log.info("%s%s", prefix, line)
        if len(pending) > 65536:  # an endless line: log it in pieces
            tail.append(pending.decode(errors="replace"))
            log.info("%s%s", prefix, tail[-1])
            pending = b""
    if pending.strip():
        tail.append(pending.decode(errors="replace").rstrip())
        log.info("%s%s", prefix, tail[-1])


async def _read_stdout(stream: asyncio.StreamReader) -> bytes:
    data = b""
    while len(data) <= STDOUT_LIMIT:
        chunk = await stream.read(65536)
        if not chunk:
            break
        data += chunk
    return data[-STDOUT_LIMIT:]


async def run_scrub(binary: Path, gpu: Gpu, timeout: float) -> ScrubResult:
    """Scrub `gpu` with the gpupool-scrub at `binary`, killing it after `timeout` seconds."""
    start = time.monotonic()
    if not gpu.driver:
        return ScrubResult(False, 0, 0.0, f"GPU {gpu.index} has no driver library to scrub with; "
                           "check the `driver` (or `sim_lib`) setting", {})
    cmd = scrub_command(binary, gpu)
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=driver_environment(gpu))
    except OSError as exc:
        return ScrubResult(False, 0, 0.0, f"cannot start the scrub binary {binary}: {exc}; reinstall "
                           "gpupoold or set the scrub binary's path", {})
    assert proc.stdout is not None and proc.stderr is not None
    tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
    readers = asyncio.gather(_read_stdout(proc.stdout),
                             _read_stderr(proc.stderr, f"scrub GPU {gpu.index}: ", tail))
    try:
        stdout, _ = await asyncio.wait_for(asyncio.shield(readers), timeout)
        code = await asyncio.wait_for(proc.wait(), max(1.0, timeout - (time.monotonic() - start)))
    except TimeoutError:
        await _kill(proc, readers)
        wall = time.monotonic() - start
        last = f" (last output: {tail[-1]})" if tail else ""
        log.error("scrub of GPU %d still running after %.0f s: killed", gpu.index, timeout)
        return ScrubResult(False, 0, wall, f"the scrub did not finish within {timeout:g} s and was killed"
                           f"{last}; the GPU or its driver may be hung: check nvidia-smi and the "
                           "kernel log, then reset the GPU", {})
    except asyncio.CancelledError:
        await _kill(proc, readers)
        raise
    except OSError as exc:  # reading the pipes failed: nothing to parse
        await _kill(proc, readers)
        return ScrubResult(False, 0, time.monotonic() - start, f"lost the scrub's output: {exc}", {})
    result = interpret(code, stdout, list(tail), time.monotonic() - start)
    if result.ok:
        log.info("scrub of GPU %d: %d bytes in %.2f s", gpu.index, result.bytes, result.duration_s)
    else:
        # An error, not a warning: the GPU may still hold the last tenant's data, and it is
        # not leased again until a scrub succeeds.
        log.error("scrub of GPU %d failed: %s. The GPU is not leased again until a scrub "
                  "succeeds: fix the cause (this line and the scrub's output above), then "
                  "`gpupoold gpu clear %d`", gpu.index, result.error, gpu.index)
    return result


async def _kill(proc: asyncio.subprocess.Process, readers: asyncio.Future[Any]) -> None:
    """SIGKILL the scrub and reap it; the pipe readers end with it."""
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    # A process stuck in the driver (uninterruptible sleep) may take a while to die. We wait a
    # little, not for ever: asyncio's child watcher reaps it whenever it goes.
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), KILL_WAIT)
    except TimeoutError:
        log.error("scrub process %d did not die within %.0f s of SIGKILL (stuck in the driver?)",
                  proc.pid, KILL_WAIT)
    readers.cancel()
    with contextlib.suppress(asyncio.CancelledError, OSError):
        await readers
