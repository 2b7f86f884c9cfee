"""The environment of every process gpupoold starts to drive a GPU: the workers
(workers/supervisor.py), the scrub (gpu/scrub.py) and the checkpoint tool (gpu/checkpoint.py).
They all load the GPU's driver library, so they all need the same view of it; the function lives
here, beside the GPU inventory, so that those three reach it without importing each other.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from gpupoold.gpu.inventory import Gpu

# The workers' logger: the warning below is about what the workers are given.
log = logging.getLogger("gpupoold.workers")

_SHIM_MARK = b"GPUPOOL_SERVER is not set"  # a message only the client shim carries
_SHIM_MAX_SIZE = 16 << 20


# What of gpupoold's environment a process on the GPU gets (docs/security.md, "The worker"): a
# worker parses tenants' frames, so it must not hold the daemon's secrets (PGPASSWORD, which the
# docs offer for PostgreSQL, GPUPOOL_TOKEN, database URLs, cloud credentials). An allowlist, not
# a denylist: a secret nobody thought of stays out too.
ALLOWED_NAMES = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ",  # the loader, messages, time stamps
    "LD_LIBRARY_PATH",  # where the driver's libraries are (without the client shim, below)
    "GPUPOOL_LZ4_LIBRARY",  # common/compress.c: which liblz4 the worker loads
    "GPUPOOL_BENCH_COUNT_MODE",  # worker/sim: the benchmarks' count-only mode
    "ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS",  # the sanitizer build (make SAN=1)
})
ALLOWED_PREFIXES = (
    "LC_",  # locale
    "CUDA_",  # the CUDA driver's own settings (CUDA_CACHE_PATH, CUDA_MODULE_LOADING, ...)
    "NVIDIA_",  # the NVIDIA driver's (container toolkits set NVIDIA_VISIBLE_DEVICES, ...)
    "GPUPOOL_SIM_",  # the simulated device's keys (worker/sim/sim_config.c)
    "GPUPOOL_WORKER_",  # settings the worker reads (worker/driver.c) and test hooks
)


def allowed_variable(name: str) -> bool:
    """Whether gpupoold passes the environment variable `name` to the processes on a GPU."""
    return name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)


def driver_environment(gpu: Gpu) -> dict[str, str]:
    """The allowed part of the daemon's environment (ALLOWED_NAMES, ALLOWED_PREFIXES), the
    GPU's, CUDA ordinals in NVML (PCI bus) order, and no LD_PRELOAD (what is preloaded into the
    daemon has no business in a process on the GPU)."""
    env = {k: v for k, v in os.environ.items() if allowed_variable(k)}
    env.update(gpu.env)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env.pop("LD_PRELOAD", None)
    if env.get("LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = without_shim_dirs(env["LD_LIBRARY_PATH"])
    return env


def with_jit_cache(env: dict[str, str], cache_dir: Path, size_mib: int) -> dict[str, str]:
    """`env` with the CUDA driver's PTX JIT cache on, in `<cache_dir>/jit` and at most `size_mib`
    MiB (setting `jit_cache_mib`), or off with 0. Without it the driver's default cache is
    `~/.nv/ComputeCache`, and a worker has no HOME: every PTX module (cuDNN's runtime-compiled
    kernels, Triton's, NVRTC's) would be compiled again at each load. One folder for all the
    workers of this server, so that a module compiled in one lease is there for the next. An
    operator's own CUDA_CACHE_* in gpupoold's environment wins. The folder is beneath
    `cache_dir`, which the worker's sandbox lets it write (worker/sandbox.c)."""
    env = dict(env)
    if "CUDA_CACHE_PATH" in env or "CUDA_CACHE_DISABLE" in env:
        return env
    if size_mib <= 0:
        env["CUDA_CACHE_DISABLE"] = "1"
        return env
    env["CUDA_CACHE_PATH"] = str(cache_dir / "jit")
    env.setdefault("CUDA_CACHE_MAXSIZE", str(size_mib << 20))
    return env


@functools.lru_cache(maxsize=8)
def without_shim_dirs(search_path: str) -> str:
    """LD_LIBRARY_PATH without the folders that hold gpupool's client shim as libcuda.so.1: a
    daemon started from a shell set up for gpupool clients (`gpupool env`) would otherwise give
    its workers the shim instead of the NVIDIA driver. Cached: the files are read once."""
    kept = []
    for folder in search_path.split(":"):
        lib = Path(folder or ".") / "libcuda.so.1"
        try:
            # The shim is about 1 MiB; a real driver is tens of MiB and never read whole here.
            is_shim = lib.stat().st_size < _SHIM_MAX_SIZE and _SHIM_MARK in lib.read_bytes()
        except OSError:
            is_shim = False
        if is_shim:
            log.warning("LD_LIBRARY_PATH folder %s holds the gpupool client shim as libcuda.so.1: "
                        "left out of the workers' LD_LIBRARY_PATH (they need the NVIDIA driver)",
                        folder)
        else:
            kept.append(folder)
    return ":".join(kept)
