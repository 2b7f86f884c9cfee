"""Build step of the gpupool client: build the shims ($BUILD/client/libcuda.so.1 and
$BUILD/client/libnvidia-ml.so.1) and the configuration reader of the `gpupool` command
($BUILD/client/libgpupool-config.so) with make and ship them in gpupool/lib/ as libcuda.so.1 +
libcuda.so, libnvidia-ml.so.1 + libnvidia-ml.so and libgpupool-config.so (metadata is in
pyproject.toml). Only make and
a C compiler are needed: no CUDA toolkit, no NVIDIA driver.

Where the C sources come from:
- in a checkout (pip install ./client), the repository's Makefile and sources;
- in an sdist, its native/ folder: `sdist` copies the top-level Makefile, the shims' makefile
  fragments, their C sources and headers and the generated protocol code into it (NATIVE_SOURCES),
  so an unpacked sdist builds on its own. native/ exists only in sdists, never in the checkout.

$BUILD is $GPUPOOL_BUILD_DIR when set (relative to the repository or to native/), else build/;
make rebuilds only what is out of date there, so a built tree makes the install quick.
Set GPUPOOL_SKIP_NATIVE=1 to build a package without the shims; `gpupool run` then looks for them
in $GPUPOOL_SHIM_DIR or the repository's build/client (development). Editable installs skip this
step.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NATIVE = HERE / "native"  # in an sdist only: the build recipe and sources (see NATIVE_SOURCES)
FRAGMENTS = ("client/shim/shim.mk", "client/nvml/nvml.mk", "client/config/config.mk")
# What make needs to build the two shims, as globs relative to the repository (or to native/): the
# top-level Makefile (it -includes the fragments that are there and skips the others), the
# fragments, the sources they compile and the headers these include. Each glob must match.
NATIVE_SOURCES = (
    "Makefile",
    "protocol/protocol.mk", "protocol/generated/*.c", "protocol/generated/*.h",
    "cudaapi/*.h",
    "common/common.mk", "common/*.c", "common/*.h",
    "client/common/client_common.mk", "client/common/*.c", "client/common/*.h",
    "client/shim/shim.mk", "client/shim/shim_tables.mk", "client/shim/*.c", "client/shim/*.h",
    "client/shim/generated/*.c", "client/shim/generated/*.h",
    "client/nvml/nvml.mk", "client/nvml/*.c", "client/nvml/*.h",
    "client/nvml/generated/*.c",
    "client/config/config.mk", "client/config/*.c",
    "client/gpupool/__init__.py",  # shim.mk reads the version the libraries report from it
)
NATIVE_EXCLUDE = ("client/nvml/test_*.c",)  # unit tests of the NVML shim, not part of it
# (file made by make under $BUILD/client, the names it gets in gpupool/lib/). Copies, not
# symbolic links (wheels hold none); the unversioned names are for programs linked with -lcuda
# (Triton) or -lnvidia-ml.
LIBS = (("libcuda.so.1", ("libcuda.so.1", "libcuda.so")),
        ("libnvidia-ml.so.1", ("libnvidia-ml.so.1", "libnvidia-ml.so")),
        ("libgpupool-config.so", ("libgpupool-config.so",)))


def _in_checkout() -> bool:
    """This client/ directory is the one of a gpupool checkout (not an unpacked sdist that happens
    to sit in a directory with a Makefile)."""
    return ((REPO / "client" / "setup.py").resolve() == Path(__file__).resolve()
            and all((REPO / f).is_file() for f in ("Makefile", *FRAGMENTS)))


def _source_root() -> Path | None:
    """Where make runs: native/ in an sdist, the repository in a checkout, None when neither."""
    if (NATIVE / "Makefile").is_file():
        return NATIVE
    return REPO if _in_checkout() else None


def _build_name() -> str:
    return os.environ.get("GPUPOOL_BUILD_DIR") or "build"


def _build_dir() -> Path:
    """make's output directory; setuptools' own build files go to its python/gpupool subfolder."""
    build = Path(_build_name())
    return build if build.is_absolute() else (_source_root() or HERE) / build


def native_files(root: Path) -> list[str]:
    """The files of NATIVE_SOURCES under root, relative to it; SystemExit when a glob matches
    nothing (the sdist would not build)."""
    found: list[str] = []
    for pattern in NATIVE_SOURCES:
        hits = [p.relative_to(root).as_posix() for p in sorted(root.glob(pattern)) if p.is_file()]
        hits = [h for h in hits if not any(fnmatch.fnmatch(h, x) for x in NATIVE_EXCLUDE)]
        if not hits:
            raise SystemExit(f"gpupool sdist: nothing in {root} matches {pattern}, which the shims' build "
                             "needs; run it from a complete gpupool checkout")
        found += [h for h in hits if h not in found]
    return found


class SdistWithNative(sdist):
    """Copy the shims' build recipe and C sources into the sdist's native/ folder."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        root = _source_root()
        if root is None:
            raise SystemExit(f"gpupool sdist: no C sources for the shims: {HERE} is neither in a gpupool "
                             "checkout nor an unpacked sdist with a native/ folder")
        dest = Path(base_dir) / "native"
        names = native_files(root)
        for name in names:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, dest / name)
        print(f"gpupool sdist: {len(names)} files of the shims' native build copied from {root} into native/")


class BuildPyWithShims(build_py):
    def run(self) -> None:
        # start from an empty build/lib: a module deleted from the sources (or a package built
        # there before) would otherwise ride along in the wheel
        if not getattr(self, "editable_mode", False):
            shutil.rmtree(self.build_lib, ignore_errors=True)
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("GPUPOOL_SKIP_NATIVE") == "1":
            return
        root = _source_root()
        if root is None:
            raise SystemExit(
                f"gpupool build: no C sources for the shims: {HERE} has no native/ folder (an sdist "
                f"has one) and is not the client/ folder of a gpupool checkout ({REPO}/Makefile and "
                f"{', '.join(FRAGMENTS)} not found). Build from a checkout (pip install ./client) or "
                "from the sdist, or set GPUPOOL_SKIP_NATIVE=1 and point GPUPOOL_SHIM_DIR at built shims")
        missing = [f for f in ("Makefile", *FRAGMENTS) if not (root / f).is_file()]
        if missing:
            raise SystemExit(f"gpupool build: {', '.join(missing)} missing from {root}: this source tree "
                             "is incomplete; rebuild the sdist from a gpupool checkout")
        if root == NATIVE:  # the libraries report the package's version: take it from the package
            shutil.copy2(HERE / "gpupool" / "__init__.py", NATIVE / "client" / "gpupool" / "__init__.py")
        if shutil.which("make") is None:
            raise SystemExit("gpupool build: `make` not found on PATH: building the shims needs make and a "
                             "C compiler (Debian/Ubuntu: apt install make gcc); or install the gpupool "
                             "wheel, which carries them built")
        build = _build_name()
        targets = [f"{build}/client/{name}" for name, _ in LIBS]  # as the Makefile names them
        jobs = f"-j{min(os.cpu_count() or 1, 4)}"
        print(f"gpupool build: building {', '.join(n for n, _ in LIBS)} with make in {root} (BUILD={build})",
              flush=True)
        proc = subprocess.run(["make", "-C", str(root), jobs, f"BUILD={build}", *targets])
        if proc.returncode != 0:
            raise SystemExit(f"gpupool build: make failed ({proc.returncode}) building "
                             f"{', '.join(targets)} in {root}; it needs make and a C compiler (gcc), see "
                             "its output above")
        lib_dir = Path(self.build_lib) / "gpupool" / "lib"
        lib_dir.mkdir(parents=True, exist_ok=True)
        for name, shipped in LIBS:
            for dest in shipped:
                shutil.copy2(_build_dir() / "client" / name, lib_dir / dest)


class PlatformWheel(bdist_wheel):
    """Tag py3-none-<platform>: the native files are programs and libraries loaded without the
    Python C API, so one wheel serves every Python 3 on this platform (not only the builder's)."""

    def get_tag(self) -> tuple[str, str, str]:
        return "py3", "none", super().get_tag()[2]


class NativeDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # the wheel carries native code: tag it per platform
        return True


setup(cmdclass={"bdist_wheel": PlatformWheel, "build_py": BuildPyWithShims, "sdist": SdistWithNative},
      distclass=NativeDistribution,
      # setuptools' own build files: <the make build dir>/python/gpupool, next to make's output
      # (not shared with the daemon's build/lib, whose files would land in this wheel)
      options={"build": {"build_base": str(_build_dir() / "python" / "gpupool")}})
