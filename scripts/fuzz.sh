#!/usr/bin/env bash
# `make fuzz`: run every fuzz target (tests/fuzz/README.md) for a while on its corpus, keep what
# it learns, and say what it found.
#   scripts/fuzz.sh [SECONDS]       per target (default 60; FUZZ_SECONDS too)
#   FUZZ_TARGETS="fuzz_worker ..."  only these
# The corpora grow in build-fuzz/corpus/<target>/ (seeded from tests/fuzz/seeds.py and the
# regression inputs in tests/fuzz/regressions/<target>/); a crash is saved in
# build-fuzz/crashes/<target>/ and makes the script fail: reproduce it with
# `build-fuzz/<target> FILE`, fix it, then copy FILE into tests/fuzz/regressions/<target>/ so that
# `make test` replays it for ever. Executions per target add up in build-fuzz/executions.tsv.
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-${FUZZ_SECONDS:-60}}
targets=${FUZZ_TARGETS:-"fuzz_protocol fuzz_worker fuzz_shim_replies fuzz_client_config fuzz_info"}
python=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}

if ! command -v "${FUZZ_CC:-clang}" >/dev/null; then
    echo "fuzz: clang not found: apt-get install clang libclang-rt-14-dev (scripts/bootstrap.sh does)" >&2
    exit 1
fi
make -s -j"$(nproc)" fuzz-build
"$python" tests/fuzz/seeds.py build-fuzz/seeds >/dev/null
tally=build-fuzz/executions.tsv
touch "$tally"
failed=()
for t in $targets; do
    mkdir -p "build-fuzz/corpus/$t" "build-fuzz/crashes/$t" "tests/fuzz/regressions/$t"
    echo "==> $t for $secs s"
    log=build-fuzz/$t.log
    set +e
    "build-fuzz/$t" -max_total_time="$secs" -max_len=65536 -timeout=30 -print_final_stats=1 \
        -artifact_prefix="build-fuzz/crashes/$t/" "build-fuzz/corpus/$t" \
        "build-fuzz/seeds/$t" "tests/fuzz/regressions/$t" >"$log" 2>&1
    rc=$?
    set -e
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    runs=${runs:-0}
    total=$(( $(awk -v t="$t" '$1 == t { s += $2 } END { print s + 0 }' "$tally") + runs ))
    printf '%s\t%s\t%s\n' "$t" "$runs" "$(date -u +%FT%TZ)" >>"$tally"
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 || true)
    echo "    $runs executions ($total in all), ${cov:-cov: ?}, corpus $(ls "build-fuzz/corpus/$t" | wc -l) inputs"
    if (( rc != 0 )); then
        failed+=("$t")
        grep -E 'ERROR|SUMMARY|Test unit written' "$log" | head -5 | sed 's/^/    /'
        echo "    full output: $log"
    fi
done
if (( ${#failed[@]} )); then
    echo "fuzz: FOUND PROBLEMS in: ${failed[*]}" >&2
    exit 1
fi
echo "fuzz: no crash, leak, hang or sanitizer report"
