#!/usr/bin/env python3
"""The hashed lock of the Python dependencies the gpupoold .deb bundles
(packaging/debian/gpupoold-deps.lock): every distribution the daemon's runtime dependencies
(pyproject.toml, less our own gpupool-protocol) resolve to, as `name==version --hash=sha256:...`
of the one wheel pip picks for this Python and platform. scripts/build-debs.sh installs from it
with `pip --require-hashes`, so two builds of one commit bundle the same bytes.

    scripts/lock-deps.py            rewrite the lock (run after changing the dependencies)
    scripts/lock-deps.py --check    exit 1 when the lock does not match pyproject.toml

The lock is for the Python it was made with (its compiled extensions are per minor version);
build-debs.sh refuses another and says to run this with that Python.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "packaging" / "debian" / "gpupoold-deps.lock"
OURS = {"gpupool-protocol"}
HEADER = "# Python {minor}: made by scripts/lock-deps.py; do not edit (build-debs.sh checks it).\n"


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# Extras the package bundles too: the Debian package serves a fleet on PostgreSQL out of the box.
BUNDLED_EXTRAS = ("postgresql",)


def requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = list(project["dependencies"])
    for extra in BUNDLED_EXTRAS:
        deps += project["optional-dependencies"][extra]
    return [d for d in deps if normal(re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0]) not in OURS]


def locked_names(text: str) -> set[str]:
    return {normal(m) for m in re.findall(r"^([A-Za-z0-9_.-]+)==", text, re.M)}


def make_lock() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet",
                        "--disable-pip-version-check", "--only-binary=:all:", "--dest", tmp,
                        *requirements()], check=True)
        lines = [HEADER.format(minor=f"{sys.version_info[0]}.{sys.version_info[1]}")]
        for wheel in sorted(Path(tmp).glob("*.whl"), key=lambda p: normal(p.name)):
            name, version = wheel.name.split("-")[:2]
            digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
            lines.append(f"{normal(name)}=={version} \\\n    --hash=sha256:{digest}\n")
    return "".join(lines)


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        text = LOCK.read_text() if LOCK.exists() else ""
        wanted = {normal(re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0]) for d in requirements()}
        missing = wanted - locked_names(text)
        if missing:
            print(f"lock-deps: {LOCK} lacks {sorted(missing)}: run scripts/lock-deps.py",
                  file=sys.stderr)
            return 1
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    LOCK.write_text(make_lock())
    print(f"lock-deps: wrote {LOCK}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
