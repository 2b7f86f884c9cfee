"""End to end: modules, libraries, globals, function attributes, occupancy and every launch
variant (tests/cuda/modules.cu), through the runtime and straight through the driver API, on a
gpupoold with a simulated GPU. The program's device code is also compiled to a cubin, a fatbin
and PTX that it loads itself; a second run shows that images already on the server do not
cross the network again.

Needs nvcc; the program links against our libcuda.so (build/client) for its driver calls.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, require, run_client
from test_e2e_cuda import nvcc_path

SOURCE = REPO / "tests" / "cuda" / "modules.cu"
DEPS = (SOURCE, REPO / "tests" / "cuda" / "gp_check.cuh", REPO / "tests" / "sim" / "gp_test_kernels.cuh")
ARCH = os.environ.get("GPUPOOL_TEST_ARCH", "sm_90")


def _nvcc(nvcc: str, out: Path, *args: str) -> Path:
    if out.exists() and all(d.stat().st_mtime <= out.stat().st_mtime for d in DEPS):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    proc = subprocess.run([nvcc, f"-arch={ARCH}", *args, "-o", str(tmp), str(SOURCE)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tmp.replace(out)
    return out


@pytest.fixture(scope="module")
def modules_build(native_build: Path) -> dict[str, Path]:
    nvcc = nvcc_path()
    require(nvcc is not None, "nvcc (CUDA toolkit) not found: the CUDA test programs cannot be built")
    assert nvcc is not None
    out = native_build / "cuda-tests" / "modules"
    lib = ["-L", str(native_build / "client"), "-lcuda"]  # our libcuda.so for the driver calls
    return {
        "cubin": _nvcc(nvcc, out / "modules.cubin", "-cubin"),
        "fatbin": _nvcc(nvcc, out / "modules.fatbin", "-fatbin"),
        "ptx": _nvcc(nvcc, out / "modules.ptx", "-ptx"),
        "shared": _nvcc(nvcc, out / "modules-shared", "-O2", "-cudart", "shared", *lib),
        "static": _nvcc(nvcc, out / "modules-static", "-O2", *lib),
    }


def _run(build: dict[str, Path], server, mode: str) -> subprocess.CompletedProcess[str]:
    proc = run_client([build[mode], build["cubin"], build["fatbin"], build["ptx"]],
                      env=server.client_env(), timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith("PASS modules"), (
        f"modules ({mode} cudart) did not pass: exit {proc.returncode}\n--- stdout\n"
        f"{proc.stdout[-12000:]}\n--- stderr\n{proc.stderr[-8000:]}\n--- gpupoold log\n"
        f"{server.log_text()[-6000:]}")
    return proc


@pytest.mark.parametrize("mode", ["shared", "static"], ids=lambda m: f"cudart-{m}")
def test_modules(modules_build, gpupool_server, mode):
    proc = _run(modules_build, gpupool_server, mode)
    # cuLinkCreate is refused with one clear line.
    assert proc.stderr.count("JIT linking (cuLink*) is not supported") == 1, proc.stderr


def _ended_leases(server, count: int, timeout: float = 30) -> list[dict]:
    """The daemon's lease records once `count` leases have ended, oldest first."""
    deadline = time.monotonic() + timeout
    while True:
        leases = server.get_json("/api/v1/leases?state=ended&limit=100")["leases"]
        if len(leases) >= count:
            return sorted(leases, key=lambda r: r["id"])
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(leases)} of {count} leases ended after {timeout} s:\n"
                                 f"{leases}\n{server.log_text()[-4000:]}")
        time.sleep(0.05)


def test_images_cross_the_network_once(modules_build, gpupool_server):
    """The worker keeps every image it received in the server's cache under its SHA-256 (the
    name the shim computes); a second run finds them all there and sends none again. Checked
    by the cache files' times and by the worker's own count of module bytes received, which
    each lease record carries (`module_bytes`)."""
    _run(modules_build, gpupool_server, "static")
    cache = gpupool_server.state_dir / "cache" / "modules"
    images = (modules_build["cubin"].read_bytes(), modules_build["fatbin"].read_bytes(),
              modules_build["ptx"].read_bytes() + b"\0")  # PTX travels with its terminator
    want = {hashlib.sha256(image).hexdigest() for image in images}
    files = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert want <= set(files), f"images missing from {cache}: {sorted(want - set(files))}"
    (first,) = _ended_leases(gpupool_server, 1)
    # Everything in the (new) cache came in this lease, each image once: the program's own
    # fatbin (through cudart) and the three files it loads itself.
    cached_bytes = sum(p.stat().st_size for p in cache.iterdir())
    assert first["module_bytes"] == cached_bytes, (first, cached_bytes)
    assert first["module_bytes"] >= sum(map(len, images)), first
    _run(modules_build, gpupool_server, "static")
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == files, (
        "the second run sent images again")
    first_again, second = _ended_leases(gpupool_server, 2)
    assert first_again["id"] == first["id"] and second["id"] != first["id"]
    assert second["module_bytes"] == 0, (
        f"the worker received {second['module_bytes']} bytes of module images in the second run "
        f"(all were cached):\n{second}")
