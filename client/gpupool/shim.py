"""Where our libcuda.so.1 (the shim), libnvidia-ml.so.1 (the NVML shim) and libgpupool-config.so
(the configuration reader, gpupool.config) are, and the environment that makes programs load the
shims."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SHIM_NAME = "libcuda.so.1"
NVML_NAME = "libnvidia-ml.so.1"  # the NVML shim, next to it
CONFIG_LIB_NAME = "libgpupool-config.so"  # the configuration reader for `gpupool`, next to it
PACKAGE_LIB = Path(__file__).resolve().parent / "lib"
REPO_ROOT = Path(__file__).resolve().parent.parent.parent


class ShimNotFound(Exception):
    pass


def candidates(env: Mapping[str, str]) -> list[Path]:
    """Where the shim is looked for, in order: $GPUPOOL_SHIM_DIR, the package's lib/, and the
    repository's build/client (a development checkout)."""
    found = []
    if env.get("GPUPOOL_SHIM_DIR"):
        # absolute: a relative folder on LD_LIBRARY_PATH would follow each program's cwd
        found.append(Path(os.path.abspath(env["GPUPOOL_SHIM_DIR"])))
    found.append(PACKAGE_LIB)
    if (REPO_ROOT / "Makefile").is_file():
        found.append(REPO_ROOT / "build" / "client")
    return found


def shim_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    places = candidates(env)
    if env.get("GPUPOOL_SHIM_DIR"):  # an explicit choice is used or reported, never skipped
        places = places[:1]
    for place in places:
        if (place / SHIM_NAME).is_file():
            return place
    looked = ", ".join(str(p) for p in places)
    raise ShimNotFound(f"{SHIM_NAME} not found (looked in {looked}); reinstall the gpupool "
                       "package or set GPUPOOL_SHIM_DIR")


def config_library(env: Mapping[str, str] | None = None) -> Path:
    """libgpupool-config.so: the first of the candidates that has it. Unlike the shims, a
    GPUPOOL_SHIM_DIR without it is passed over: the command reads its configuration even while
    the shims it points at are missing (what `gpupool doctor` reports)."""
    places = candidates(os.environ if env is None else env)
    for place in places:
        if (place / CONFIG_LIB_NAME).is_file():
            return place / CONFIG_LIB_NAME
    looked = ", ".join(str(p) for p in places)
    raise ShimNotFound(f"{CONFIG_LIB_NAME} not found (looked in {looked}); reinstall the "
                       "gpupool package or set GPUPOOL_SHIM_DIR to a folder with gpupool's "
                       "libraries")


def client_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the shim's directory first on LD_LIBRARY_PATH."""
    out = dict(os.environ if env is None else env)
    lib = str(shim_dir(out))
    rest = [p for p in out.get("LD_LIBRARY_PATH", "").split(":") if p and p != lib]
    out["LD_LIBRARY_PATH"] = ":".join([lib, *rest])
    return out
