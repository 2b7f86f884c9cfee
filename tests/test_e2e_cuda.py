"""End to end: CUDA programs built with nvcc run through shim -> TCP -> gpupoold -> worker ->
simulated device, and check their own results.

Every program of tests/cuda/ is built twice, with `-cudart shared` and with the default static
cudart (the two ways cudart finds libcuda.so.1), into <build>/cuda-tests/<mode>/ (rebuilt when a
source is newer), and each test runs in both modes. A program prints `PASS <name>: ...` or
`FAIL <name>: ...` as its last line and exits non-zero on any failure; the test shows its whole
output and the daemon's log when it fails. Performance is never asserted here (bench/ does that).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO, build_lock, require, run_client

CUDA_DIR = REPO / "tests" / "cuda"
KERNELS_HEADER = REPO / "tests" / "sim" / "gp_test_kernels.cuh"
MODES = ("shared", "static")
PROGRAMS = ("devices", "copies", "events", "kernels", "errors", "longrun", "threads", "demo",
            "graphs", "detach")
ARCH = os.environ.get("GPUPOOL_TEST_ARCH", "sm_90")
GIB = 1 << 30

# What the simulated device declares by default (worker/sim, gpupoold/config/settings.py).
SIM_DEFAULTS = {"totalGlobalMem": 80 * GIB, "major": 9, "minor": 0, "multiProcessorCount": 132}


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


class CudaPrograms:
    """Builds every test program in both cudart modes in the background; .path() waits."""

    def __init__(self, nvcc: str, out_dir: Path) -> None:
        self.nvcc = nvcc
        self.out_dir = out_dir
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)))
        self._builds: dict[tuple[str, str], Future[Path]] = {}
        for name in PROGRAMS:  # in the order the tests use them
            for mode in MODES:
                self._builds[(name, mode)] = self._pool.submit(self._build, name, mode)

    def _build(self, name: str, mode: str) -> Path:
        src = CUDA_DIR / f"{name}.cu"
        out = self.out_dir / mode / name
        deps = [src, CUDA_DIR / "gp_check.cuh", KERNELS_HEADER]
        with build_lock(out):  # built once for every process of a parallel run
            if out.exists() and all(d.stat().st_mtime <= out.stat().st_mtime for d in deps):
                return out
            tmp = out.with_name(f".{name}.{os.getpid()}.tmp")
            cmd = [self.nvcc, f"-arch={ARCH}", "-O2", "-cudart", mode, "-o", str(tmp), str(src)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
            tmp.replace(out)
            return out

    def path(self, name: str, mode: str) -> Path:
        try:
            return self._builds[(name, mode)].result()
        except RuntimeError as exc:
            pytest.fail(str(exc), pytrace=False)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def cuda_programs(native_build: Path):
    nvcc = nvcc_path()
    require(nvcc is not None, "nvcc (CUDA toolkit) not found: the CUDA test programs cannot be built")
    progs = CudaPrograms(nvcc, native_build / "cuda-tests")
    yield progs
    progs.close()


@pytest.fixture(params=MODES, ids=lambda m: f"cudart-{m}")
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


def show(proc: subprocess.CompletedProcess[str], server) -> str:
    return (f"exit status {proc.returncode}\n--- stdout\n{proc.stdout[-12000:]}\n"
            f"--- stderr\n{proc.stderr[-8000:]}\n--- gpupoold log (tail)\n"
            f"{server.log_text()[-6000:]}")


def run_program(cuda_programs: CudaPrograms, server, name: str, mode: str, *args: str,
                timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs a test program as a client of `server` and asserts its PASS line."""
    exe = cuda_programs.path(name, mode)
    proc = run_client([exe, *args], env=server.client_env(), timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    last = lines[-1] if lines else ""
    assert proc.returncode == 0 and last.startswith(f"PASS {name}"), (
        f"{name} ({mode} cudart) did not pass:\n{show(proc, server)}")
    return proc


def key_values(text: str) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"^([\w.]+)=(.*)$", text, re.M))


# ----------------------------------------------------------------------------------- tests
@pytest.mark.san
def test_devices(cuda_programs, gpupool_server, mode):
    proc = run_program(cuda_programs, gpupool_server, "devices", mode, "1")
    kv = key_values(proc.stdout)
    assert kv["device_count"] == "1"
    assert "simulated" in kv["dev0.name"].lower(), kv["dev0.name"]
    for key, want in SIM_DEFAULTS.items():
        assert int(kv[f"dev0.{key}"]) == want, f"dev0.{key} = {kv[f'dev0.{key}']}, expected {want}"
    assert int(kv["dev0.memGetInfo.total"]) == 80 * GIB
    # The same device the server lists.
    gpus = gpupool_server.get_json("/api/v1/gpus")["gpus"]
    assert len(gpus) == 1
    assert gpus[0]["simulated"] is True
    assert kv["dev0.name"] == gpus[0]["name"]
    assert kv["dev0.uuid"].lower() == gpus[0]["uuid"].lower()
    from gpupoold.gpu.sim import sim_pci_address

    assert int(kv["dev0.pciBusID"]) == sim_pci_address(0)[1]


@pytest.mark.san
def test_copies(cuda_programs, gpupool_server, mode):
    run_program(cuda_programs, gpupool_server, "copies", mode, timeout=600)


def test_copies_1gib(cuda_programs, gpupool_server):
    """The 1 GiB case, once (static cudart): every direction, sync and async."""
    run_program(cuda_programs, gpupool_server, "copies", "static", "1G", timeout=600)


@pytest.mark.san
def test_events(cuda_programs, gpupool_server, mode):
    run_program(cuda_programs, gpupool_server, "events", mode, "50")


@pytest.mark.san
def test_kernels(cuda_programs, gpupool_server, mode):
    run_program(cuda_programs, gpupool_server, "kernels", mode, "10000")


@pytest.mark.san
def test_errors(cuda_programs, gpupool_server, mode):
    proc = run_program(cuda_programs, gpupool_server, "errors", mode)
    # The unknown kernel: the shim says on stderr which kernel the device could not run.
    assert "errors_unknown_kernel_q7" in proc.stderr, (
        "the shim's message about the unknown kernel does not name it:\n"
        + show(proc, gpupool_server))
    # A memset running past the end of mapped host memory: refused, with one line saying so.
    assert proc.stderr.count("runs past the end of the host memory there") == 1, show(proc, gpupool_server)


@pytest.mark.san
def test_graphs(cuda_programs, gpupool_server, mode):
    proc = run_program(cuda_programs, gpupool_server, "graphs", mode, "20")
    # The host-to-device copy inside a capture: one line from the shim saying why and what to do.
    assert "on a capturing stream is not supported" in proc.stderr and (
        "capture a device-to-device copy instead" in proc.stderr), (
        "the shim did not explain the refused host copy:\n" + show(proc, gpupool_server))
    assert "not implemented" not in proc.stderr, show(proc, gpupool_server)


@pytest.mark.san
def test_threads(cuda_programs, gpupool_server, mode):
    run_program(cuda_programs, gpupool_server, "threads", mode, "8", "200")


def test_demo(cuda_programs, gpupool_server, mode):
    proc = run_program(cuda_programs, gpupool_server, "demo", mode)
    assert "axpy on" in proc.stdout and "correct" in proc.stdout


def test_many_programs_in_turn(cuda_programs, gpupool_server):
    """Sessions end cleanly: one daemon serves many short programs, one after another and
    several at once."""
    exe = cuda_programs.path("devices", "static")
    for _ in range(3):
        proc = run_client([exe, "1"], env=gpupool_server.client_env(), timeout=60)
        assert proc.returncode == 0, show(proc, gpupool_server)
    procs = [subprocess.Popen([str(exe), "1"], env=gpupool_server.client_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"concurrent client failed:\n{out}\n{err}"


@pytest.mark.san
def test_kill_server_mid_run(cuda_programs, gpupool_server, mode):
    """SIGKILL of the daemon and its workers while a program runs: the program ends with a CUDA
    error and one line from the shim saying what happened, within seconds; never a hang."""
    exe = cuda_programs.path("longrun", mode)
    proc = subprocess.Popen([str(exe), "120"], env=gpupool_server.client_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    out: list[str] = []
    err: list[str] = []
    ticks = threading.Semaphore(0)

    def read_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if line.startswith("tick"):
                ticks.release()

    def read_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err.append(line)

    readers = [threading.Thread(target=read_out, daemon=True),
               threading.Thread(target=read_err, daemon=True)]
    for t in readers:
        t.start()
    try:
        for _ in range(5):
            if not ticks.acquire(timeout=60):
                pytest.fail(f"longrun made no progress before the kill:\n{''.join(out)}\n"
                            f"{''.join(err)}\n{gpupool_server.log_text()}", pytrace=False)
        gpupool_server.kill()
        t0 = time.monotonic()
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("longrun still running 30 s after the server was killed (hang):\n"
                        f"{''.join(out)[-3000:]}\n--- stderr\n{''.join(err)}", pytrace=False)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for t in readers:
        t.join(5)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    stdout, stderr = "".join(out), "".join(err)
    assert rc != 0, f"longrun exited 0 after the kill:\n{stdout[-2000:]}\n{stderr}"
    assert rc == 1, f"longrun exited {rc} (1 = CUDA error expected; 2 = wrong data; <0 = signal)" \
                    f":\n{stdout[-2000:]}\n{stderr}"
    assert "longrun: CUDA error" in stderr, stderr
    shim_lines = [ln for ln in stderr.splitlines() if not ln.startswith("longrun:")]
    assert any(re.search(r"(?i)connection|disconnect|lost|closed|server", ln)
               for ln in shim_lines), (
        f"no line from the shim about the lost connection on stderr:\n{stderr}")
    print(f"longrun ended {took:.2f} s after the kill with: {stderr.strip()}")
