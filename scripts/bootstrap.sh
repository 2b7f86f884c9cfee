#!/usr/bin/env bash
# Create or update the development virtual environment .venv/ (idempotent, fast when current):
# the daemon and the client in editable mode, the test tools, and PyTorch's CUDA wheel.
#   GPUPOOL_NO_TORCH=1        skip PyTorch (the torch tests then skip; under CI=true they fail)
#   GPUPOOL_TORCH_SPEC=...    another PyTorch requirement (default torch==2.14.1)
#   PYTHON=...                the interpreter to build the venv from (3.11 or newer)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
TORCH_SPEC=${GPUPOOL_TORCH_SPEC:-torch==2.14.1}

if [[ -z "${PYTHON:-}" ]]; then
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "bootstrap: $PYTHON is not Python 3.11 or newer ($("$PYTHON" --version 2>&1))" >&2
    exit 1
fi

# promtool (Debian's prometheus package) lints /metrics in tests/test_metrics.py.
if ! command -v promtool >/dev/null 2>&1; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "bootstrap: installing promtool (Debian package prometheus)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
    else
        echo "bootstrap: promtool not found and not root with apt-get: the /metrics lint test" \
             "will skip (and fail under CI=true); install it with" \
             "\`sudo apt-get install --no-install-recommends prometheus\`" >&2
    fi
fi

# Chromium (Debian's chromium package) drives the web dashboard in
# tests/test_dashboard_browser.py, headless, over the DevTools protocol.
if ! command -v chromium >/dev/null 2>&1; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "bootstrap: installing chromium (Debian package chromium)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
    else
        echo "bootstrap: chromium not found and not root with apt-get: the dashboard browser" \
             "test will skip (and fail under CI=true); install it with" \
             "\`sudo apt-get install --no-install-recommends chromium\`" >&2
    fi
fi

if [[ ! -x $VENV/bin/python ]]; then
    echo "bootstrap: creating $VENV with $("$PYTHON" --version)"
    "$PYTHON" -m venv "$VENV"
fi

# Re-run pip only when what it installs changed.
want=$(cat pyproject.toml setup.py client/pyproject.toml client/setup.py "$0" | sha256sum | cut -c1-16)
want="$want ${GPUPOOL_NO_TORCH:-0} $TORCH_SPEC"
stamp=$VENV/.gpupool-bootstrap
if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
    echo "bootstrap: $VENV is up to date"
    exit 0
fi

pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
echo "bootstrap: installing gpupoold and gpupool (editable) and the test tools"
"${pip[@]}" -e '.[test]' -e ./client
if [[ "${GPUPOOL_NO_TORCH:-0}" != 1 ]]; then
    echo "bootstrap: installing $TORCH_SPEC (first time: a few minutes)"
    "${pip[@]}" "$TORCH_SPEC"
fi
echo "$want" > "$stamp"
echo "bootstrap: $VENV ready"
