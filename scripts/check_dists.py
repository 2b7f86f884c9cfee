"""Check the wheels and sdists that scripts/build-dists.sh made: names, versions, requires-python,
runtime dependencies, entry points, platform tags, the native files each wheel must carry, and
that each sdist holds what it needs to build on its own (its makefile fragments and C sources).

Usage: check_dists.py DIST_DIR   (exit status 1 and one line per problem when something is wrong)
Also imported by tests/test_wheels.py.
"""

from __future__ import annotations

import configparser
import re
import sys
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from email.message import Message
from email.parser import HeaderParser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Expected:
    """What one distribution must be."""

    scripts: dict[str, str]  # console_scripts entry points, exactly
    requires: frozenset[str]  # runtime requirement names (no extras), exactly
    requires_python: str  # Requires-Python, exactly
    version_file: Path  # the checkout file whose __version__ the distributions carry
    wheel_files: tuple[str, ...]  # files the wheel must hold ("dir/" = something under dir)
    top_level: frozenset[str]  # the only top-level names the wheel may hold (besides .dist-info)
    # files the sdist must hold, relative to its top folder: the build recipe and its inputs
    sdist_files: tuple[str, ...]
    # (glob in the checkout, prefix to drop, prefix to add): every checkout file the glob matches
    # (but SDIST_GLOB_EXCLUDE) must be in the sdist under that name; the C sources the makefile
    # fragments compile by wildcard, the Python packages
    sdist_globs: tuple[tuple[str, str, str], ...]
    native: bool = True  # the wheel carries native code: tagged for this platform, else py3-none-any


COMMON_SDIST = ("PKG-INFO", "pyproject.toml", "setup.py")
# The top-level Makefile, the protocol fragment and generated code, the CUDA header: both native
# builds start from these (relative to the repository; the client's sdist has them under native/).
BUILD_BASE = ("Makefile", "protocol/protocol.mk", "protocol/generated/gp_protocol.c",
              "protocol/generated/gp_protocol.h", "cudaapi/gp_cuda.h")

EXPECTED: dict[str, Expected] = {
    "gpupoold": Expected(
        scripts={"gpupoold": "gpupoold.cli:main", "gpupool-reset-helper": "gpupoold.gpu.reset_helper:main"},
        requires=frozenset({"gpupool-protocol", "aiohttp", "nvidia-ml-py", "prometheus-client", "jinja2",
                           "cryptography"}),
        requires_python=">=3.11",
        version_file=ROOT / "gpupoold" / "__init__.py",
        wheel_files=("gpupoold/bin/gpupool-worker", "gpupoold/bin/gpupool-scrub",
                     "gpupoold/bin/gpupool-checkpoint", "gpupoold/bin/libgpupool-sim.so",
                     "gpupoold/__init__.py", "gpupoold/dashboard/templates/", "gpupoold/dashboard/static/"),
        top_level=frozenset({"gpupoold"}),
        sdist_files=(*COMMON_SDIST, "README.md", *BUILD_BASE, "worker/worker.mk", "worker/sim/sim.mk",
                     "worker/scrub/scrub.mk", "worker/checkpoint/checkpoint.mk",
                     "common/common.mk", "common/sha256.c", "common/sha256.h",
                     "common/compress.c", "common/compress.h", "gpupoold/__init__.py",
                     "gpupoold.egg-info/entry_points.txt",
                     "gpupoold/dashboard/templates/base.html",
                     "gpupoold/dashboard/static/dashboard.js"),
        sdist_globs=(("worker/*.[ch]", "", ""), ("worker/sim/*.[ch]", "", ""), ("worker/scrub/*.[ch]", "", ""),
                     ("gpupoold/*.py", "", ""), ("gpupoold/*/*.py", "", ""),
                     ("gpupoold/dashboard/templates/*.html", "", ""), ("gpupoold/dashboard/static/*", "", "")),
    ),
    "gpupool": Expected(
        scripts={"gpupool": "gpupool.cli:main"},
        requires=frozenset({"gpupool-protocol"}),
        requires_python=">=3.9",
        version_file=ROOT / "client" / "gpupool" / "__init__.py",
        wheel_files=("gpupool/lib/libcuda.so.1", "gpupool/lib/libcuda.so", "gpupool/lib/libnvidia-ml.so.1",
                     "gpupool/lib/libnvidia-ml.so", "gpupool/lib/libgpupool-config.so",
                     "gpupool/__init__.py", "gpupool/wire/__init__.py"),
        top_level=frozenset({"gpupool"}),
        sdist_files=(*COMMON_SDIST, "README.md", "gpupool/__init__.py", "gpupool.egg-info/entry_points.txt",
                     *(f"native/{f}" for f in BUILD_BASE), "native/client/shim/shim.mk",
                     "native/common/common.mk", "native/client/common/client_common.mk",
                     "native/client/shim/shim_tables.mk", "native/client/nvml/nvml.mk",
                     "native/client/config/config.mk", "native/client/gpupool/__init__.py"),
        sdist_globs=(("client/shim/*.[ch]", "", "native/"), ("client/shim/generated/*.[ch]", "", "native/"),
                     ("common/*.[ch]", "", "native/"), ("client/common/*.[ch]", "", "native/"),
                     ("client/nvml/*.[ch]", "", "native/"), ("client/nvml/generated/*.c", "", "native/"),
                     ("client/config/*.c", "", "native/"), ("client/gpupool/*.py", "client/", ""),
                     ("client/gpupool/wire/*.py", "client/", "")),
    ),
    # The Python protocol module both depend on: pure Python, one wheel for every platform.
    "gpupool-protocol": Expected(
        scripts={},
        requires=frozenset(),
        requires_python=">=3.9",
        version_file=ROOT / "protocol" / "python" / "gpupool_protocol" / "__init__.py",
        wheel_files=("gpupool_protocol/__init__.py", "gpupool_protocol/_generated.py",
                     "gpupool_protocol/runtime.py", "gpupool_protocol/framing.py"),
        top_level=frozenset({"gpupool_protocol"}),
        sdist_files=("PKG-INFO", "pyproject.toml", "README.md"),
        sdist_globs=(("protocol/python/gpupool_protocol/*.py", "protocol/python/", ""),),
        native=False,
    ),
}
# Unit-test sources next to the code (client/nvml/test_*.c): not part of the build.
SDIST_GLOB_EXCLUDE = re.compile(r"(^|/)test_[^/]*\.c$")
# Never in an sdist: build output and the tests (they need a checkout).
SDIST_FORBIDDEN = re.compile(r"(^|/)(build|build-[^/]*|tests|__pycache__)/|\.(o|so|pyc)$|\.so\.")
# The native code is built for this machine: the wheel's platform tag must say so.
PLATFORM = sysconfig.get_platform().replace("-", "_").replace(".", "_")


def file_stem(dist: str) -> str:
    """How a distribution's name starts its file names (wheels and sdists: "-" becomes "_")."""
    return dist.replace("-", "_")


def source_version(dist: str) -> str:
    path = EXPECTED[dist].version_file
    found = re.search(r'^__version__\s*=\s*"([^"]+)"', path.read_text(), re.M)
    if not found:
        raise SystemExit(f"check_dists: no __version__ in {path}")
    return found.group(1)


def parse_scripts(text: str) -> dict[str, str]:
    cp = configparser.ConfigParser()
    cp.read_string(text)
    return dict(cp["console_scripts"]) if cp.has_section("console_scripts") else {}


def wheel_metadata(wheel: Path) -> tuple[Message, dict[str, str], list[str], str]:
    """(METADATA, console_scripts, file names, WHEEL Tag) of a wheel."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
        meta = HeaderParser().parsestr(zf.read(f"{info}/METADATA").decode())
        wheel_info = HeaderParser().parsestr(zf.read(f"{info}/WHEEL").decode())
        scripts: dict[str, str] = {}
        if f"{info}/entry_points.txt" in names:
            scripts = parse_scripts(zf.read(f"{info}/entry_points.txt").decode())
    return meta, scripts, names, wheel_info.get("Tag", "")


def check_metadata(dist: str, label: str, meta: Message, scripts: dict[str, str]) -> list[str]:
    """Name, version, Requires-Python, runtime requirements and entry points of a wheel's METADATA
    or an sdist's PKG-INFO."""
    want = EXPECTED[dist]
    errors: list[str] = []
    if meta["Name"] != dist:
        errors.append(f"{label}: Name is {meta['Name']!r}, expected {dist!r}")
    if meta["Version"] != source_version(dist):
        errors.append(f"{label}: Version {meta['Version']} differs from the source's {source_version(dist)}")
    if meta["Requires-Python"] != want.requires_python:
        errors.append(f"{label}: Requires-Python {meta['Requires-Python']!r}, expected {want.requires_python!r}")
    runtime = [r for r in meta.get_all("Requires-Dist") or [] if not re.search(r";.*\bextra\s*==", r)]
    requires = {re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0].lower() for r in runtime}
    if requires != want.requires:
        errors.append(f"{label}: runtime requirements {sorted(requires)}, expected {sorted(want.requires)}")
    if meta.get("Description-Content-Type") != "text/markdown" or len(meta.get_payload() or "") < 200:
        errors.append(f"{label}: no long description (pyproject.toml's readme = \"README.md\" is what PyPI shows)")
    if scripts != want.scripts:
        errors.append(f"{label}: console_scripts {scripts}, expected {want.scripts}")
    return errors


def check_wheel(dist: str, wheel: Path) -> list[str]:
    want = EXPECTED[dist]
    meta, scripts, names, tag = wheel_metadata(wheel)
    errors = check_metadata(dist, wheel.name, meta, scripts)
    if want.native and (not tag.endswith(f"-{PLATFORM}") or PLATFORM not in wheel.name):
        errors.append(f"{wheel.name}: platform tag {tag!r}, expected one ending in {PLATFORM} (native code)")
    if not want.native and tag != "py3-none-any":
        errors.append(f"{wheel.name}: tag {tag!r}, expected py3-none-any (pure Python)")
    for w in want.wheel_files:
        hits = [n for n in names if n.startswith(w)] if w.endswith("/") else [n for n in names if n == w]
        if not hits:
            errors.append(f"{wheel.name}: {w} missing from the wheel")
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    if top - want.top_level:
        errors.append(f"{wheel.name}: unexpected top-level {sorted(top - want.top_level)} (a stale build/lib "
                      f"shared with another package?); expected only {sorted(want.top_level)}")
    return errors


def sdist_required(dist: str) -> list[str]:
    """The files the sdist of `dist` must hold (relative to its top folder)."""
    want = EXPECTED[dist]
    required = list(want.sdist_files)
    for pattern, drop, add in want.sdist_globs:
        matched = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern)
                         if p.is_file() and not SDIST_GLOB_EXCLUDE.search(p.as_posix()))
        if not matched:
            raise SystemExit(f"check_dists: {pattern} matches nothing in {ROOT}: not a gpupool checkout?")
        required += [add + name.removeprefix(drop) for name in matched]
    return required


def check_sdist(dist: str, sdist: Path) -> list[str]:
    errors: list[str] = []
    with tarfile.open(sdist) as tf:
        members = {m.name.split("/", 1)[1]: m for m in tf.getmembers() if "/" in m.name}
        top = {m.name.split("/", 1)[0] for m in tf.getmembers()}
        expected_top = f"{file_stem(dist)}-{source_version(dist)}"
        if top != {expected_top}:
            errors.append(f"{sdist.name}: top folder {sorted(top)}, expected {expected_top}")
        missing = [n for n in sdist_required(dist) if n not in members or not members[n].isfile()]
        if missing:
            errors.append(f"{sdist.name}: {len(missing)} file(s) the build needs missing from the sdist: "
                          f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        bad = sorted(n for n in members if SDIST_FORBIDDEN.search(n))
        if bad:
            errors.append(f"{sdist.name}: holds build output or tests: {bad[:5]}{' ...' if len(bad) > 5 else ''}")
        texts: dict[str, str] = {}
        for name in ("PKG-INFO", f"{file_stem(dist)}.egg-info/entry_points.txt"):
            data = tf.extractfile(members[name]) if name in members and members[name].isfile() else None
            texts[name] = data.read().decode() if data else ""
    if texts["PKG-INFO"]:  # (its absence is reported above)
        meta = HeaderParser().parsestr(texts["PKG-INFO"])
        errors += check_metadata(dist, sdist.name, meta,
                                 parse_scripts(texts[f"{file_stem(dist)}.egg-info/entry_points.txt"]))
    return errors


def check(dist_dir: Path, sdists: bool = True) -> list[str]:
    errors: list[str] = []
    for dist in EXPECTED:
        wheels = sorted(dist_dir.glob(f"{file_stem(dist)}-*.whl"))
        if len(wheels) != 1:
            errors.append(f"{dist_dir}: expected one {dist} wheel, found {[w.name for w in wheels]}")
        else:
            errors += check_wheel(dist, wheels[0])
        if sdists:
            tars = sorted(dist_dir.glob(f"{file_stem(dist)}-*.tar.gz"))
            if len(tars) != 1:
                errors.append(f"{dist_dir}: expected one {dist} sdist, found {[t.name for t in tars]}")
            else:
                errors += check_sdist(dist, tars[0])
    return errors


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    errors = check(Path(sys.argv[1]))
    for e in errors:
        print(f"check_dists: {e}", file=sys.stderr)
    if errors:
        print("check_dists: the distributions above are not right; see scripts/check_dists.py for what each must "
              "hold (an sdist's file list comes from MANIFEST.in and, for the client, client/setup.py's "
              "NATIVE_SOURCES)", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
