"""Build step of the gpupool client: build the shim (build/client/libcuda.so.1) with the
repository's Makefile and ship it in gpupool/lib/ as libcuda.so.1 and libcuda.so (metadata is in
pyproject.toml).

An existing build/client/libcuda.so.1 is reused when make is not needed (make decides).
Set GPUPOOL_SKIP_NATIVE=1 to build a package without the shim; `gpupool run` then looks for it in
$GPUPOOL_SHIM_DIR or the repository's build/client (development). Editable installs skip this step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SHIM_TARGET = "build/client/libcuda.so.1"
SHIM_FRAGMENT = "client/shim/shim.mk"


class BuildPyWithShim(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("GPUPOOL_SKIP_NATIVE") == "1":
            return
        if not (REPO / "Makefile").is_file() or not (REPO / SHIM_FRAGMENT).is_file():
            raise SystemExit(
                f"gpupool build: the shim sources ({SHIM_FRAGMENT} and the top-level Makefile) "
                f"are not in {REPO}; build from a gpupool checkout (pip install ./client), or set "
                "GPUPOOL_SKIP_NATIVE=1 and point GPUPOOL_SHIM_DIR at a built shim")
        jobs = f"-j{min(os.cpu_count() or 1, 4)}"
        subprocess.run(["make", "-C", str(REPO), jobs, SHIM_TARGET], check=True)
        lib_dir = Path(self.build_lib) / "gpupool" / "lib"
        lib_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / SHIM_TARGET, lib_dir / "libcuda.so.1")
        # A copy, not a symlink (wheels hold none), for programs that link with -lcuda (Triton).
        shutil.copy2(REPO / SHIM_TARGET, lib_dir / "libcuda.so")


class NativeDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # the wheel carries native code: tag it per platform
        return True


setup(cmdclass={"build_py": BuildPyWithShim}, distclass=NativeDistribution,
      # setuptools' own build files stay out of the native build/ tree
      options={"build": {"build_base": "build/python"}})
