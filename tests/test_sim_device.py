"""The simulated device (worker/sim, libgpupool-sim.so).

Runs the C tests of tests/sim/ (built by the native build into <build>/tests/; marked `san`, so
scripts/test.sh also runs them against the AddressSanitizer + UBSan build), after compiling the
CUDA test kernels with nvcc into a cubin and fatbins for the image tests. Also checks, through
ctypes, that the library exports exactly the driver entry points the worker needs, that its error
names agree with the toolkit's cuda.h, and that every configuration key is documented. The memory
file tests run separate tenant processes (tests/sim/sim_memtool.c) one after the other, as
gpupoold runs tenants of a GPU.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest
from conftest import IN_CI, REPO, SAN, require

SIM_DIR = REPO / "worker" / "sim"
C_TESTS = [
    "test_sim_config",
    "test_sim_memory",
    "test_sim_stream",
    "test_sim_launch",
    "test_sim_elf",
    "test_sim_memfile",
    "test_sim_graph",
    "test_sim_checkpoint",
    "test_sim_export",
    "test_sim_tensormap",
    "test_sim_ipc",
]

EXPORTS = """
cuInit cuDriverGetVersion cuGetErrorName cuGetErrorString cuDeviceGetCount cuDeviceGet
cuDeviceGetName cuDeviceGetUuid cuDeviceGetUuid_v2 cuDeviceTotalMem_v2 cuDeviceGetAttribute
cuDeviceGetPCIBusId cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRelease_v2
cuDevicePrimaryCtxReset_v2 cuDevicePrimaryCtxGetState cuCtxCreate_v2 cuCtxDestroy_v2
cuDeviceCanAccessPeer cuDeviceGetP2PAttribute
cuCtxSetCurrent cuCtxGetCurrent cuCtxSynchronize cuCtxGetLimit cuCtxSetLimit
cuCtxGetStreamPriorityRange cuMemGetInfo_v2 cuMemAddressReserve cuMemAddressFree cuMemCreate
cuMemRelease cuMemMap cuMemUnmap cuMemSetAccess cuMemGetAllocationGranularity cuMemExportToShareableHandle
cuMemImportFromShareableHandle cuMemAlloc_v2
cuMemFree_v2 cuMemHostAlloc cuMemFreeHost cuMemcpyHtoD_v2 cuMemcpyDtoH_v2 cuMemcpyDtoD_v2
cuMemcpyHtoDAsync_v2 cuMemcpyDtoHAsync_v2 cuMemcpyDtoDAsync_v2 cuMemsetD8_v2 cuMemsetD16_v2
cuMemsetD32_v2 cuMemsetD8Async cuMemsetD16Async cuMemsetD32Async cuMemsetD2D8Async
cuMemsetD2D16Async cuMemsetD2D32Async cuStreamCreateWithPriority
cuStreamDestroy_v2 cuStreamSynchronize cuStreamQuery cuStreamWaitEvent cuEventCreate
cuEventDestroy_v2 cuEventRecord cuEventRecordWithFlags cuEventQuery cuEventSynchronize
cuEventElapsedTime_v2 cuIpcGetEventHandle cuIpcOpenEventHandle cuModuleLoadData cuModuleUnload
cuModuleGetFunction cuModuleGetGlobal_v2
cuLibraryLoadData cuLibraryUnload cuLibraryGetKernel cuLibraryGetGlobal cuKernelGetFunction
cuFuncGetParamInfo cuKernelGetParamInfo cuFuncGetAttribute cuFuncSetAttribute
cuKernelGetAttribute cuKernelSetAttribute cuFuncSetCacheConfig cuKernelSetCacheConfig
cuOccupancyMaxActiveBlocksPerMultiprocessor cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags
cuOccupancyAvailableDynamicSMemPerBlock cuOccupancyMaxPotentialClusterSize
cuOccupancyMaxActiveClusters cuLaunchKernel cuLaunchKernelEx gpupoolSimLastErrorDetail
gpupoolSimHostPointer gpupoolSimConfigKey gpupoolSimTurnWaitNs
cuStreamBeginCapture_v2 cuStreamEndCapture cuStreamIsCapturing cuGraphInstantiateWithFlags
cuGraphLaunch cuGraphUpload cuGraphExecDestroy cuGraphDestroy cuGraphGetNodes
cuCheckpointProcessGetState cuCheckpointProcessGetRestoreThreadId cuCheckpointProcessLock
cuCheckpointProcessCheckpoint cuCheckpointProcessRestore cuCheckpointProcessUnlock
cuGetExportTable
cuTensorMapEncodeTiled cuTensorMapEncodeIm2col cuTensorMapEncodeIm2colWide cuTensorMapReplaceAddress
""".split()


def _nvcc():
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def _cuda_h():
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base and (pathlib.Path(base) / "include" / "cuda.h").is_file():
            return pathlib.Path(base) / "include" / "cuda.h"
    return None


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    """Environment naming the nvcc-built test images, or None when there is no nvcc."""
    nvcc = _nvcc()
    if nvcc is None:
        if IN_CI:
            pytest.fail("nvcc is required in CI (CI=true) to build the simulated device's test images")
        return None
    out = tmp_path_factory.mktemp("sim_images")
    src = REPO / "tests" / "sim" / "gp_test_kernels.cu"
    gencode = "arch=compute_90,code=[sm_90,compute_90]"
    builds = {
        "GP_SIM_TEST_CUBIN": ["-cubin", "-arch=sm_90"],
        "GP_SIM_TEST_FATBIN": ["-fatbin", f"-gencode={gencode}"],
        "GP_SIM_TEST_FATBIN_COMPRESSED": ["-fatbin", f"-gencode={gencode}", "-Xfatbin", "-compress-all"],
    }
    env = {}
    for var, flags in builds.items():
        path = out / (var.lower() + ".bin")
        proc = subprocess.run([nvcc, *flags, "-o", str(path), str(src)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"nvcc failed for {var}:\n{proc.stderr}"
        env[var] = str(path)
    return env


@pytest.mark.san
@pytest.mark.parametrize("binary", C_TESTS)
def test_c_suite(native_build, images, binary):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUPOOL_SIM_", "GP_SIM_TEST_"))}
    env.update(images or {})
    proc = subprocess.run([str(native_build / "tests" / binary)], capture_output=True, text=True, env=env, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{binary} ({native_build.name}) failed:\n{output[-8000:]}"
    skipped = re.findall(r"^SKIP (\S+)", proc.stdout, re.M)
    if images is None:
        require(not skipped, f"the other tests passed; {', '.join(skipped)} need nvcc-built images: nvcc not found")
    assert not skipped, f"unexpectedly skipped: {skipped}\n{output[-4000:]}"


@pytest.fixture(scope="session")
def lib(native_build):
    if SAN:
        pytest.skip("an ASan-instrumented library cannot be loaded into an uninstrumented Python")
    return ctypes.CDLL(str(native_build / "libgpupool-sim.so"))


def test_exports_exactly_the_driver_api(native_build):
    proc = subprocess.run(
        ["nm", "-D", "--defined-only", str(native_build / "libgpupool-sim.so")],
        capture_output=True,
        text=True,
        check=True,
    )
    exported = {line.split()[-1] for line in proc.stdout.splitlines() if line.strip()}
    assert exported == set(EXPORTS)


def test_error_names_match_cuda_h(lib):
    cuda_h = _cuda_h()
    if cuda_h is None:
        pytest.skip("no CUDA toolkit cuda.h to compare against")
    codes = re.findall(r"^\s*(CUDA_(?:SUCCESS|ERROR_\w+))\s*=\s*(\d+)", cuda_h.read_text(), re.M)
    assert len(codes) > 90
    get_name = lib.cuGetErrorName
    get_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    get_string = lib.cuGetErrorString
    get_string.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    for name, value in codes:
        out = ctypes.c_char_p()
        assert get_name(int(value), ctypes.byref(out)) == 0, name
        assert out.value.decode() == name
        assert get_string(int(value), ctypes.byref(out)) == 0, name
        assert out.value


def test_attribute_count_matches_cuda_h():
    cuda_h = _cuda_h()
    if cuda_h is None:
        pytest.skip("no CUDA toolkit cuda.h to compare against")
    ids = [int(v) for v in re.findall(r"^\s*CU_DEVICE_ATTRIBUTE_\w+\s*=\s*(\d+)", cuda_h.read_text(), re.M)]
    header = (REPO / "cudaapi" / "gp_cuda.h").read_text()
    ours = int(re.search(r"CU_DEVICE_ATTRIBUTE_MAX\s*=\s*(\d+)", header).group(1))
    # test_sim_config checks that every id below CU_DEVICE_ATTRIBUTE_MAX has a value.
    assert max(ids) == ours - 1


def sim_key_table(lib) -> str:
    """worker/sim/README.md's key table, from the reader's own table (gpupoolSimConfigKey)."""
    get = lib.gpupoolSimConfigKey
    get.restype = ctypes.c_char_p
    get.argtypes = [ctypes.c_int, ctypes.c_int]
    lines = ["| key | default | meaning |", "|---|---|---|"]
    i = 0
    while (name := get(i, 0)) is not None:
        lines.append(f"| `{name.decode()}` | {get(i, 1).decode()} | {get(i, 2).decode()} |")
        i += 1
    return "\n".join(lines) + "\n"


def test_the_readme_has_the_key_table(lib):
    table = sim_key_table(lib)
    assert "| `attr.<N>` |" in table and "| `total_memory` |" in table
    assert table in (SIM_DIR / "README.md").read_text(), (
        f"worker/sim/README.md's key table differs from sim_config.c's; it should read:\n{table}")


# ------------------------------------------------------------------------------ memory file
MIB = 1 << 20
SIZES = [3 * MIB + 5, 100_000, 16 * MIB]


def memtool(build: pathlib.Path, env: dict[str, str], *args: object) -> dict | None:
    """Run one tenant process; the parsed JSON line of `check`, else None."""
    proc = subprocess.run([str(build / "tests" / "sim_memtool"), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"sim_memtool {args} failed:\n{proc.stdout}{proc.stderr}"
    return json.loads(proc.stdout) if proc.stdout.strip() else None


def sim_env(memory_file: pathlib.Path | None, total: str = "256MiB") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_SIM_")}
    env["GPUPOOL_SIM_TOTAL_MEMORY"] = total
    if memory_file is not None:
        env["GPUPOOL_SIM_MEMORY_FILE"] = str(memory_file)
    return env


def allocated_bytes(path: pathlib.Path) -> int:
    """Bytes of disk the file holds (after fsync: delayed allocation has placed what was written)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_blocks * 512
    finally:
        os.close(fd)


@pytest.mark.san
@pytest.mark.parametrize("vmm", [False, True], ids=["cuMemAlloc", "cuMemCreate"])
def test_memory_file_outlives_the_process(native_build, tmp_path, vmm):
    mem = tmp_path / "gpu0.mem"
    env = sim_env(mem)
    flags = ["--vmm"] if vmm else []
    memtool(native_build, env, *flags, "fill", 7, *SIZES)
    assert mem.stat().st_size == 256 * MIB
    assert mem.stat().st_mode & 0o777 == 0o600
    found = memtool(native_build, env, *flags, "check", 7, *SIZES)
    assert [a["pattern"] for a in found["allocations"]] == SIZES


@pytest.mark.san
def test_without_memory_file_nothing_outlives_the_process(native_build):
    env = sim_env(None)
    memtool(native_build, env, "fill", 7, *SIZES)
    found = memtool(native_build, env, "check", 7, *SIZES)
    assert [a["zero"] for a in found["allocations"]] == SIZES


@pytest.mark.san
def test_zeroing_punches_holes_in_the_memory_file(native_build, tmp_path):
    mem = tmp_path / "gpu0.mem"
    env = sim_env(mem)
    memtool(native_build, env, "fill", 3, *SIZES)
    before = allocated_bytes(mem)
    assert before >= sum(SIZES)
    memtool(native_build, env, "zero", *SIZES)
    after = allocated_bytes(mem)
    # Whole pages are holes now; only partial pages at allocation ends may still hold blocks.
    assert after <= before - sum(SIZES) + 4 * 4096 * len(SIZES)
    found = memtool(native_build, env, "check", 3, *SIZES)
    assert [a["zero"] for a in found["allocations"]] == SIZES
