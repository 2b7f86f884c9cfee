#!/usr/bin/env bash
# `make lint`: ruff over the repository, the C style (clang-format) and the generated-code drift check.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .venv/bin/python ]] || scripts/bootstrap.sh
.venv/bin/ruff check .
scripts/c-style.sh
.venv/bin/python -m pytest -q -p no:cacheprovider tests/test_protocol_drift.py -k "not c_golden"
.venv/bin/python client/nvml/gen_stubs.py --check
