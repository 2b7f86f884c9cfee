"""Check the wheels and sdists that scripts/build-dists.sh made: names, versions, entry points,
requirements, platform tags and the native files each wheel must carry.

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
from email.parser import HeaderParser
from email.message import Message
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# distribution name -> (entry points in console_scripts, files the wheel must hold, requirement
# names it must declare)
EXPECTED: dict[str, tuple[dict[str, str], tuple[str, ...], tuple[str, ...]]] = {
    "gpupoold": (
        {"gpupoold": "gpupoold.cli:main", "gpupool-reset-helper": "gpupoold.reset_helper:main"},
        ("gpupoold/bin/gpupool-worker", "gpupoold/bin/gpupool-scrub", "gpupoold/bin/libgpupool-sim.so",
         "gpupoold/__init__.py", "gpupool_protocol/__init__.py", "gpupoold_web/templates/",
         "gpupoold_web/static/"),
        ("aiohttp", "nvidia-ml-py", "prometheus-client", "jinja2"),
    ),
    "gpupool": (
        {"gpupool": "gpupool.cli:main"},
        ("gpupool/lib/libcuda.so.1", "gpupool/lib/libcuda.so", "gpupool/lib/libnvidia-ml.so.1",
         "gpupool/lib/libnvidia-ml.so", "gpupool/__init__.py", "gpupool/wire/__init__.py"),
        (),
    ),
}
VERSION_FILES = {"gpupoold": ROOT / "gpupoold" / "__init__.py", "gpupool": ROOT / "client" / "gpupool" / "__init__.py"}
# The native code is built for this machine: the wheel's platform tag must say so.
PLATFORM = sysconfig.get_platform().replace("-", "_").replace(".", "_")


def source_version(dist: str) -> str:
    found = re.search(r'^__version__\s*=\s*"([^"]+)"', VERSION_FILES[dist].read_text(), re.M)
    if not found:
        raise SystemExit(f"check_dists: no __version__ in {VERSION_FILES[dist]}")
    return found.group(1)


def wheel_metadata(wheel: Path) -> tuple[Message, dict[str, str], list[str], str]:
    """(METADATA, console_scripts, file names, WHEEL Tag) of a wheel."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
        meta = HeaderParser().parsestr(zf.read(f"{info}/METADATA").decode())
        wheel_info = HeaderParser().parsestr(zf.read(f"{info}/WHEEL").decode())
        scripts: dict[str, str] = {}
        if f"{info}/entry_points.txt" in names:
            cp = configparser.ConfigParser()
            cp.read_string(zf.read(f"{info}/entry_points.txt").decode())
            if cp.has_section("console_scripts"):
                scripts = dict(cp["console_scripts"])
    return meta, scripts, names, wheel_info.get("Tag", "")


def check_wheel(dist: str, wheel: Path) -> list[str]:
    scripts_want, files_want, requires_want = EXPECTED[dist]
    errors: list[str] = []
    meta, scripts, names, tag = wheel_metadata(wheel)
    if meta["Name"] != dist:
        errors.append(f"{wheel.name}: Name is {meta['Name']!r}, expected {dist!r}")
    if meta["Version"] != source_version(dist):
        errors.append(f"{wheel.name}: Version {meta['Version']} differs from the source's {source_version(dist)}")
    if scripts != scripts_want:
        errors.append(f"{wheel.name}: console_scripts {scripts}, expected {scripts_want}")
    requires = {re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0].lower() for r in meta.get_all("Requires-Dist") or []}
    for req in requires_want:
        if req not in requires:
            errors.append(f"{wheel.name}: Requires-Dist lacks {req} (has {sorted(requires)})")
    if not requires_want and requires:
        errors.append(f"{wheel.name}: expected no requirements, has {sorted(requires)}")
    if not tag.endswith(f"-{PLATFORM}") or PLATFORM not in wheel.name:
        errors.append(f"{wheel.name}: platform tag {tag!r}, expected one ending in {PLATFORM} (native code)")
    for want in files_want:
        hits = [n for n in names if n.startswith(want)] if want.endswith("/") else [n for n in names if n == want]
        if not hits:
            errors.append(f"{wheel.name}: {want} missing from the wheel")
    return errors


def check_sdist(dist: str, sdist: Path) -> list[str]:
    errors: list[str] = []
    with tarfile.open(sdist) as tf:
        names = [m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name]
    want = ["pyproject.toml", "setup.py", "PKG-INFO"]
    if dist == "gpupoold":  # the daemon's sdist builds its native parts: their sources ride along
        want += ["Makefile", "worker/worker.mk", "worker/sim/sim.mk", "worker/scrub/scrub.mk"]
    for w in want:
        if w not in names:
            errors.append(f"{sdist.name}: {w} missing from the sdist")
    return errors


def check(dist_dir: Path, sdists: bool = True) -> list[str]:
    errors: list[str] = []
    for dist in EXPECTED:
        wheels = sorted(dist_dir.glob(f"{dist}-*.whl"))
        if len(wheels) != 1:
            errors.append(f"{dist_dir}: expected one {dist} wheel, found {[w.name for w in wheels]}")
        else:
            errors += check_wheel(dist, wheels[0])
        if sdists:
            tars = sorted(dist_dir.glob(f"{dist}-*.tar.gz"))
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
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
