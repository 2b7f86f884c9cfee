#!/usr/bin/env bash
# The one C style (.clang-format) over every hand-written C file; generated code (*/generated/)
# stays as its generator writes it. `scripts/c-style.sh` checks (make lint, tests/test_layout.py),
# `scripts/c-style.sh --fix` rewrites the files in place.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null ||
    { echo "c-style: clang-format not found: apt install clang-format (scripts/bootstrap.sh does)" >&2; exit 2; }
mapfile -t files < <(git ls-files '*.c' '*.h' | grep -v '/generated/')
if [[ ${1:-} == --fix ]]; then
    clang-format -i "${files[@]}"
    echo "c-style: ${#files[@]} files formatted"
else
    clang-format --dry-run --Werror "${files[@]}" ||
        { echo "c-style: the files above are not in the project's C style; run scripts/c-style.sh --fix" >&2; exit 1; }
    echo "c-style: ${#files[@]} files in style"
fi
