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
import socket
import subprocess
import time
from pathlib import Path

import gpupool_protocol as gp
import pytest
from conftest import REPO, require, run_client
from gpupool.wire.frames import read_frame
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


def cache_namespace(token: str) -> str:
    """The folder of a token's images in the module cache (worker/modcache.c)."""
    return hashlib.sha256(b"gpupool module cache\0" + token.encode()).hexdigest()[:16]


def claim_cached_image(server, token: str, image: bytes) -> int:
    """What a tenant without the image can try: a session of its own (plain TCP) and a
    module_load naming the image by its hash and size only. Returns the worker's answer."""
    with socket.create_connection((server.host, server.port), timeout=20) as s:
        hello = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=os.getpid(),
                         host="elsewhere", user="eve", program="claim_cached_image", token=token,
                         va_base=0x200000000000, va_size=1 << 40)
        s.sendall(gp.encode_frame(hello, 1))
        while (f := read_frame(s)).op == gp.Notice.OP and not f.flags & gp.FLAG_REPLY:
            pass  # queue notices
        assert f.op == gp.Hello.OP and gp.HelloReply.decode(f.body).result == 0, f
        s.sendall(gp.encode_frame(gp.ModuleLoad(module=0x6750040000000001, kind=0,
                                                sha256=hashlib.sha256(image).digest(),
                                                image_size=len(image), data=0), 2))
        while (f := read_frame(s)).op == gp.Notice.OP and not f.flags & gp.FLAG_REPLY:
            pass
        assert f.op == gp.ModuleLoad.OP, f
        s.sendall(gp.encode_frame(gp.Goodbye(), 0))
        return gp.ModuleLoadReply.decode(f.body).result


def test_images_cross_the_network_once(modules_build, plain_server):
    """The worker keeps every image it received in the server's cache under its SHA-256 (the
    name the shim computes), in the folder of the client's token; a second run finds them all
    there and sends none again. Checked by the cache files' times and by the worker's own count
    of module bytes received, which each lease record carries (`module_bytes`). In between,
    another token naming one of these images by its hash only is asked for the image: a token
    that never uploaded an image cannot load it."""
    server = plain_server
    _run(modules_build, server, "static")
    cache = server.state_dir / "cache" / "modules" / cache_namespace(server.token)
    images = (modules_build["cubin"].read_bytes(), modules_build["fatbin"].read_bytes(),
              modules_build["ptx"].read_bytes() + b"\0")  # PTX travels with its terminator
    want = {hashlib.sha256(image).hexdigest() for image in images}
    files = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert want <= set(files), f"images missing from {cache}: {sorted(want - set(files))}"
    (first,) = _ended_leases(server, 1)
    # Everything in the (new) cache came in this lease, each image once: the program's own
    # fatbin (through cudart) and the three files it loads itself.
    cached_bytes = sum(p.stat().st_size for p in cache.iterdir())
    assert first["module_bytes"] == cached_bytes, (first, cached_bytes)
    assert first["module_bytes"] >= sum(map(len, images)), first
    # The driver's PTX JIT cache (setting jit_cache_mib): the simulated device keeps a file per
    # PTX it loaded in the folder the worker was given (worker/sim/sim_jitcache.c), written
    # under the worker's sandbox.
    jit = server.state_dir / "cache" / "jit"
    compiled = {p.name: p.read_text() for p in jit.glob("sim-ptx-*")}
    assert compiled and all(t.startswith("compiled\n") for t in compiled.values()), compiled

    other = server.create_token("other-tenant")
    assert claim_cached_image(server, other, images[0]) == gp.GP_ENEEDIMAGE
    assert not any((server.state_dir / "cache" / "modules" / cache_namespace(other)).iterdir())
    _, theirs = _ended_leases(server, 2)

    _run(modules_build, server, "static")
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == files, (
        "the second run sent images again")
    # The second lease's loads of the same PTX found the first one's entries.
    again = {p.name: p.read_text() for p in jit.glob("sim-ptx-*")}
    assert set(again) == set(compiled)
    assert all(again[n].count("cached") > compiled[n].count("cached") for n in again), again
    first_again, theirs_again, second = _ended_leases(server, 3)
    assert (first_again["id"], theirs_again["id"]) == (first["id"], theirs["id"])
    assert theirs["module_bytes"] == 0
    assert second["module_bytes"] == 0, (
        f"the worker received {second['module_bytes']} bytes of module images in the second run "
        f"(all were cached):\n{second}")
