"""gpupool-checkpoint (worker/checkpoint/README.md): detach a process's CUDA state from its GPU and
attach it again, through the driver's process checkpoints, here on the simulated device: a tenant
process keeps 3 MiB of device memory across a detach and an attach onto the other GPU, and finds
every byte at the same address; wrong states, processes that are not CUDA processes, drivers
without the API and bad command lines fail with what happened."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SAN

TENANT = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
def ok(r):
    assert r == 0, f"CUresult {r}"
ok(lib.cuInit(0))
dev = ctypes.c_int()
ok(lib.cuDeviceGet(ctypes.byref(dev), 0))
ctx = ctypes.c_void_p()
ok(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
ok(lib.cuCtxSetCurrent(ctx))
n = 3 << 20
ptr = ctypes.c_uint64()
ok(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(n)))
data = bytes((i * 7 + 3) & 255 for i in range(n))
ok(lib.cuMemcpyHtoD_v2(ptr, data, ctypes.c_size_t(n)))
print(ptr.value, flush=True)
sys.stdin.readline()
back = ctypes.create_string_buffer(n)
ok(lib.cuMemcpyDtoH_v2(back, ptr, ctypes.c_size_t(n)))
uuid = ctypes.create_string_buffer(16)
ok(lib.cuDeviceGetUuid(uuid, dev))
print("same" if back.raw == data else "DIFFERENT", uuid.raw.hex(), flush=True)
"""

SIM_ENV = {"GPUPOOL_SIM_DEVICE_COUNT": "2", "GPUPOOL_SIM_TOTAL_MEMORY": "256MiB"}


def gpu_uuid(lib: Path, index: int) -> str:
    """The simulated GPU's UUID in nvidia-smi's form (worker/sim: device n adds n to the last byte)."""
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); assert lib.cuInit(0) == 0; "
            "u = ctypes.create_string_buffer(16); "
            f"assert lib.cuDeviceGetUuid(u, {index}) == 0; print(u.raw.hex())")
    h = subprocess.run([sys.executable, "-c", code, str(lib)], env={**os.environ, **SIM_ENV},
                       capture_output=True, text=True, check=True).stdout.strip()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@pytest.fixture
def tool(native_build: Path):
    exe = native_build / "gpupool-checkpoint"
    lib = native_build / "libgpupool-sim.so"

    def run(*args: str, driver: Path | str = lib) -> tuple[int, dict]:
        proc = subprocess.run([str(exe), "--driver", str(driver), *args], capture_output=True,
                              text=True, env={**os.environ, **SIM_ENV}, timeout=60)
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 1, proc.stdout + proc.stderr
        return proc.returncode, json.loads(lines[0])

    return run


@pytest.mark.skipif(SAN, reason="the tenant loads the simulated device into Python, which ASan "
                                "cannot instrument; the sim's own checkpoint tests run under ASan")
def test_detach_and_attach_onto_another_gpu(native_build: Path, tool) -> None:
    lib = native_build / "libgpupool-sim.so"
    with subprocess.Popen([sys.executable, "-c", TENANT, str(lib)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env={**os.environ, **SIM_ENV}) as tenant:
        assert tenant.stdout is not None and tenant.stdin is not None
        ptr = int(tenant.stdout.readline())
        assert ptr > 0
        pid = str(tenant.pid)
        assert tool("--pid", pid, "state") == (0, {"ok": True, "action": "state",
                                                   "state": "running", "first_s": 0.0,
                                                   "second_s": 0.0})
        code, out = tool("--pid", pid, "detach", "--timeout-ms", "2000")
        assert code == 0 and out["state"] == "checkpointed", out
        assert tool("--pid", pid, "state")[1]["state"] == "checkpointed"
        # Attaching twice: the second finds it running.
        g0, g1 = gpu_uuid(lib, 0), gpu_uuid(lib, 1)
        code, out = tool("--pid", pid, "attach", "--move", f"{g0}={g1}")
        assert code == 0 and out["state"] == "running", out
        code, out = tool("--pid", pid, "attach")
        assert code == 1 and "CUDA_ERROR_ILLEGAL_STATE" in out["error"] and "running" in out["error"]
        tenant.stdin.write("go\n")
        tenant.stdin.flush()
        same, uuid = tenant.stdout.readline().split()
        assert same == "same" and f"GPU-{uuid[:8]}" == g1[:12], (same, uuid, g1)
        assert tenant.wait(timeout=30) == 0


def test_failures_say_what_happened(native_build: Path, tool) -> None:
    code, out = tool("--pid", str(os.getpid()), "detach")
    assert code == 1 and out["ok"] is False and not out["busy"]
    assert f"process {os.getpid()} is not a CUDA process" in out["error"]
    code, out = tool("--pid", "1", "state", driver="libm.so.6")
    assert code == 1 and "lacks cuInit" in out["error"]
    code, out = tool("--pid", "1", "state", driver=native_build / "no-such-driver.so")
    assert code == 1 and "cannot load the driver" in out["error"]


@pytest.mark.parametrize("args, says", [
    ([], "--driver, --pid and an action are needed"),
    (["--pid", "12", "wipe"], "the action is detach, attach or state"),
    (["--pid", "x", "state"], "--pid: 'x' is not a number"),
    (["--pid", "12", "attach", "--move", "GPU-1=GPU-2"], "a GPU UUID is GPU-"),
    (["--pid", "12", "detach", "--move", "a=b"], "--move"),
])
def test_command_line_mistakes(native_build: Path, args: list[str], says: str) -> None:
    proc = subprocess.run([str(native_build / "gpupool-checkpoint"), "--driver", "x.so", *args],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and says in proc.stderr and "usage:" in proc.stderr, proc.stderr
