#!/usr/bin/env bash
# Build the wheels and sdists of the daemon (gpupoold, this directory's pyproject.toml), the
# client (gpupool, client/pyproject.toml) and the Python protocol module both depend on
# (gpupool-protocol, protocol/python/pyproject.toml) into dist/ (or $1), then check them with
# scripts/check_dists.py. The daemon's and the client's wheels carry native code built here with
# make + gcc (in $GPUPOOL_BUILD_DIR, default build/), so they are tagged for this platform
# (linux_x86_64); the protocol's is pure Python (py3-none-any).
# Uses `python -m build` when it is installed, else `pip wheel` and `setup.py sdist`.
# Each sdist builds on its own (no checkout around it): the daemon's carries the Makefile and the
# C sources it needs (MANIFEST.in), the client's gets them in its native/ folder (client/setup.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=$(command -v python3)
[[ $PY == /* ]] || PY=$PWD/$PY  # absolute (not resolved: a venv python is a link)
OUT=${1:-dist}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/gpupoold-*.whl "$OUT"/gpupoold-*.tar.gz "$OUT"/gpupool-*.whl "$OUT"/gpupool-*.tar.gz \
      "$OUT"/gpupool_protocol-*.whl "$OUT"/gpupool_protocol-*.tar.gz

for proj in protocol/python . client; do
    case $proj in
        .) what="gpupoold (the daemon)" ;;
        client) what="gpupool (the client)" ;;
        *) what="gpupool-protocol (the Python protocol module)" ;;
    esac
    echo "build-dists: building the sdist and the wheel of $what into $OUT" >&2
    if (cd /tmp && "$PY" -c "import build") 2>/dev/null; then
        # --no-isolation: the build needs only setuptools, which $PY has (no download)
        "$PY" -m build --no-isolation --sdist --wheel --outdir "$OUT" "$proj"
    else
        "$PY" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$OUT" "./$proj"
        # setuptools' PEP 517 hook, as `build` calls it (the protocol's project has no setup.py)
        (cd "$proj" && "$PY" -c 'import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])' \
            "$OUT" >/dev/null)
    fi
done
"$PY" scripts/check_dists.py "$OUT"
ls -l "$OUT"
