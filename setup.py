"""Build step of the gpupoold package: compile the worker, the scrub and the simulated device with
the top-level Makefile and ship them in gpupoold/bin/ (metadata is in pyproject.toml). The sdist
carries the Makefile and the C sources it needs (MANIFEST.in), so an unpacked sdist builds alone.

make builds in $GPUPOOL_BUILD_DIR when set (relative to the repository, as for the tests), else in
build/; setuptools' own build files go to <that dir>/python/gpupoold.
Set GPUPOOL_SKIP_NATIVE=1 to build a package without them (the daemon then needs the `worker`
and `sim_lib` settings). Editable installs skip this step: a development checkout finds the
binaries in build/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
BUILD = os.environ.get("GPUPOOL_BUILD_DIR") or "build"
BUILD_DIR = Path(BUILD) if Path(BUILD).is_absolute() else ROOT / BUILD
# (file made by make under $BUILD, the component's makefile fragment, name in gpupoold/bin)
NATIVE = [
    ("gpupool-worker", "worker/worker.mk", "gpupool-worker"),
    ("gpupool-scrub", "worker/scrub/scrub.mk", "gpupool-scrub"),
    ("gpupool-checkpoint", "worker/checkpoint/checkpoint.mk", "gpupool-checkpoint"),
    ("libgpupool-sim.so", "worker/sim/sim.mk", "libgpupool-sim.so"),
]


class BuildPyWithNative(build_py):
    def run(self) -> None:
        # start from an empty build/lib: a module deleted from the sources (or a package built
        # there before) would otherwise ride along in the wheel
        if not getattr(self, "editable_mode", False):
            shutil.rmtree(self.build_lib, ignore_errors=True)
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("GPUPOOL_SKIP_NATIVE") == "1":
            return
        wanted = [(t, name) for t, fragment, name in NATIVE if (ROOT / fragment).is_file()]
        for target, fragment, _ in NATIVE:
            if not (ROOT / fragment).is_file():
                print(f"gpupoold build: warning: {fragment} missing, {target} not shipped")
        if not wanted:
            return
        if shutil.which("make") is None:
            raise SystemExit("gpupoold build: `make` not found on PATH: building the worker needs make, a C "
                             "compiler and OpenSSL's headers (Debian/Ubuntu: apt install make gcc libssl-dev); "
                             "or install the gpupoold wheel, which carries them built")
        jobs = f"-j{min(os.cpu_count() or 1, 4)}"
        targets = [f"{BUILD}/{t}" for t, _ in wanted]  # as the Makefile names them
        print(f"gpupoold build: building {', '.join(t for t, _ in wanted)} with make in {ROOT} (BUILD={BUILD})",
              flush=True)
        proc = subprocess.run(["make", "-C", str(ROOT), jobs, f"BUILD={BUILD}", *targets])
        if proc.returncode != 0:
            raise SystemExit(f"gpupoold build: make failed ({proc.returncode}) building "
                             f"{', '.join(targets)}; it needs make, a C compiler (gcc) and OpenSSL's headers "
                             "(libssl-dev), see its output above (or set GPUPOOL_SKIP_NATIVE=1 for a package "
                             "without them)")
        bin_dir = Path(self.build_lib) / "gpupoold" / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        for target, name in wanted:
            shutil.copy2(BUILD_DIR / target, bin_dir / name)


class PlatformWheel(bdist_wheel):
    """Tag py3-none-<platform>: the native files are programs and libraries loaded without the
    Python C API, so one wheel serves every Python 3 on this platform (not only the builder's)."""

    def get_tag(self) -> tuple[str, str, str]:
        return "py3", "none", super().get_tag()[2]


class NativeDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # the wheel carries native code: tag it per platform
        return True


setup(cmdclass={"bdist_wheel": PlatformWheel, "build_py": BuildPyWithNative}, distclass=NativeDistribution,
      # setuptools' own build files: <the make build dir>/python/gpupoold, next to make's output
      # (not shared with the client's build/lib, whose files would land in this wheel)
      options={"build": {"build_base": str(BUILD_DIR / "python" / "gpupoold")}})
