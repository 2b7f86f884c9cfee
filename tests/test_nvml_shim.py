"""The NVML shim (client/nvml, our libnvidia-ml.so.1) under the real, unmodified pynvml
(nvidia-ml-py) in client processes, against a real gpupoold on simulated GPUs.

- every function the installed pynvml looks up is exported (implemented, or a generated stub
  answering NVML_ERROR_NOT_SUPPORTED), and client/nvml/generated/ is current;
- pynvml reads count, name, UUID, PCI bus id, memory and utilisation, equal to the server's
  API values; a process holding a lease sees exactly its GPU, its own pid among the compute
  processes, and its memory use as the server measures it; another process of the same client
  sees that pid too;
- requirements (GPUPOOL_GPU, GPUPOOL_GPU_MODEL) select the GPUs NVML shows;
- unknown functions raise NVMLError_NotSupported, init is refcounted, bad handles and buffers
  get NVML's errors;
- no server configured or none reachable: init works, 0 GPUs, one warning line naming why;
- PyTorch's NVML use (device_count with PYTORCH_NVML_BASED_CUDA_CHECK=1, utilization,
  list_gpu_processes) when torch is installed.
"""

from __future__ import annotations

import importlib.util
import json
import re
import select
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, GpupoolServer, have, require, run_client

LIB = "libnvidia-ml.so.1"
MIB = 1 << 20


# ------------------------------------------------------------------------------------ helpers
def pynvml_names() -> set[str]:
    """Every function name the installed pynvml looks up in the library."""
    import pynvml

    assert pynvml.__file__ is not None
    text = Path(pynvml.__file__).read_text(encoding="utf-8")
    names = set(re.findall(r'_nvmlGetFunctionPointer\(\s*"(nvml\w+)"\s*\)', text))
    assert len(names) > 100, f"found only {len(names)} lookups in {pynvml.__file__}"
    return names


def gpupool_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("gpupool: ")]


def run_py(server: GpupoolServer, code: str, extra: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_client([sys.executable, "-c", textwrap.dedent(code)], env=server.client_env(extra),
                      timeout=timeout)


def last_json(proc: subprocess.CompletedProcess[str]) -> Any:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr
    return json.loads(lines[-1])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a pynvml client reads of every GPU (errors as their class names).
READ_ALL = """
    import json, os, pynvml as n

    def get(fn, *args):
        try:
            v = fn(*args)
        except n.NVMLError as e:
            return type(e).__name__
        return v.decode() if isinstance(v, bytes) else v

    n.nvmlInit()
    out = {"count": n.nvmlDeviceGetCount(), "cuda": get(n.nvmlSystemGetCudaDriverVersion),
           "cuda_v2": get(n.nvmlSystemGetCudaDriverVersion_v2),
           "driver": get(n.nvmlSystemGetDriverVersion), "pid": os.getpid(), "gpus": []}
    for i in range(out["count"]):
        h = n.nvmlDeviceGetHandleByIndex(i)
        m = n.nvmlDeviceGetMemoryInfo(h)
        m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
        u = n.nvmlDeviceGetUtilizationRates(h)
        pci = n.nvmlDeviceGetPciInfo(h)
        uuid = get(n.nvmlDeviceGetUUID, h)
        bus_id = pci.busId.decode() if isinstance(pci.busId, bytes) else pci.busId
        out["gpus"].append({
            "name": get(n.nvmlDeviceGetName, h), "uuid": uuid,
            "index": n.nvmlDeviceGetIndex(h), "minor": n.nvmlDeviceGetMinorNumber(h),
            "memory": [m.total, m.free, m.used], "memory_v2": [m2.total, m2.free, m2.used],
            "util": [u.gpu, u.memory], "bus_id": bus_id, "bus": pci.bus,
            "by_uuid": n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByUUID(uuid)),
            "by_pci": n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByPciBusId(bus_id)),
            "temperature": get(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU),
            "power": get(n.nvmlDeviceGetPowerUsage, h),
            "sm_clock": get(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM),
            "serial": get(n.nvmlDeviceGetSerial, h),
            "cc": get(n.nvmlDeviceGetCudaComputeCapability, h),
            "procs": [[p.pid, p.usedGpuMemory]
                      for p in n.nvmlDeviceGetComputeRunningProcesses(h)],
            "graphics": n.nvmlDeviceGetGraphicsRunningProcesses(h),
        })
    n.nvmlShutdown()
    print(json.dumps(out))
"""


# ------------------------------------------------------------------------------ the library
def test_every_pynvml_function_is_exported(native_build: Path) -> None:
    require(have("nm"), "needs nm (binutils)")
    lib = native_build / "client" / LIB
    assert lib.is_file(), f"{lib} not built"
    assert (native_build / "client" / "libnvidia-ml.so").resolve() == lib.resolve()
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True,
                         text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    sys.path.insert(0, str(REPO / "client" / "nvml"))
    try:
        from gen_stubs import EXTRA_NAMES  # PyTorch's own NVML lookups
    finally:
        sys.path.pop(0)
    missing = sorted((pynvml_names() | set(EXTRA_NAMES)) - exported)
    assert not missing, (f"{LIB} does not export {len(missing)} function(s) pynvml looks up: "
                         f"{missing}; run .venv/bin/python client/nvml/gen_stubs.py")
    # Only NVML's names: the shared client code stays hidden.
    assert {n for n in exported if not n.startswith("nvml")} == {"gpupool_shim_version"}
    soname = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "Library soname: [libnvidia-ml.so.1]" in soname


def test_generated_stubs_are_current() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "client" / "nvml" / "gen_stubs.py"),
                           "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = (REPO / "client" / "nvml" / "generated" / "nvml_stubs.c").read_text()
    assert text.startswith("/*\n * DO NOT EDIT: generated by client/nvml/gen_stubs.py")


# ------------------------------------------------------------------- against a real daemon
@pytest.mark.san
def test_pynvml_reads_the_simulated_gpu(gpupool_server: GpupoolServer) -> None:
    proc = run_py(gpupool_server, READ_ALL)
    got = last_json(proc)
    assert gpupool_lines(proc.stderr) == [], proc.stderr
    api = gpupool_server.get_json("/api/v1/gpus")["gpus"]
    assert got["count"] == len(api) == 1
    g, a = got["gpus"][0], api[0]
    live = a["live"]
    assert g["name"] == a["name"]
    assert g["uuid"] == a["uuid"]
    assert g["index"] == g["minor"] == g["by_uuid"] == g["by_pci"] == 0
    assert g["bus_id"] == a["pci_bus_id"] and g["bus_id"].startswith("00000000:")
    assert g["memory"] == [a["memory_total"], live["memory_free"], live["memory_used"]]
    assert g["memory_v2"] == g["memory"]
    assert g["memory"][0] == live["memory_total"] > 0
    assert g["util"] == [round(live["gpu_util"]), round(live["memory_util"])]
    # The simulated GPU's sensors (gpupoold/gpu/sim.py, idle here), in NVML's units.
    assert g["temperature"] == live["temperature_c"] == 32
    assert g["power"] == round(live["power_w"] * 1000) == 70000  # mW
    assert g["sm_clock"] == live["sm_clock_mhz"] == 345
    assert g["serial"] == "NVMLError_NotSupported"
    assert g["cc"] == "NVMLError_NotSupported"  # the info document does not say; no lease here
    assert g["procs"] == [] and g["graphics"] == []
    assert got["cuda"] == got["cuda_v2"] == live["cuda_driver_version"] == 13000
    # A server of simulated GPUs reports the driver version of its CUDA 13.0 (telemetry.py).
    assert got["driver"] == "580.00.00"


# A client holding a lease through our libcuda.so.1 (ctypes on the driver API), with 256 MiB
# allocated; it reads NVML itself and has a child without libcuda read it too.
HOLD_AND_READ = """
    import ctypes, json, os, subprocess, sys, time
    cuda = ctypes.CDLL("libcuda.so.1")
    def ck(r, what):
        if r != 0:
            raise SystemExit(f"{what} failed: CUresult {r}")
    ck(cuda.cuInit(0), "cuInit")
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    ck(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ck(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
    ck(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(256 << 20)), "cuMemAlloc")
    ck(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
    import pynvml as n
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    # The server samples the worker's memory every telemetry interval; NVML refreshes each 1 s.
    deadline = time.monotonic() + 20
    while True:
        used = n.nvmlDeviceGetMemoryInfo(h).used
        if used >= 256 << 20 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    mine = {"count": n.nvmlDeviceGetCount(), "uuid": n.nvmlDeviceGetUUID(h),
            "name": n.nvmlDeviceGetName(h), "used": used, "pid": os.getpid(),
            "procs": [[p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(h)],
            "procs_v2": [p.pid for p in n.nvmlDeviceGetComputeRunningProcesses_v2(h)],
            "cc": n.nvmlDeviceGetCudaComputeCapability(h)}
    n.nvmlShutdown()
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
    print(child.stderr, file=sys.stderr)
    print(json.dumps({"mine": mine, "child": json.loads(child.stdout)}))
"""
CHILD = """
import json, sys, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
print(json.dumps({"libcuda": any("libcuda" in l for l in open("/proc/self/maps")),
                  "count": n.nvmlDeviceGetCount(), "uuid": n.nvmlDeviceGetUUID(h),
                  "procs": [p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)]}))
"""


@pytest.mark.san
def test_a_lease_holder_sees_its_gpu_and_its_pid(gpupool_server: GpupoolServer) -> None:
    code = f"CHILD = {CHILD!r}\n" + textwrap.dedent(HOLD_AND_READ)
    proc = run_py(gpupool_server, code, timeout=180)
    got = last_json(proc)
    assert gpupool_lines(proc.stderr) == [], proc.stderr
    mine, child = got["mine"], got["child"]
    gpu = gpupool_server.get_json("/api/v1/gpus")["gpus"][0]
    assert mine["count"] == 1
    assert mine["uuid"] == gpu["uuid"] and mine["name"] == gpu["name"]
    # Its own pid, with the memory the GPU has in use (the whole GPU is this process's).
    assert [p[0] for p in mine["procs"]] == [mine["pid"]] == mine["procs_v2"]
    assert mine["used"] >= 256 * MIB, mine
    assert mine["procs"][0][1] == mine["used"]
    # The compute capability comes from libcuda's snapshot of the leased GPU (simulated: 9.0).
    assert mine["cc"] == [9, 0]
    # Another process of the same client (same token and host) sees the lease's pid too.
    assert child["libcuda"] is False
    assert child["count"] == 1 and child["uuid"] == gpu["uuid"]
    assert child["procs"] == [mine["pid"]]


@pytest.mark.san
def test_requirements_select_the_gpus(start_daemon: Any, native_build: Path) -> None:
    server = start_daemon(simulated=2, build_dir=native_build)
    api = server.get_json("/api/v1/gpus")["gpus"]
    assert len(api) == 2
    code = """
        import json, pynvml as n
        n.nvmlInit()
        hs = [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]
        print(json.dumps([n.nvmlDeviceGetUUID(h) for h in hs]))
    """
    assert last_json(run_py(server, code)) == [g["uuid"] for g in api]
    assert last_json(run_py(server, code, {"GPUPOOL_GPU": "1"})) == [api[1]["uuid"]]
    assert last_json(run_py(server, code, {"GPUPOOL_GPU": api[0]["uuid"][:12]})) == [api[0]["uuid"]]
    proc = run_py(server, code, {"GPUPOOL_GPU_MODEL": "no-such-model"})
    assert last_json(proc) == []
    assert gpupool_lines(proc.stderr) == [], proc.stderr  # the server answered: no warning


@pytest.mark.san
def test_unknown_functions_and_nvml_errors(gpupool_server: GpupoolServer) -> None:
    code = """
        import ctypes, json, pynvml as n
        from ctypes import byref, c_uint, c_char, c_void_p
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        out = {}
        c = c_uint(7)
        out["before_init"] = lib.nvmlDeviceGetCount_v2(byref(c))
        out["stub_before_init"] = lib.nvmlDeviceGetBoardId(None, byref(c))
        lib.nvmlErrorString.restype = ctypes.c_char_p
        out["strings"] = [lib.nvmlErrorString(r).decode() for r in (0, 3, 999, 4242)]
        n.nvmlInit()
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        out["unsupported"] = []
        for fn in (n.nvmlDeviceGetBoardId, n.nvmlDeviceGetFanSpeed, n.nvmlDeviceGetVbiosVersion,
                   n.nvmlDeviceGetPersistenceMode, n.nvmlDeviceGetEccMode):
            try:
                fn(h)
                out["unsupported"].append(fn.__name__ + " answered")
            except n.NVMLError_NotSupported:
                out["unsupported"].append("NotSupported")
        try:
            n.nvmlDeviceGetHandleByIndex(1)
        except n.NVMLError as e:
            out["bad_index"] = type(e).__name__
        try:
            n.nvmlDeviceGetHandleByUUID(b"GPU-00000000-0000-0000-0000-000000000000")
        except n.NVMLError as e:
            out["bad_uuid"] = type(e).__name__
        bogus = ctypes.cast(c_void_p(8), n.c_nvmlDevice_t)
        out["bad_handle"] = lib.nvmlDeviceGetIndex(bogus, byref(c))
        small = (c_char * 4)()
        out["small_buffer"] = lib.nvmlDeviceGetUUID(h, small, 4)
        n.nvmlShutdown()
        out["after_one_shutdown"] = n.nvmlDeviceGetCount()
        n.nvmlShutdown()
        out["after_two"] = lib.nvmlDeviceGetCount_v2(byref(c))
        out["third_shutdown"] = lib.nvmlShutdown()
        print(json.dumps(out))
    """
    got = last_json(run_py(gpupool_server, code))
    assert got["before_init"] == 1 and got["stub_before_init"] == 1  # NVML_ERROR_UNINITIALIZED
    assert got["strings"] == ["Success", "Not Supported", "Unknown Error", "Unknown Error"]
    assert got["unsupported"] == ["NotSupported"] * 5
    assert got["bad_index"] == "NVMLError_InvalidArgument"
    assert got["bad_uuid"] == "NVMLError_NotFound"
    assert got["bad_handle"] == 2  # NVML_ERROR_INVALID_ARGUMENT
    assert got["small_buffer"] == 7  # NVML_ERROR_INSUFFICIENT_SIZE
    assert got["after_one_shutdown"] == 1  # refcounted: still initialised
    assert got["after_two"] == 1 and got["third_shutdown"] == 1


# ------------------------------------------------------------------------- without a server
@pytest.mark.san
def test_no_server_reachable(gpupool_server: GpupoolServer) -> None:
    code = """
        import json, pynvml as n
        n.nvmlInit()
        count = n.nvmlDeviceGetCount()
        try:
            n.nvmlSystemGetCudaDriverVersion()
            cuda = "answered"
        except n.NVMLError as e:
            cuda = type(e).__name__
        n.nvmlShutdown()
        n.nvmlInit()  # again: still one warning per process
        n.nvmlShutdown()
        print(json.dumps({"count": count, "cuda": cuda}))
    """
    address = f"127.0.0.1:{closed_port()}"
    proc = run_py(gpupool_server, code, {"GPUPOOL_SERVER": address})
    assert last_json(proc) == {"count": 0, "cuda": "NVMLError_NotSupported"}
    lines = gpupool_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert address in lines[0] and "refused" in lines[0].lower() and "0 GPUs" in lines[0]

    # Nothing configured at all: the warning says what to set.
    env_proc = run_client([sys.executable, "-c", textwrap.dedent(code)],
                          env={**gpupool_server.client_env(), "GPUPOOL_SERVER": ""})
    assert last_json(env_proc)["count"] == 0
    lines = gpupool_lines(env_proc.stderr)
    assert len(lines) == 1 and "GPUPOOL_SERVER" in lines[0], env_proc.stderr

    # A refused token: the server's reason, once.
    bad = run_py(gpupool_server, code, {"GPUPOOL_TOKEN": "gpt_not-a-token"})
    assert last_json(bad)["count"] == 0
    lines = gpupool_lines(bad.stderr)
    assert len(lines) == 1 and gpupool_server.address in lines[0], bad.stderr


# -------------------------------------------------------------------------------- PyTorch
@pytest.mark.san
def test_torch_nvml_use(gpupool_server: GpupoolServer) -> None:
    require(importlib.util.find_spec("torch") is not None,
            f"torch is not installed in {sys.executable}")
    code = """
        import json, os, time, torch
        count = torch.cuda.device_count()  # NVML-based: CUDA is not initialised by it
        initialized = torch.cuda.is_initialized()
        util = torch.cuda.utilization(0)
        before = torch.cuda.memory.list_gpu_processes(0)
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # takes the lease
        torch.cuda.synchronize()
        time.sleep(1.5)  # NVML's cached values are refreshed after 1 s
        after = torch.cuda.memory.list_gpu_processes(0)
        print(json.dumps({"count": count, "initialized": initialized, "util": util,
                          "before": before, "after": after, "pid": os.getpid()}))
    """
    proc = run_py(gpupool_server, code, {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}, timeout=300)
    got = last_json(proc)
    assert got["count"] == 1 and got["initialized"] is False
    assert got["util"] == 0  # the free simulated GPU: nothing ran on it yet
    assert got["before"] == "GPU:0\nno processes are running", got["before"]
    assert f"process {got['pid']:>10d} uses" in got["after"], got["after"]


def test_nvitop_shows_the_pool_gpu(gpupool_server: GpupoolServer) -> None:
    """nvitop (a real NVML monitoring tool, unmodified) draws the simulated GPU from our NVML
    library: its name, bus id and memory size as the server's API gives them."""
    nvitop = Path(sys.executable).parent / "nvitop"
    require(nvitop.exists(), f"needs nvitop next to {sys.executable} (pip install nvitop)")
    gpu = gpupool_server.get_json("/api/v1/gpus")["gpus"][0]
    proc = run_client([nvitop, "--once"], env=gpupool_server.client_env({"COLUMNS": "100"}),
                      timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "NVITOP" in out and "CUDA Driver Version: 13.0" in out, out
    assert gpu["pci_bus_id"] in out, out
    assert f"{gpu['memory_total'] / 2**30:.2f}GiB" in out, out  # "80.00GiB"
    assert "simulated)" in out, out  # the end of the name, as nvitop shortens it
    assert "Driver Version: 580.00.00" in out, out


def test_gpustat_shows_the_pool_gpu(gpupool_server: GpupoolServer) -> None:
    """gpustat (unmodified) lists the simulated GPU from our NVML library: it asks for the driver
    version first and gives up without one; then index, name, memory used and total."""
    gpustat = Path(sys.executable).parent / "gpustat"
    require(gpustat.exists(), f"needs gpustat next to {sys.executable} (pip install gpustat)")
    gpu = gpupool_server.get_json("/api/v1/gpus")["gpus"][0]
    proc = run_client([gpustat, "--no-color", "--json"], env=gpupool_server.client_env(),
                      timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout)
    assert got["driver_version"] == "580.00.00"
    (g,) = got["gpus"]
    assert g["index"] == 0 and g["name"] == gpu["name"] and g["uuid"] == gpu["uuid"]
    assert g["memory.total"] == gpu["memory_total"] >> 20  # MiB
    assert g["memory.used"] == 0 and g["utilization.gpu"] == 0
    proc = run_client([gpustat, "--no-color"], env=gpupool_server.client_env(), timeout=60)
    assert proc.returncode == 0 and "580.00.00" in proc.stdout.splitlines()[0], proc.stdout


# ------------------------------------------------------------------ a server that goes quiet
# A client that read its GPU once, then (after the test stopped the server and left a listener
# on its port that never answers) reads it again from several threads.
GOES_QUIET = """
    import json, sys, threading, time, pynvml as n

    def memory(h):
        start = time.monotonic()
        try:
            m = n.nvmlDeviceGetMemoryInfo(h)
            value = [m.total, m.used, m.free]
        except n.NVMLError as e:
            value = type(e).__name__
        return value, time.monotonic() - start

    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    first = memory(h)[0]
    print(json.dumps({"first": first}), flush=True)
    sys.stdin.readline()  # the server is gone now; its port takes connections and says nothing
    time.sleep(1.2)  # the values are due for a refresh
    t0 = time.monotonic()
    fetching = {}
    t = threading.Thread(target=lambda: fetching.update(r=memory(h)))
    t.start()  # this query finds the values due and asks the silent server
    time.sleep(0.3)
    during = [memory(h) for _ in range(20)]  # meanwhile: the cached values, at once
    name = n.nvmlDeviceGetName(h)
    t.join()
    after = [memory(h) for _ in range(20)]  # after the failure: no new try for a while
    total = time.monotonic() - t0
    n.nvmlShutdown()
    print(json.dumps({"first": first, "fetching": fetching["r"], "during": during,
                      "after": after, "total": total, "name": name}))
"""


@pytest.mark.san
def test_a_silent_server_does_not_stall_queries(gpupool_server: GpupoolServer) -> None:
    """Refreshes run without the lock, one at a time, and back off after a failure: with the
    server gone quiet, only the query that asks it waits (the fetch timeout, a finite 2 s even
    with probe_timeout = 0, "no limit"), and every other query answers from the cache."""
    env = gpupool_server.client_env({"GPUPOOL_PROBE_TIMEOUT": "0"})
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(GOES_QUIET)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    silent = socket.socket()
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the client did not read its GPU within 60 s"
        line = proc.stdout.readline()
        assert line, f"the client exited early ({proc.wait(10)})"
        first = json.loads(line)["first"]
        assert isinstance(first, list) and first[0] > 0, first
        assert gpupool_server.stop() == 0
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        silent.bind((gpupool_server.host, gpupool_server.port))
        silent.listen(16)  # the kernel completes the handshakes; nothing ever answers
        try:
            out, err = proc.communicate("go\n", timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("NVML queries hung on a server that stopped answering (60 s)",
                        pytrace=False)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        silent.close()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    got = json.loads(out.strip().splitlines()[-1])
    # The query that asked the silent server waited for the fetch timeout, then kept the values.
    value, took = got["fetching"]
    assert value == first
    assert 1.5 <= took < 4, took
    # Everything else answered from the cache, while that fetch hung and after it failed.
    for value, took in got["during"] + got["after"]:
        assert value == first
        assert took < 1, (took, got)  # a query waiting on the fetch would take ~1.7 s
    assert got["total"] < 5, got
    assert got["name"] and gpupool_lines(err) == [], err


# ------------------------------------------------------------ a lease on another server
FAKE_LIBCUDA = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
/* Stands in for our libcuda.so.1 holding a lease: the lease comes from the environment
 * (FAKE_LEASE = "server uuid name", unset: no lease). */
__attribute__((visibility("default"))) int gpupool_shim_lease(
        char *server, size_t server_cap, char *uuid, size_t uuid_cap, char *name,
        size_t name_cap, unsigned long long *session, int *simulated) {
    const char *lease = getenv("FAKE_LEASE");
    char s[300], u[100], n[100];
    if (!lease || sscanf(lease, "%299s %99s %99[^\n]", s, u, n) != 3)
        return 0;
    snprintf(server, server_cap, "%s", s);
    snprintf(uuid, uuid_cap, "%s", u);
    snprintf(name, name_cap, "%s", n);
    *session = 1;
    *simulated = 1;
    return 1;
}
"""

READ_LEASED = """
    import ctypes, json, pynvml as n
    ctypes.CDLL("libcuda.so.1")  # the fake, first on LD_LIBRARY_PATH

    def get(fn, *args):
        try:
            v = fn(*args)
        except n.NVMLError as e:
            return type(e).__name__
        return v.decode() if isinstance(v, bytes) else v

    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    m = get(n.nvmlDeviceGetMemoryInfo, h)
    print(json.dumps({"count": n.nvmlDeviceGetCount(), "name": get(n.nvmlDeviceGetName, h),
                      "uuid": get(n.nvmlDeviceGetUUID, h),
                      "memory": m if isinstance(m, str) else m.total,
                      "util": get(lambda: n.nvmlDeviceGetUtilizationRates(h).gpu),
                      "cuda": get(n.nvmlSystemGetCudaDriverVersion)}))
    n.nvmlShutdown()
"""


@pytest.mark.san
def test_a_lease_on_an_unconfigured_server_gets_no_credentials(
        gpupool_server: GpupoolServer, tmp_path: Path) -> None:
    """In lease mode the values come from the lease's server only when it is a configured one
    (host case-insensitive, a bare host meaning port 7070); the configured token and TLS files
    are never sent to any other address."""
    require(have("cc"), "needs a C compiler (cc) for the stand-in libcuda.so.1")
    src = tmp_path / "fake_libcuda.c"
    src.write_text(FAKE_LIBCUDA)
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    str(tmp_path / "libcuda.so.1"), str(src)], check=True)
    gpu = gpupool_server.get_json("/api/v1/gpus")["gpus"][0]

    def run(lease_server: str, extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
        env = gpupool_server.client_env(extra)
        env["LD_LIBRARY_PATH"] = f"{tmp_path}:{env['LD_LIBRARY_PATH']}"
        env["FAKE_LEASE"] = f"{lease_server} {gpu['uuid']} Leased GPU"
        return run_client([sys.executable, "-c", textwrap.dedent(READ_LEASED)], env=env)

    # A server nobody configured (its port takes connections): nothing is sent there; the GPU
    # shows what the lease says, without live values, and one debug line says why.
    trap = socket.socket()
    try:
        trap.bind(("127.0.0.1", 0))
        trap.listen(8)
        other = f"127.0.0.1:{trap.getsockname()[1]}"
        proc = run(other, {})
        got = last_json(proc)
        assert got == {"count": 1, "name": "Leased GPU", "uuid": gpu["uuid"],
                       "memory": "NVMLError_NotSupported", "util": "NVMLError_NotSupported",
                       "cuda": "NVMLError_NotSupported"}, got
        assert gpupool_lines(proc.stderr) == [], proc.stderr
        debug = run(other, {"GPUPOOL_LOG": "debug"})
        assert last_json(debug) == got
        why = [line for line in gpupool_lines(debug.stderr) if other in line]
        assert len(why) == 1 and "none of the configured servers" in why[0], debug.stderr
        trap.setblocking(False)
        with pytest.raises(BlockingIOError):
            trap.accept()  # no connection was ever made to it
    finally:
        trap.close()

    # The configured server, written in another case: its values, with its credentials.
    configured = {"GPUPOOL_SERVER": f"localhost:{gpupool_server.port}"}
    proc = run(f"LocalHost:{gpupool_server.port}", configured)
    got = last_json(proc)
    assert got["memory"] == gpu["memory_total"] and got["cuda"] == 13000, got
    assert got["name"] == gpu["name"] and isinstance(got["util"], int), got
    assert gpupool_lines(proc.stderr) == [], proc.stderr

    # A bare host is port 7070 on both sides: the lease "LOCALHOST" is the configured
    # localhost:7070, so the shim asks it (and says it got no values: nothing serves this GPU
    # there), where an unconfigured server would get no request and no warning.
    proc = run("LOCALHOST", {"GPUPOOL_SERVER": "localhost:7070"})
    assert last_json(proc)["name"] == "Leased GPU"
    lines = gpupool_lines(proc.stderr)
    assert len(lines) == 1 and "localhost:7070" in lines[0], proc.stderr
