#!/usr/bin/env bash
# `make bench`: the remoting benchmark (bench/remoting_bench.py; results go to docs/benchmarks.md).
# Arguments are passed on, e.g. `scripts/bench.sh --quick` or `--markdown /tmp/bench.md`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
make -j2
exec .venv/bin/python bench/remoting_bench.py --no-build "$@"
