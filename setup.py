"""Build step of the gpupoold package: compile the worker, the scrub and the simulated device with
the top-level Makefile and ship them in gpupoold/bin/ (metadata is in pyproject.toml).

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
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# (make target, the component's makefile fragment, name in gpupoold/bin)
NATIVE = [
    ("build/gpupool-worker", "worker/worker.mk", "gpupool-worker"),
    ("build/gpupool-scrub", "worker/scrub/scrub.mk", "gpupool-scrub"),
    ("build/libgpupool-sim.so", "worker/sim/sim.mk", "libgpupool-sim.so"),
]


class BuildPyWithNative(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("GPUPOOL_SKIP_NATIVE") == "1":
            return
        wanted = [(t, name) for t, fragment, name in NATIVE if (ROOT / fragment).is_file()]
        for target, fragment, _ in NATIVE:
            if not (ROOT / fragment).is_file():
                print(f"gpupoold build: warning: {fragment} missing, {target} not shipped")
        if not wanted:
            return
        jobs = f"-j{min(os.cpu_count() or 1, 4)}"
        subprocess.run(["make", "-C", str(ROOT), jobs, *(t for t, _ in wanted)], check=True)
        bin_dir = Path(self.build_lib) / "gpupoold" / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        for target, name in wanted:
            shutil.copy2(ROOT / target, bin_dir / name)


class NativeDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # the wheel carries native code: tag it per platform
        return True


setup(cmdclass={"build_py": BuildPyWithNative}, distclass=NativeDistribution,
      # setuptools' own build files stay out of the native build/ tree
      options={"build": {"build_base": "build/python"}})
