#!/usr/bin/env bash
# `make test` (and CI, via .ci/run): venv, native builds (plain and ASan+UBSan), lint, tests.
# Exits non-zero when anything fails. Under CI=true no test tier may skip (tests/conftest.py).
#   PYTEST_ARGS="..."   extra pytest arguments for both passes (e.g. "-x -k daemon")
#   GPUPOOL_TEST_JOBS=N test processes (pytest-xdist) for both passes, default 2; the sanitizer
#                       pass uses at most 2 (ASan's CPU). 1: one process, as before. Each test
#                       file runs whole in one process (--dist loadfile): a file's tests share
#                       module fixtures and run in their order; files that make network
#                       namespaces use subnets of their own (test_fleet_netns, test_fleet_faults).
#                       Most tests wait on daemons, workers and clients rather than compute, so
#                       2 processes on 2 cores cut the wall time (docs/benchmarks.md, "CI time").
# Both passes print their slowest tests (--durations): CI must stay under 45 minutes on 2 cores,
# and that list says where the time goes.
set -euo pipefail
cd "$(dirname "$0")/.."

t0=$(date +%s)
timings=()
failed=()
step() { echo; echo "==> $*"; }
took() { timings+=("$(printf '%-28s %5ss' "$1" $(( $(date +%s) - $2 )))"); }

t=$(date +%s); step "virtual environment (.venv)"
scripts/bootstrap.sh
took "venv" "$t"

t=$(date +%s); step "native build (build/, build-asan/)"
make -j2
make -j2 SAN=1
took "native build" "$t"

t=$(date +%s); step "lint (ruff)"
if ! .venv/bin/ruff check .; then failed+=("ruff"); fi
took "lint" "$t"

# shellcheck disable=SC2206
extra=(${PYTEST_ARGS:-})
jobs=${GPUPOOL_TEST_JOBS:-2}
par() {  # the pytest-xdist arguments for at most $1 processes
    local n=$(( jobs < $1 ? jobs : $1 ))
    if (( n > 1 )); then echo "-n $n --dist loadfile"; fi
}

t=$(date +%s); step "tests marked 'san' against the AddressSanitizer + UBSan build"
set +e
# shellcheck disable=SC2046
GPUPOOL_SAN=1 .venv/bin/python -m pytest tests -m san -ra -p no:cacheprovider --durations=15 \
    $(par 2) "${extra[@]}"
rc=$?
set -e
if [[ $rc -ne 0 && $rc -ne 5 ]]; then failed+=("pytest (sanitizer build)"); fi  # 5: none marked
took "tests (sanitizer build)" "$t"

t=$(date +%s); step "all tests"
# shellcheck disable=SC2046
if ! .venv/bin/python -m pytest tests -ra -p no:cacheprovider --durations=40 $(par "$jobs") \
        "${extra[@]}"; then
    failed+=("pytest")
fi
took "tests" "$t"

echo
echo "==> timings"
printf '    %s\n' "${timings[@]}"
printf '    %-28s %5ss\n' "total" $(( $(date +%s) - t0 ))
if (( ${#failed[@]} )); then
    echo "test.sh: FAILED: ${failed[*]}"
    exit 1
fi
echo "test.sh: everything passed"
