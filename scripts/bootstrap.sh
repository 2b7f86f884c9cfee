#!/usr/bin/env bash
# Create or update the development virtual environment .venv/ (idempotent, fast when current):
# the daemon and the client in editable mode, the test tools, PyTorch's CUDA wheel and pycuda
# (built from source: scripts/build-pycuda.sh).
#   --demo                    only what `make demo` needs: the daemon, the client and the protocol
#                             package with their dependencies (no test tools, Debian packages or
#                             PyTorch); a full bootstrap later adds the rest
#   GPUPOOL_NO_TORCH=1        skip PyTorch (the torch tests then skip; under CI=true they fail)
#   GPUPOOL_TORCH_SPEC=...    another PyTorch requirement (default torch==2.14.1)
#   PYTHON=...                the interpreter to build the venv from (3.11 or newer)
set -euo pipefail
cd "$(dirname "$0")/.."

demo=0
[[ "${1:-}" == "--demo" ]] && demo=1

VENV=.venv
TORCH_SPEC=${GPUPOOL_TORCH_SPEC:-torch==2.14.1}

if [[ -z "${PYTHON:-}" ]]; then
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "bootstrap: $PYTHON is not Python 3.11 or newer ($("$PYTHON" --version 2>&1))" >&2
    exit 1
fi

# Debian packages some tests need (not the demo): one `apt-get update` for all that are missing.
#   need_tool COMMAND PACKAGE WHAT-NEEDS-IT
apt_updated=0
need_tool() {
    command -v "$1" >/dev/null 2>&1 && return 0
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "bootstrap: installing $1 (Debian package $2)"
        if [[ $apt_updated == 0 ]]; then apt-get update -qq; apt_updated=1; fi
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2"
    else
        echo "bootstrap: $1 not found and not root with apt-get: $3 will skip (and fail" \
             "under CI=true); install it with \`sudo apt-get install --no-install-recommends $2\`" >&2
    fi
}
if [[ $demo == 0 ]]; then
    need_tool promtool prometheus "the /metrics lint test (tests/test_metrics.py)"
    need_tool chromium chromium "the dashboard's browser test (tests/test_dashboard_browser.py)"
    need_tool dpkg-shlibdeps dpkg-dev "scripts/build-debs.sh and the Debian package test (tests/test_debs.py)"
    need_tool lintian lintian "the Debian package test (tests/test_debs.py)"
    need_tool hardening-check devscripts "the Debian package test's hardening check (tests/test_debs.py)"
    need_tool systemd-analyze systemd "the unit checks and socket activation (tests/test_systemd.py, tests/test_sdlisten.py)"
    need_tool nm binutils "the wheel tests' shim symbol check (tests/test_wheels.py)"
    need_tool clang clang "the fuzz targets (tests/fuzz/, tests/test_fuzz.py, make fuzz)"
    need_tool clang-format clang-format "the C style check (scripts/c-style.sh, make lint, tests/test_layout.py)"
    need_tool tmux tmux "gpupool login in a real terminal (tests/test_login_tty.py)"
    # PostgreSQL's server programs live off PATH in Debian (/usr/lib/postgresql/N/bin).
    if ! command -v initdb >/dev/null 2>&1 && ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
        need_tool initdb postgresql "the store's PostgreSQL tests (tests/test_store.py, tests/pg_server.py)"
    fi
    # libFuzzer's runtime comes apart from clang in Debian: look for the library itself.
    if command -v clang >/dev/null 2>&1 && [[ -z "$(clang -print-file-name=libclang_rt.fuzzer-x86_64.a 2>/dev/null | grep /)" ||
            ! -f "$(clang -print-file-name=libclang_rt.fuzzer-x86_64.a 2>/dev/null)" ]]; then
        need_tool libfuzzer-runtime-absent "libclang-rt-$(clang -dumpversion | cut -d. -f1)-dev" \
            "the fuzz targets (libFuzzer runtime)"
    fi
fi

if [[ ! -x $VENV/bin/python ]]; then
    echo "bootstrap: creating $VENV with $("$PYTHON" --version)"
    "$PYTHON" -m venv "$VENV"
fi

# Re-run pip only when what it installs changed.
want=$(cat pyproject.toml setup.py client/pyproject.toml client/setup.py protocol/python/pyproject.toml "$0" \
        scripts/build-pycuda.sh |
       sha256sum | cut -c1-16)
want="$want ${GPUPOOL_NO_TORCH:-0} $TORCH_SPEC"
stamp=$VENV/.gpupool-bootstrap
if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
    echo "bootstrap: $VENV is up to date"
    exit 0
fi
if [[ $demo == 1 ]]; then  # a full bootstrap of the same sources has all the demo needs
    if [[ -f $stamp && "$(cut -d' ' -f1 "$stamp")" == "${want%% *}" ]] || [[ -f $stamp.demo &&
            "$(cat "$stamp.demo")" == "${want%% *}" ]]; then
        echo "bootstrap: $VENV is up to date for the demo"
        exit 0
    fi
    echo "bootstrap: installing gpupoold, gpupool and gpupool-protocol (editable) for the demo"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ./protocol/python \
        -e . -e ./client
    echo "${want%% *}" > "$stamp.demo"
    echo "bootstrap: $VENV ready for the demo (\`make test\` sets up the rest)"
    exit 0
fi

pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
echo "bootstrap: installing gpupoold, gpupool and gpupool-protocol (editable) and the test tools"
"${pip[@]}" -e ./protocol/python -e '.[test]' -e ./client
if [[ "${GPUPOOL_NO_TORCH:-0}" != 1 ]]; then
    echo "bootstrap: installing $TORCH_SPEC (first time: a few minutes)"
    "${pip[@]}" "$TORCH_SPEC"
fi
# pycuda has no wheels; it is built from source against the CUDA toolkit (a test client).
scripts/build-pycuda.sh "$VENV"
echo "$want" > "$stamp"
echo "bootstrap: $VENV ready"
