"""Build step of the gpupool client: build the shims ($BUILD/client/libcuda.so.1 and
$BUILD/client/libnvidia-ml.so.1) with the repository's Makefile and ship them in gpupool/lib/ as
libcuda.so.1 + libcuda.so and libnvidia-ml.so.1 + libnvidia-ml.so (metadata is in
pyproject.toml). Only make and a C compiler are needed: no CUDA toolkit, no NVIDIA driver.

$BUILD is $GPUPOOL_BUILD_DIR when set (relative to the repository, as for the tests), else build/;
make rebuilds only what is out of date there, so a built tree makes the install quick.
Set GPUPOOL_SKIP_NATIVE=1 to build a package without the shims; `gpupool run` then looks for them
in $GPUPOOL_SHIM_DIR or the repository's build/client (development). Editable installs skip this
step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FRAGMENTS = ("client/shim/shim.mk", "client/nvml/nvml.mk")
# (file made by make under $BUILD/client, the names it gets in gpupool/lib/). Copies, not
# symbolic links (wheels hold none); the unversioned names are for programs linked with -lcuda
# (Triton) or -lnvidia-ml.
LIBS = (("libcuda.so.1", ("libcuda.so.1", "libcuda.so")),
        ("libnvidia-ml.so.1", ("libnvidia-ml.so.1", "libnvidia-ml.so")))


def _build_dir() -> Path:
    """$GPUPOOL_BUILD_DIR (relative to the repository) or build/: make's output; setuptools' own
    build files go to its python/ subfolder."""
    if not (REPO / "Makefile").is_file():  # not in a checkout (an unpacked sdist): stay here
        return HERE / "build"
    build = Path(os.environ.get("GPUPOOL_BUILD_DIR") or "build")
    return build if build.is_absolute() else REPO / build


class BuildPyWithShims(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("GPUPOOL_SKIP_NATIVE") == "1":
            return
        missing = [f for f in ("Makefile", *FRAGMENTS) if not (REPO / f).is_file()]
        if missing:
            raise SystemExit(
                f"gpupool build: {', '.join(missing)} not found in {REPO}: the shims are built "
                "from a gpupool checkout (pip install ./client); or set GPUPOOL_SKIP_NATIVE=1 "
                "and point GPUPOOL_SHIM_DIR at built shims")
        build = os.environ.get("GPUPOOL_BUILD_DIR") or "build"
        build_dir = _build_dir()
        targets = [f"{build}/client/{name}" for name, _ in LIBS]  # as the Makefile names them
        jobs = f"-j{min(os.cpu_count() or 1, 4)}"
        proc = subprocess.run(["make", "-C", str(REPO), jobs, f"BUILD={build}", *targets])
        if proc.returncode != 0:
            raise SystemExit(f"gpupool build: make failed ({proc.returncode}) building "
                             f"{', '.join(targets)}; it needs make and a C compiler (gcc), see "
                             "its output above")
        lib_dir = Path(self.build_lib) / "gpupool" / "lib"
        lib_dir.mkdir(parents=True, exist_ok=True)
        for name, shipped in LIBS:
            for dest in shipped:
                shutil.copy2(build_dir / "client" / name, lib_dir / dest)


class PlatformWheel(bdist_wheel):
    """Tag py3-none-<platform>: the native files are programs and libraries loaded without the
    Python C API, so one wheel serves every Python 3 on this platform (not only the builder's)."""

    def get_tag(self) -> tuple[str, str, str]:
        return "py3", "none", super().get_tag()[2]


class NativeDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # the wheel carries native code: tag it per platform
        return True


setup(cmdclass={"bdist_wheel": PlatformWheel, "build_py": BuildPyWithShims}, distclass=NativeDistribution,
      # setuptools' own build files: <the make build dir>/python, next to make's output
      options={"build": {"build_base": str(_build_dir() / "python")}})
