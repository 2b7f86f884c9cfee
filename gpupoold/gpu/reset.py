"""Full GPU reset, daemon side: ask the privileged helper (`gpupool-reset-helper`) for it.

gpupoold faces the network and runs unprivileged; `nvidia-smi -r` needs root. So the reset lives
in a small helper (`gpupoold/gpu/reset_helper.py`, its own systemd unit) that listens on a Unix socket
and takes one JSON request per connection: `{"gpu_uuid": "GPU-..."}` -> `{"ok": bool,
"error": "...", "duration_s": F, "output": "..."}`. The helper checks the preconditions itself.

`reset_policy` (`should_reset`) decides when to ask: `never`, `on-error` (the scrub or the health
check failed) or `always` (after every lease). Simulated GPUs never reach the helper.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from gpupoold.gpu.inventory import Gpu
from gpupoold.gpu.nvml import Nvml

log = logging.getLogger("gpupoold.reset")

POLICIES = ("never", "on-error", "always")
MAX_REPLY = 64 * 1024


@dataclass(frozen=True)
class ResetResult:
    ok: bool
    error: str  # "" when ok; else what happened and what to do
    duration_s: float
    output: str = ""  # nvidia-smi's output, as the helper reports it
    note: str = ""  # e.g. "simulated reset"

    def to_json(self) -> dict[str, object]:
        return {"ok": self.ok, "error": self.error, "duration_s": round(self.duration_s, 3),
                "output": self.output, "note": self.note}


def should_reset(policy: str, scrub_ok: bool, health_ok: bool) -> bool:
    """Whether `reset_policy` = `policy` asks for a full reset after this scrub and health check."""
    if policy == "never":
        return False
    if policy == "always":
        return True
    if policy == "on-error":
        return not (scrub_ok and health_ok)
    raise ValueError(f"reset_policy must be one of {', '.join(POLICIES)}, got {policy!r}")


def _not_running(socket_path: Path, why: str) -> str:
    return (f"the reset helper is not running (socket {socket_path} {why}): install and start "
            "gpupool-reset-helper.socket, or set reset_policy = never")


async def _exchange(socket_path: Path, request: bytes) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(socket_path), limit=MAX_REPLY)
    try:
        writer.write(request)
        await writer.drain()
        return await reader.read(MAX_REPLY)  # the helper closes after its one reply
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


async def request_reset(socket_path: Path, gpu: Gpu, timeout: float,
                        nvml: Nvml | None = None) -> ResetResult:
    """Ask the helper to reset `gpu`; never raises. `timeout`: seconds to wait for its answer.

    `nvml`: this daemon's NVML session, released for the reset (`nvidia-smi -r` refuses while
    any NVML client holds the GPU) and reopened on the next query."""
    if gpu.simulated:
        return ResetResult(ok=True, error="", duration_s=0.0, note="simulated reset")
    if not gpu.uuid:
        return ResetResult(False, "cannot reset: the GPU's UUID is unknown (NVML is not "
                                  "available to gpupoold)", 0.0)
    t0 = time.monotonic()
    request = (json.dumps({"gpu_uuid": gpu.uuid}) + "\n").encode()
    if nvml is not None:
        await asyncio.to_thread(nvml.pause, "NVML released for a GPU reset")
    try:
        raw = await asyncio.wait_for(_exchange(socket_path, request), timeout)
    except FileNotFoundError:
        return ResetResult(False, _not_running(socket_path, "missing"), time.monotonic() - t0)
    except ConnectionRefusedError:
        return ResetResult(False, _not_running(socket_path, "refuses connections"),
                           time.monotonic() - t0)
    except PermissionError:
        return ResetResult(False, f"gpupoold may not connect to the reset helper's socket "
                                  f"{socket_path} (permission denied): start the helper with "
                                  "--group set to gpupoold's group", time.monotonic() - t0)
    except TimeoutError:
        return ResetResult(False, f"the reset helper did not answer within {timeout:g} s; the "
                                  "reset may still be running: check `journalctl -u "
                                  "gpupool-reset-helper` and `nvidia-smi`", time.monotonic() - t0)
    except OSError as exc:
        return ResetResult(False, f"cannot talk to the reset helper at {socket_path}: {exc}",
                           time.monotonic() - t0)
    finally:
        if nvml is not None:  # in a thread: the telemetry sampler may hold NVML's lock
            await asyncio.to_thread(nvml.resume)
    elapsed = time.monotonic() - t0
    try:
        reply = json.loads(raw)
        if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
            raise ValueError("no boolean 'ok'")
    except ValueError:
        shown = raw[:200].decode(errors="replace") or "nothing"
        return ResetResult(False, f"the reset helper answered {shown!r} instead of a reset "
                                  "result: check `journalctl -u gpupool-reset-helper`", elapsed)
    ok = reply["ok"]
    error = "" if ok else str(reply.get("error") or "the reset helper refused without a reason")
    duration = reply.get("duration_s")
    return ResetResult(ok, error, float(duration) if isinstance(duration, int | float) else elapsed,
                       output=str(reply.get("output") or ""))
