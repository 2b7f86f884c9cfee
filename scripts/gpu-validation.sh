#!/usr/bin/env bash
# GPU validation on a lent GPU machine (docs/validation.md, "How to run the GPU validation").
#
#   bash scripts/gpu-validation.sh [--prepare] [--dry-run] [--long] [--only STEP,...] [--budget SECONDS]
#
# A task lent a GPU gets 15 minutes of device time in all, the machine's start included, so the
# default plan is ONE device call of at most 8 minutes (--budget 450 by default; give the call a
# timeout_s of 480). From the repository root on the GPU machine it prints the GPU, driver,
# runtime (Firecracker or gVisor) and commit, takes the binaries prepared here (or builds), then
# runs the real-GPU steps in the order of what they tell us, each under its own time limit, going
# on past a failing step and rewriting $OUT/summary.md after each one, so a run cut short still
# reports (the device tool brings $OUT back; elsewhere: /tmp/gpu-validation-out).
#
#   --prepare      on YOUR machine, before the call (no GPU needed): make, compile the CUDA test
#                  programs and the bench clients into build/, and print the `carry` list for the
#                  call. The device then skips the build if those binaries load there.
#   --long         the optional second call, only when the device's status shows time left: the
#                  longer figures (the six workloads and the remoting benchmark in full).
#   --smoke        on a machine WITHOUT a GPU (CI does this): the script's machinery against
#                  gpupoold's simulated GPU, the CUDA programs through gpupool only (no native
#                  runs), shares and ipc with --simulated (copies instead of kernels, quotas of
#                  256 MiB); steps build,cuda,shares,ipc unless --only. Proves the script, measures nothing.
# Steps, in the order of what they tell (--only picks some; `info` is cheap and always worth
# keeping). The default (one call) runs info, build, sandbox, detach, shares, ipc, frameworks,
# cuda_graph, compile, busy: their time limits add up to the 8-minute budget (planned from the
# 2026-11-27 H200 run, docs/validation.md); cuda, torch-scripts, remoting, workloads, restart and
# generate ran there and do not fit: --long or --only runs them, and the summary says they were
# left out (generate also runs in --long's workloads, all six).
#   info           nvidia-smi -L / --query-gpu, driver, runtime, commit, python, torch, nvcc (read-only)
#   build          the prepared binaries if they load here, else make -j (into build/ or $GPUPOOL_BUILD_DIR)
#   sandbox        bench/gpu_checks.py sandbox: the worker's Landlock sandbox (worker_sandbox = true,
#                  the default) against the real driver (PTX JIT, VMM, lazy cuBLAS, Triton); what
#                  fails runs again with worker_sandbox = false, and the step says which is the cause
#   detach         bench/gpu_checks.py detach: idle detach with the real cuCheckpoint* calls, a
#                  PyTorch tenant of 1 GiB and of 8 GiB, a second client in between, bit-exact,
#                  detach and reattach timed against 20 ms + 2 x the state's host-to-device time
#   shares         bench/gpu_checks.py shares (issue 32): gpupoold with share = 4; four PyTorch tenants
#                  with GPUPOOL_MEMORY=16G at once, each's matmul loop against the same loop alone,
#                  each sees its quota and gets OOM past it; a tenant fills its quota with 0xAB and
#                  is SIGKILLed, the next reads only zeros (the real driver's zero-after-free)
#   ipc            bench/gpu_checks.py ipc (issue 37, its single-GPU paths): share = 2; a CUDA tensor
#                  between two processes of one token (torch.multiprocessing: CUDA IPC memory and
#                  event handles) and tests/c/ipc_share, bit-exact; a 1-GPU lease, GPUPOOL_GPUS=1
#   generate       bench/torch_workloads.py --only generate (its A/B variants, bench/generate_variants.py,
#                  come along): native vs gpupool, each remote run's GPUPOOL_PROFILE in the logs
#   cuda_graph     bench/torch_workloads.py --only cuda_graph, 100 steps (enough for a ratio)
#   compile        bench/torch_workloads.py --only compile, 20 steps after the compile
#   busy           bench/gpu_checks.py busy: gpupool's busy seconds against nvidia-smi dmon -s u
#   cuda           tests/cuda programs (nvcc) natively, then through gpupool on the same GPU:
#                  each must print PASS both ways; devices' property lines are diffed
#   torch-scripts  tests/torch_scripts (device info, runtime, transfers, cuBLAS/cuBLASLt init,
#                  Triton probe, graphs, the two other allocators) natively, then through gpupool
#   frameworks     tests/framework_scripts: CuPy (NVRTC kernels, PTX, cuBLAS/cuFFT/cuRAND/CUB),
#                  cuda-bindings (PTX and cubin through cuGetProcAddress), numba-cuda and JAX;
#                  the pycuda and cuda-python clients of the simulated-device tier (driver and
#                  runtime API),
#                  natively, then through gpupool; the export-table slots each asked for
#                  (`gpupool: export table UUID slot N called`) are listed, slot by slot
#   remoting       bench/remoting_bench.py against gpupoold on the real GPU (--server), over TLS
#                  pinned to the daemon's identity (TLS is gpupoold's default)
#   workloads      bench/torch_workloads.py: mlp, cnn, gpt (quick) or the six (--long), native vs
#                  gpupool (it starts its own gpupoold; the script's own is stopped first)
#   restart        bench/restart_check.py --real: a training loop across gpupoold restarts
# No pytest tier needs a real GPU: tests/conftest.py always starts a simulated one, so the
# `cuda`, `torch-scripts` and `frameworks` steps are the real-GPU end-to-end tier.
# Every client pins the identity its gpupoold prints at start (`gpupoold: identity SHA256:...`)
# with GPUPOOL_TLS_FINGERPRINT, as a user's `gpupool login` would: TLS end to end. A gpupoold
# that finds no GPU refuses to start (it never falls back to a simulated one unless
# fallback_to_simulated is set, which only --smoke does).
#
# Files under $OUT (the device tool brings back at most 8): summary.md (steps, results, the
# markdown sections to paste, each profile's top lines), gpu-validation.log (this console),
# logs.tar.gz (every step's log, the checks' JSON, profile/ with each remote workload's
# GPUPOOL_PROFILE), workloads.json, remoting.json, restart.json.
# Exit status: 0 when every selected step passed, 1 otherwise (a step past its time limit or not
# started for lack of time counts as failed). The script goes on past a failing step.
#
# SAFETY (lent GPUs): this script must NEVER reset or reconfigure the GPU. nvidia-smi is run
# only for read-only queries (-L, --query-*, the plain status table): never -r/--gpu-reset, -pm,
# -lgc/-rgc/-lmc/-rmc, -ac/-rac, -pl, -c, -mig or any other setting. gpupoold runs with
# reset_policy = "never" and without the reset helper, in both this script and
# bench/torch_workloads.py. Do not add steps that change GPU state.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

DRY_RUN=0
LONG=0
PREPARE=0
SMOKE=0
ONLY=""
BUDGET=""
ALL_STEPS=(info build sandbox detach shares ipc frameworks generate cuda_graph compile busy cuda torch-scripts
    remoting workloads restart)
# The one-call plan (what fits 8 minutes, most valuable first); --long and --only choose others.
# shares and ipc (the first real-GPU checks of issues 32 and 37) took generate's place: generate
# ran on 2026-11-27 (its ratio is known) and --long's workloads step runs it with the other five.
ONE_CALL="info,build,sandbox,detach,shares,ipc,frameworks,cuda_graph,compile,busy"

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while (($#)); do
    case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --long) LONG=1 ;;
    --prepare) PREPARE=1 ;;
    --smoke) SMOKE=1 ;;
    --only) ONLY="${2:?--only needs STEP,...}"; shift ;;
    --only=*) ONLY="${1#--only=}" ;;
    --budget) BUDGET="${2:?--budget needs seconds}"; shift ;;
    --budget=*) BUDGET="${1#--budget=}" ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu-validation.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
if ((SMOKE)); then
    [[ -z "$ONLY" ]] && ONLY="build,cuda,shares,ipc"
    export GPUPOOL_VALIDATION_ALLOW_SIMULATED=1
fi
export SMOKE
SELECT="$ONLY"
if ((LONG)); then
    # The second call: the figures that take long; the machine may be a fresh one (build again).
    [[ -z "$SELECT" ]] && SELECT="info,build,remoting,workloads"
    BUDGET="${BUDGET:-560}" # inside the tool's 10 minutes a command
else
    BUDGET="${BUDGET:-450}" # one call of at most 8 minutes (timeout_s 480)
    [[ -z "$SELECT" ]] && SELECT="$ONE_CALL"
fi
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]]; then
    echo "gpu-validation.sh: --budget wants whole seconds, got $BUDGET" >&2
    exit 2
fi
if [[ -n "$ONLY" ]]; then
    IFS=, read -r -a wanted <<<"$ONLY"
    for w in "${wanted[@]}"; do
        if [[ " ${ALL_STEPS[*]} " != *" $w "* ]]; then
            echo "gpu-validation.sh: unknown step $w (steps: ${ALL_STEPS[*]})" >&2
            exit 2
        fi
    done
fi

export PY="${PYTHON:-python3}"
BUILD="${GPUPOOL_BUILD_DIR:-build}" # bench/remoting_bench.py always uses build/
[[ "$BUILD" == /* ]] || BUILD="$PWD/$BUILD"
export BUILD
export OUT="${OUT:-${TMPDIR:-/tmp}/gpu-validation-out}"
export LONG
# One program's run, natively or through gpupool: a hang costs this much of the budget at most.
RUN_LIMIT=90
((LONG)) && RUN_LIMIT=150
export RUN_LIMIT
PREPARED="$BUILD/validation" # what --prepare compiled on the developer's machine
export PREPARED
JOBS=$(nproc 2>/dev/null || echo 2)
((JOBS > 16)) && JOBS=16
export JOBS
START=$(date +%s)
DEADLINE=$((START + BUDGET))

selected() { [[ ",$SELECT," == *",$1,"* ]]; }
stamp() { echo "[$(date -u +%H:%M:%S) +$(($(date +%s) - START))s] $*"; }

# ------------------------------------------------------------------------------ the CUDA programs
CUDA_PROGRAMS=(devices copies events kernels errors threads graphs vmm modules)
CUDA_ARCH="${GPUPOOL_TEST_ARCH:-sm_90}"
export CUDA_ARCH
# compile_cuda DIR: every program of the cuda step into DIR (static cudart; `modules` also links
# libcuda, resolved at run time to the driver natively and to our shim through gpupool, and gets
# its three images: cubin, fatbin, PTX). Skips what DIR already holds. Used by --prepare here and
# by the cuda step there when nothing was prepared.
compile_cuda() {
    local dir="$1" nvcc p kind gen
    nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    gen=(-gencode "arch=compute_${CUDA_ARCH#sm_},code=[${CUDA_ARCH},compute_${CUDA_ARCH#sm_}]")
    mkdir -p "$dir" || return 1
    for p in $CUDA_PROGRAMS_LIST; do
        [[ -x "$dir/$p" ]] && continue
        local extra=()
        [[ $p == modules ]] && extra=(-L "$BUILD/client" -lcuda)
        echo "  nvcc -O2 ${gen[*]} -o $dir/$p tests/cuda/$p.cu ${extra[*]}"
        "$nvcc" -O2 "${gen[@]}" -o "$dir/$p" "tests/cuda/$p.cu" "${extra[@]}" || return 1
    done
    for kind in cubin fatbin ptx; do
        [[ -s "$dir/modules.$kind" ]] && continue
        "$nvcc" -arch="$CUDA_ARCH" "-$kind" -o "$dir/modules.$kind" tests/cuda/modules.cu || return 1
    done
}
export CUDA_PROGRAMS_LIST="${CUDA_PROGRAMS[*]}"
export -f compile_cuda

# ------------------------------------------------------------------------------ dry run
# shares and ipc: on the simulated GPU (--smoke) quotas it can hold and copies for kernels.
shares_args() {
    if ((SMOKE)); then echo "--simulated --memory 256M --seconds 1 --limit 40"; else echo "--memory 16G --seconds 3 --limit 40"; fi
}
ipc_args() {
    local prog="$PREPARED/ipc_share"
    [[ -x "$prog" ]] || prog="$BUILD/tests/ipc_share"
    if ((SMOKE)); then echo -n "--simulated --memory 256M --bytes 4194304"; else echo -n "--memory 8G"; fi
    [[ -x "$prog" ]] && echo -n " --ipc-share $prog"
    echo " --limit 30"
}
describe() {
    case "$1" in
    info) echo "nvidia-smi -L; nvidia-smi --query-gpu=...; runtime (kernel release); commit; $PY/torch/nvcc versions" ;;
    build) echo "the binaries of --prepare ($PREPARED/PREPARED) if they load there, else make -j$JOBS BUILD=$BUILD" ;;
    sandbox) echo "$PY bench/gpu_checks.py sandbox --cuda-dir DIR: cuda modules (PTX JIT), vmm, torch blas_init, triton_probe through gpupool with worker_sandbox = true; what fails again with false" ;;
    detach) echo "$PY bench/gpu_checks.py detach --sizes 1G,8G: idle detach (real cuCheckpoint*), a second client in between, reattach bit-exact; target 20 ms + 2 x H2D time of the state" ;;
    generate) echo "$PY bench/torch_workloads.py --quick --only generate (with its variants from bench/generate_variants.py), profiles in logs/profile" ;;
    busy) echo "$PY bench/gpu_checks.py busy: gpupool_gpu_busy_seconds vs nvidia-smi dmon -s u over one lease" ;;
    shares) echo "$PY bench/gpu_checks.py shares $(shares_args): share = 4, 4 PyTorch tenants at once against one alone, quota + OOM each, 0xAB tenant SIGKILLed -> next reads zeros" ;;
    ipc) echo "$PY bench/gpu_checks.py ipc $(ipc_args): share = 2, a CUDA tensor between 2 processes of one token (torch.multiprocessing), ipc_share, a GPUPOOL_GPUS=1 lease" ;;
    cuda_graph) echo "$PY bench/torch_workloads.py --only cuda_graph --steps 100 --warmup 10, profile in logs/profile" ;;
    compile) echo "$PY bench/torch_workloads.py --only compile --steps 20 --warmup 3, profile in logs/profile" ;;
    daemon) echo "gpupoold serve (simulated = 0, gpus = [0], reset_policy = \"never\") on 127.0.0.1, a token, its identity pinned (TLS)" ;;
    cuda) echo "tests/cuda/{${CUDA_PROGRAMS_LIST// /,}}.cu (${CUDA_ARCH}): each natively, then through gpupool (${RUN_LIMIT} s a run)" ;;
    torch-scripts) echo "tests/torch_scripts/{device_info,runtime,transfers,blas_init,triton_probe,graph_capture}.py, memory_backends.py (expandable, async) natively, then through gpupool" ;;
    frameworks) echo "tests/framework_scripts/{cupy,cuda_python,numba,jax}_probe.py, cuda_python_client.py (driver, runtime), pycuda_client.py natively, then through gpupool" ;;
    remoting) echo "$PY bench/remoting_bench.py --no-build --server ADDRESS$( ((LONG)) || echo ' --quick')" ;;
    stop-daemon) echo "stop the script's gpupoold (the steps after it start their own)" ;;
    workloads) echo "$PY bench/torch_workloads.py$( ((LONG)) || echo ' --quick --only mlp,cnn,gpt') --json \$OUT/workloads.json, with GPUPOOL_PROFILE_DIR=\$LOGS/profile (each remote run's GPUPOOL_PROFILE)" ;;
    restart) echo "$PY bench/restart_check.py --real --seconds $RESTART_SECONDS: a PyTorch training loop through gpupool while its gpupoold is restarted with SIGTERM, then SIGKILL (its own gpupoold, reset policy never)" ;;
    esac
}

# Step time limits (seconds); each is also cut to what is left of --budget, so a slow step
# takes the later ones' time, never the call's. The one-call plan's limits add up to its budget
# less 20 s for run_step's margins and stopping gpupoold (tests/test_bench_workloads.py checks it): each is the step's seconds on 2026-11-27 (H200,
# docs/validation.md "Planning the call") with a margin, or an estimate where the step is new.
if ((LONG)); then
    declare -A LIMIT=([info]=30 [build]=240 [daemon]=60 [cuda]=240 [torch-scripts]=300 [frameworks]=200
        [remoting]=300 [workloads]=480 [restart]=150 [sandbox]=120 [detach]=150 [generate]=240 [busy]=60
        [cuda_graph]=120 [compile]=240 [shares]=120 [ipc]=90)
    RESTART_SECONDS=45
else
    # shares: 7 PyTorch processes start through gpupool (about 5 s each there, 4 at once), 3 s
    # alone + 3 s together, 16 GiB filled and up to the GPU's room read on the GPU; ipc: 3 starts
    # and the C program (estimates: both are new).
    declare -A LIMIT=([info]=20 [build]=20 [daemon]=20 [sandbox]=40 [detach]=70 [shares]=55 [ipc]=40
        [frameworks]=65 [generate]=95 [cuda_graph]=25 [compile]=50 [busy]=25
        [cuda]=110 [torch-scripts]=150 [remoting]=60 [workloads]=150 [restart]=75)
    RESTART_SECONDS=20
fi
export RESTART_SECONDS
# The order, most valuable first; [ ... ] is a stretch that needs the script's own gpupoold
# (the other steps start their own, or none: two daemons on one GPU would take each other's
# workers for leftovers of a lease).
ORDER=(info build sandbox detach shares ipc "[" frameworks cuda torch-scripts remoting "]" generate cuda_graph compile busy
    workloads restart)
# plan_steps: the selected steps in order, with daemon / stop-daemon around a stretch that needs it.
plan_steps() {
    local s stretch=() in=0
    for s in "${ORDER[@]}"; do
        case "$s" in
        "[") in=1; stretch=() ;;
        "]")
            in=0
            ((${#stretch[@]})) && echo daemon "${stretch[@]}" stop-daemon
            ;;
        *)
            selected "$s" || continue
            if ((in)); then stretch+=("$s"); else echo "$s"; fi
            ;;
        esac
    done
}
# left_out: the steps the default plan does not select (said in the dry run and the summary);
# nothing when --only chose.
left_out() {
    local s out=""
    [[ -n "$ONLY" ]] && return 0
    for s in "${ALL_STEPS[@]}"; do selected "$s" || out+="${out:+, }$s"; done
    echo "$out"
}

if ((DRY_RUN)); then
    echo "gpu-validation.sh --dry-run: nothing is run; OUT would be $OUT"
    echo "one device call: budget $BUDGET s for the whole run (give the call timeout_s $((BUDGET + 30)));"
    echo "each step's limit is also cut to what is left of the budget"
    total=0
    for s in $(plan_steps); do
        [[ $s == stop-daemon ]] || total=$((total + ${LIMIT[$s]:-30}))
        printf '  step %-14s timeout %4ss  %s\n' "$s" "${LIMIT[$s]:-30}" "$(describe "$s")"
    done
    echo "planned: ${total} s of step limits in a ${BUDGET} s budget"
    [[ -n "$(left_out)" ]] && echo "left out of this call (they do not fit; --long or --only): $(left_out)"
    exit 0
fi

if ((PREPARE)); then
    # On the developer's machine: everything the device would otherwise spend its minutes on.
    echo "gpu-validation.sh --prepare: building into $BUILD (no GPU needed)"
    make -j"$JOBS" BUILD="$BUILD" || exit 1
    rm -rf "$PREPARED"
    compile_cuda "$PREPARED/cuda" || exit 1
    # The ipc step's C program (tests/c/ipc_share, built by make): carried with the rest.
    cp "$BUILD/tests/ipc_share" "$PREPARED/ipc_share" || exit 1
    "$PY" -c 'import sys; from pathlib import Path; sys.path.insert(0, "bench"); import remoting_bench
remoting_bench.build(Path(sys.argv[1]), make=True)' "$BUILD/bench" || exit 1
    echo "prepared by $(uname -n), commit $(git rev-parse --short=12 HEAD 2>/dev/null || echo '?'), $(date -u)" \
        >"$PREPARED/PREPARED"
    rel="${BUILD#"$PWD"/}"
    echo "prepared; name these in the device call's carry (git ignores them):"
    echo "  [\"$rel/gpupool-worker\", \"$rel/gpupool-scrub\", \"$rel/client\", \"$rel/bench\", \"$rel/validation\"]"
    du -shc "$BUILD/gpupool-worker" "$BUILD/gpupool-scrub" "$BUILD/client" "$BUILD/bench" "$PREPARED" | tail -n 1
    exit 0
fi

mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-validation.XXXXXX")
export WORK
export LOGS="$WORK/logs"
mkdir -p "$LOGS"
exec > >(tee -a "$OUT/gpu-validation.log") 2>&1

COMMIT="${GPUPOOL_COMMIT:-}"
if [[ -z "$COMMIT" ]]; then
    COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null || echo "unknown (no .git: set GPUPOOL_COMMIT)")
    if [[ -n "$(git status --porcelain 2>/dev/null)" ]]; then COMMIT="$COMMIT (with uncommitted changes)"; fi
fi
GPU_LINE=$(timeout 30 nvidia-smi --query-gpu=name,driver_version --format=csv,noheader -i 0 2>/dev/null || true)
GPU_NAME="${GPU_LINE%%,*}"
GPU_DRIVER="${GPU_LINE#*, }"
[[ -z "$GPU_LINE" ]] && GPU_NAME="(nvidia-smi failed)" && GPU_DRIVER="?"
# The sandbox the GPU machine runs in: its GPU proxy may refuse driver calls a bare host allows,
# so every result says which one it came from.
case "$(uname -r)" in
4.4.0*) RUNTIME="gVisor (kernel $(uname -r))" ;;
*-fc-*) RUNTIME="Firecracker (kernel $(uname -r))" ;;
*) RUNTIME="kernel $(uname -r)" ;;
esac
export COMMIT RUNTIME

RESULTS=()  # "step|result|seconds"
FAILED=0
record() {
    RESULTS+=("$1|$2|$3")
    [[ "$2" == ok ]] || FAILED=1
    write_summary
}

write_summary() {
    tar czf "$OUT/logs.tar.gz" -C "$WORK" logs 2>/dev/null
    {
        echo "# GPU validation, $(date -u '+%Y-%m-%d %H:%M UTC')"
        echo
        echo "- GPU: $GPU_NAME, driver $GPU_DRIVER (nvidia-smi); runtime: $RUNTIME"
        echo "- commit: $COMMIT"
        echo "- host: $(uname -n), $(nproc) CPUs, Linux $(uname -r)"
        echo "- command: scripts/gpu-validation.sh${ARGS_TEXT}"
        echo
        echo "| step | result | seconds |"
        echo "|---|---|---|"
        local r
        for r in "${RESULTS[@]}"; do
            IFS='|' read -r s res secs <<<"$r"
            echo "| $s | $res | $secs |"
        done
        echo
        echo "Every step's log is in logs.tar.gz (logs/STEP.log and the files the steps wrote)."
        local what="" ok="" bad=""
        for r in "${RESULTS[@]}"; do
            IFS='|' read -r s res _ <<<"$r"
            what+="${what:+, }$s"
            if [[ "$res" == ok ]]; then ok+="${ok:+, }$s"; else bad+="${bad:+, }$s: $res"; fi
        done
        echo
        echo "## Row for docs/validation.md (check, then paste)"
        echo
        echo "| $(date -u +%Y-%m-%d) | $GPU_NAME ($RUNTIME) | $GPU_DRIVER | $COMMIT | scripts/gpu-validation.sh${ARGS_TEXT}: $what | passed: ${ok:-none}${bad:+; failed: $bad} |"
        [[ -n "$(left_out)" ]] && echo && echo "Left out of this call (they do not fit; --long or --only): $(left_out)."
        local f
        for f in sandbox detach busy shares ipc; do # the checks' verdict lines
            [[ -s "$LOGS/$f.log" ]] || continue
            echo
            echo "## $f"
            echo
            grep -E "^($f|detach [0-9]|busy:|\[gpu-checks\]   (alone|tenant))" "$LOGS/$f.log" | sed 's/^/    /'
        done
        if [[ -s "$LOGS/export-table-slots.txt" ]]; then
            echo
            echo "## Export-table slots the frameworks called (and what gpupool answered)"
            echo
            sed 's/^/    /' "$LOGS/export-table-slots.txt"
        fi
        for f in generate cuda_graph compile; do
            if [[ -s "$LOGS/$f.md" ]]; then
                echo
                echo "## Workload $f"
                echo
                cat "$LOGS/$f.md"
            fi
        done
        for f in "$LOGS"/profile/*; do # each remote workload as the shim saw it, top lines
            [[ -f "$f" ]] || continue
            echo
            echo "## Profile $(basename "$f") (top lines; whole file in logs.tar.gz)"
            echo
            head -n 14 "$f" | sed 's/^/    /'
        done
        if [[ -s "$LOGS/workloads.md" ]]; then
            echo
            echo "## PyTorch workload suite (for docs/benchmarks.md)"
            echo
            cat "$LOGS/workloads.md"
        fi
        if [[ -s "$LOGS/remoting.md" ]]; then
            echo
            echo "## Remoting benchmark on the real GPU (for docs/benchmarks.md)"
            echo
            cat "$LOGS/remoting.md"
        fi
    } >"$OUT/summary.md"
}
ARGS_TEXT=""
((LONG)) && ARGS_TEXT+=" --long"
((SMOKE)) && ARGS_TEXT+=" --smoke"
[[ -n "$ONLY" ]] && ARGS_TEXT+=" --only $ONLY"

# reserved_after NAME: the limits of the planned steps after NAME (what they are sure to get).
reserved_after() {
    local s seen=0 sum=0
    for s in $(plan_steps); do
        ((seen)) && [[ $s != stop-daemon ]] && sum=$((sum + ${LIMIT[$s]:-30}))
        [[ $s == "$1" ]] && seen=1
    done
    echo "$sum"
}

# run_step NAME FUNCTION: FUNCTION (exported) in its own bash under `timeout`, its output to
# the console and $LOGS/NAME.log; the result is recorded and the script goes on. A step gets its
# limit, plus whatever the earlier steps left unused beyond what the later ones are planned to
# need (so a step that runs long, generate with its variants say, takes spare time, never a
# later step's), and never more than is left of the budget.
run_step() {
    local name="$1" fn="$2" left limit spare t0 rc res
    left=$((DEADLINE - $(date +%s)))
    if ((left < 30)); then
        stamp "==> $name: not run, $left s of the budget left"
        record "$name" "not run (out of time)" 0
        return 1
    fi
    limit=${LIMIT[$name]}
    spare=$((left - 10 - $(reserved_after "$name")))
    ((spare > limit)) && limit=$spare
    ((limit > left - 10)) && limit=$((left - 10))
    stamp "==> $name (time limit ${limit} s)"
    t0=$(date +%s)
    timeout -k 10 "$limit" bash -c "$fn" 2>&1 | tee "$LOGS/$name.log"
    rc=${PIPESTATUS[0]}
    case "$rc" in
    0) res=ok ;;
    124 | 137) res="TIMED OUT after ${limit} s" ;;
    *) res="FAILED (exit $rc)" ;;
    esac
    stamp "<== $name: $res ($(($(date +%s) - t0)) s)"
    record "$name" "$res" $(($(date +%s) - t0))
    [[ "$res" == ok ]]
}

# ------------------------------------------------------------------------------ helpers
# Shell functions the steps use (exported: each step runs in its own bash under timeout).
api_gpus() { # the daemon's GPU list as JSON
    "$PY" - "$GP_HTTP" "$GP_ADMIN" <<'EOF'
import json, sys, urllib.request
req = urllib.request.Request(f"http://{sys.argv[1]}/api/v1/gpus", headers={"Authorization": f"Bearer {sys.argv[2]}"})
print(json.dumps(json.loads(urllib.request.urlopen(req, timeout=10).read())["gpus"]))
EOF
}
wait_free() { # until GPU 0 is free again (the scrub after a lease), worker started; 300 s at most
    "$PY" - "$GP_HTTP" "$GP_ADMIN" <<'EOF'
import json, sys, time, urllib.request
req = urllib.request.Request(f"http://{sys.argv[1]}/api/v1/gpus", headers={"Authorization": f"Bearer {sys.argv[2]}"})
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    g = json.loads(urllib.request.urlopen(req, timeout=10).read())["gpus"][0]
    if g["state"] == "free" and g.get("worker_ready", True):
        sys.exit(0)
    if g["state"] == "quarantined":
        sys.exit(f"GPU quarantined: {g.get('quarantine')}")
    time.sleep(0.2)
sys.exit("GPU not free after 300 s")
EOF
}
trust_env() { # the client's trust settings for the script's gpupoold: its identity pinned (TLS)
    if [[ -n "${GP_FINGERPRINT:-}" ]]; then
        echo "GPUPOOL_TLS_FINGERPRINT=$GP_FINGERPRINT"
    else
        echo "GPUPOOL_TLS=0" # a gpupoold with tls = "off" (identity none): plain TCP, said so
    fi
}
remote() { # run a command as `gpupool run` would: the shim first on LD_LIBRARY_PATH, the server pinned
    env -u GPUPOOL_TLS -u GPUPOOL_TLS_CA -u GPUPOOL_TLS_FINGERPRINT \
        LD_LIBRARY_PATH="$BUILD/client${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        GPUPOOL_SERVER="$GP_ADDRESS" GPUPOOL_TOKEN="$GP_TOKEN" GPUPOOL_CONFIG=none "$(trust_env)" "$@"
}
# both_ways NAME CHECK CMD...: CMD natively, then through gpupool, logs in $LOGS/NAME-{native,remote}.txt;
# CHECK is a function that gets the log file and says whether the run passed.
both_ways() {
    local name="$1" check="$2" side rc bad=0
    shift 2
    local t0 ms
    for side in native remote; do
        if [[ $side == native ]] && ((SMOKE)); then
            : >"$LOGS/$name-$side.txt" # no GPU here: the simulated one is only reachable through gpupool
            continue
        fi
        # Both wait for the scrub after the last lease: a native process on the GPU while it
        # checks would be taken for a leftover of the lease, and the GPU quarantined.
        wait_free || return 1
        t0=$(date +%s%3N)
        if [[ $side == native ]]; then
            timeout -k 5 "$RUN_LIMIT" "$@" >"$LOGS/$name-$side.txt" 2>&1
        else
            remote timeout -k 5 "$RUN_LIMIT" "$@" >"$LOGS/$name-$side.txt" 2>&1
        fi
        rc=$?
        ms=$(($(date +%s%3N) - t0))
        echo "$name $side $(date -u +%T) exit $rc $((ms / 1000)).$((ms % 1000 / 100)) s" >>"$LOGS/timings.txt"
        if ((rc == 0)) && "$check" "$LOGS/$name-$side.txt"; then
            echo "  $name ($side): ok ($(tail -n 1 "$LOGS/timings.txt" | awk '{print $(NF-1)}') s): $(tail -n 1 "$LOGS/$name-$side.txt" | cut -c1-150)"
        else
            echo "  $name ($side): FAILED (exit $rc); last lines:"
            tail -n 15 "$LOGS/$name-$side.txt" | sed 's/^/    /'
            bad=1
        fi
    done
    return "$bad"
}
last_line_pass() { tail -n 1 "$1" | grep -q '^PASS '; }
device_info_ok() { tail -n 1 "$1" | "$PY" -c 'import json,sys; d=json.loads(sys.stdin.read()); sys.exit("error" in d or not d.get("is_available"))'; }
export -f api_gpus wait_free trust_env remote both_ways last_line_pass device_info_ok stamp

# ------------------------------------------------------------------------------ steps
step_info() {
    local bad=0
    echo "date: $(date -u)"
    echo "commit: $COMMIT"
    echo "host: $(uname -a)"
    echo "runtime: $RUNTIME"
    nvidia-smi -L || bad=1
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,pci.bus_id,compute_cap,temperature.gpu \
        --format=csv
    nvidia-smi # the status table: processes already on the GPU, if any
    echo "python: $("$PY" --version 2>&1) ($(command -v "$PY"))"
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "available", torch.cuda.is_available())'
    for m in triton cupy jax numba cuda.bindings aiohttp pynvml prometheus_client jinja2; do
        "$PY" -c "import $m; print('$m', getattr($m, '__version__', '?'))" 2>/dev/null || echo "$m: not importable"
    done
    if command -v nvcc >/dev/null; then nvcc --version | tail -n 2; else echo "nvcc: not on PATH"; fi
    return "$bad"
}
step_build() {
    # The binaries --prepare made on the developer's machine, if each loads here (same glibc and
    # OpenSSL line); else the whole tree with every core.
    if [[ -f "$PREPARED/PREPARED" ]]; then
        local f missing=""
        for f in "$BUILD/gpupool-worker" "$BUILD/gpupool-scrub" "$BUILD/client/libcuda.so.1" \
            "$BUILD/client/libnvidia-ml.so.1" "$BUILD/bench/bench_client"; do
            if [[ ! -e "$f" ]] || ldd "$f" 2>&1 | grep -q "not found"; then missing+=" $f"; fi
        done
        if [[ -z "$missing" ]]; then
            echo "using the prepared binaries: $(cat "$PREPARED/PREPARED")"
            return 0
        fi
        echo "prepared binaries do not load here (${missing# }): building"
        rm -rf "$PREPARED"
    fi
    make -j"$JOBS" BUILD="$BUILD"
}
step_cuda() {
    local dir="$PREPARED/cuda" p bad=0 args
    if [[ ! -f "$PREPARED/PREPARED" ]]; then
        dir="$WORK/cuda"
        compile_cuda "$dir" || return 1
    fi
    for p in $CUDA_PROGRAMS_LIST; do
        args=()
        [[ $p == errors ]] && args=(--no-bogus-handles) # bogus handles crash a real driver
        [[ $p == modules ]] && args=("$dir/modules.cubin" "$dir/modules.fatbin" "$dir/modules.ptx")
        both_ways "cuda-$p" last_line_pass "$dir/$p" "${args[@]}" || bad=1
    done
    # What the shim reports about the device next to what the driver reports (not a pass/fail).
    ((SMOKE)) && return "$bad"
    diff <(grep '^dev' "$LOGS/cuda-devices-native.txt") <(grep '^dev' "$LOGS/cuda-devices-remote.txt") \
        >"$LOGS/cuda-devices.diff"
    echo "  devices: $(grep -c '^<' "$LOGS/cuda-devices.diff") property lines differ natively vs through gpupool (logs/cuda-devices.diff)"
    return "$bad"
}
step_torch_scripts() {
    local s bad=0
    export TRITON_CACHE_DIR="$WORK/triton-cache"
    both_ways torch-device_info device_info_ok "$PY" tests/torch_scripts/device_info.py || bad=1
    local scripts=(runtime transfers blas_init triton_probe)
    [[ -f tests/torch_scripts/graph_capture.py ]] && scripts+=(graph_capture) # where present
    for s in "${scripts[@]}"; do
        both_ways "torch-$s" last_line_pass "$PY" "tests/torch_scripts/$s.py" || bad=1
    done
    if [[ -f tests/torch_scripts/memory_backends.py ]]; then # PyTorch's two other allocators
        both_ways torch-memory-expandable last_line_pass env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
            "$PY" tests/torch_scripts/memory_backends.py expandable || bad=1
        both_ways torch-memory-async last_line_pass env PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync \
            "$PY" tests/torch_scripts/memory_backends.py async || bad=1
    fi
    return "$bad"
}
step_frameworks() { # other users of the driver API, each checking its own results
    local s mod bad=0 ran=0
    export XLA_PYTHON_CLIENT_PREALLOCATE=false CUPY_CACHE_DIR="$WORK/cupy-cache" NUMBA_CACHE_DIR="$WORK/numba-cache"
    # name:module:script[:argument]; the *_client programs are the simulated-device tier's
    # (tests/test_e2e_python_clients.py), here checked against the real GPU too.
    local entry name script arg
    for entry in cupy:cupy:cupy_probe numba:numba.cuda:numba_probe jax:jax:jax_probe \
            cuda_python:cuda.bindings:cuda_python_probe \
            cuda_python_driver:cuda.bindings:cuda_python_client:--api=driver \
            cuda_python_runtime:cuda.bindings:cuda_python_client:--api=runtime \
            pycuda:pycuda.driver:pycuda_client; do
        IFS=: read -r name mod script arg <<<"$entry"
        if ! "$PY" -c "import $mod" 2>/dev/null; then
            echo "  $name: $mod is not installed here: skipped"
            continue
        fi
        ran=$((ran + 1))
        # GPUPOOL_PROFILE: read by the shim only (the remote run); it counts each export-table slot's calls.
        mkdir -p "$LOGS/profile"
        both_ways "fw-$name" last_line_pass env GPUPOOL_PROFILE="$LOGS/profile/fw-$name.txt" \
            "$PY" "tests/framework_scripts/$script.py" ${arg:+"$arg"} || bad=1
    done
    ((ran > 0)) || { echo "  no framework installed"; return 1; }
    export_table_slots
    return "$bad"
}
# What the frameworks asked of export tables the shim does not implement, slot by slot: the
# trampolines print `gpupool: export table UUID slot N called (returned ...)` once per slot and
# process (a known table's unexpected slot says the table's name instead of its UUID).
export_table_slots() {
    local f hits
    for f in "$LOGS"/fw-*-remote.txt; do
        [[ -e "$f" ]] || continue
        hits=$(grep -oE 'gpupool: export table [^ ]+ slot [0-9]+ called( \([^)]*\))?' "$f" | sort -u |
            sed -E 's/^gpupool: export table ([^ ]+) slot ([0-9]+) called ?/\1 slot \2 /')
        [[ -n "$hits" ]] || continue
        echo "  $(basename "$f" -remote.txt): export-table slots called:"
        echo "$hits" | sed 's/^/    /'
    done | tee "$LOGS/export-table-slots.txt"
}
export -f export_table_slots
step_remoting() {
    local quick=(--quick)
    ((LONG)) && quick=()
    wait_free || return 1
    env -u GPUPOOL_TLS -u GPUPOOL_TLS_CA -u GPUPOOL_TLS_FINGERPRINT GPUPOOL_TOKEN="$GP_TOKEN" "$(trust_env)" \
        "$PY" bench/remoting_bench.py --no-build --server "$GP_ADDRESS" "${quick[@]}" \
        --json "$OUT/remoting.json" --markdown "$LOGS/remoting.md"
}
# A check of bench/gpu_checks.py (its own gpupoold on the real GPU); its JSON into the logs.
step_sandbox() {
    local dir="$PREPARED/cuda"
    if [[ ! -f "$PREPARED/PREPARED" ]]; then
        dir="$WORK/cuda"
        compile_cuda "$dir" || return 1
    fi
    TRITON_CACHE_DIR="$WORK/triton-cache" "$PY" bench/gpu_checks.py sandbox --cuda-dir "$dir" --limit 30 \
        --json "$LOGS/sandbox.json"
}
step_detach() { "$PY" bench/gpu_checks.py detach --sizes 1G,8G --limit 60 --json "$LOGS/detach.json"; }
step_busy() { "$PY" bench/gpu_checks.py busy --seconds 4 --limit 40 --json "$LOGS/busy.json"; }
# shellcheck disable=SC2046 # the arguments are words without spaces
step_shares() { "$PY" bench/gpu_checks.py shares $(shares_args) --json "$LOGS/shares.json"; }
# shellcheck disable=SC2046
step_ipc() { "$PY" bench/gpu_checks.py ipc $(ipc_args) --json "$LOGS/ipc.json"; }
# workload NAME ARGS...: one of bench/torch_workloads.py's workloads native vs gpupool, its remote
# profile in $LOGS/profile, its JSON and markdown in the logs.
workload() {
    local name="$1"
    shift
    GPUPOOL_PROFILE_DIR="$LOGS/profile" "$PY" bench/torch_workloads.py --only "$name" "$@" --build-dir "$BUILD" \
        --child-timeout "$RUN_LIMIT" --json "$LOGS/$name.json" --markdown "$LOGS/$name.md" --log-dir "$LOGS/$name"
}
# The generate A/B variants (default, TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1, cuDNN SDPA off) are
# bench/torch_workloads.py's own business; this step only gives them their place and time.
step_generate() { workload generate --quick; }
step_cuda_graph() { workload cuda_graph --steps 100 --warmup 10; } # 500 by default: 100 is enough for a ratio
step_compile() { workload compile --steps 20 --warmup 3; }         # the compile itself is most of the time
export -f workload
step_restart() { # a PyTorch training job keeps its GPU across gpupoold restarts
    "$PY" bench/restart_check.py --real --seconds "$RESTART_SECONDS" --json "$OUT/restart.json"
}
step_workloads() {
    # Quick: a fifth of the steps; what finished is reported when the time limit stops the rest.
    local quick=(--quick --only mlp,cnn,gpt) # generate, cuda_graph and compile are steps of their own
    ((LONG)) && quick=()
    GPUPOOL_PROFILE_DIR="$LOGS/profile" "$PY" bench/torch_workloads.py "${quick[@]}" --build-dir "$BUILD" \
        --child-timeout "$((RUN_LIMIT * 2))" --json "$OUT/workloads.json" --markdown "$LOGS/workloads.md" \
        --log-dir "$LOGS/workloads"
}
export -f step_info step_build step_cuda step_torch_scripts step_frameworks step_remoting step_restart step_workloads \
    step_sandbox step_detach step_busy step_generate step_cuda_graph step_compile step_shares step_ipc shares_args ipc_args

# ------------------------------------------------------------------------------ gpupoold
DAEMON_PID=""
start_daemon() { # in this shell (not under timeout): its own session, stopped at exit
    local state="$WORK/gpupoold" deadline t0 limit=${LIMIT[daemon]}
    t0=$(date +%s)
    stamp "==> daemon: gpupoold on the real GPU 0, reset_policy never"
    mkdir -p "$state"
    # Never reset a lent GPU: reset_policy = "never" (and no reset helper runs).
    printf 'simulated = 0\ngpus = [0]\nreset_policy = "never"\n' >"$state/gpupoold.toml"
    if [[ "${GPUPOOL_VALIDATION_SANDBOX_OFF:-}" == 1 ]]; then # the sandbox step found it breaks the driver
        echo "  worker_sandbox = false: the sandbox step found that it breaks the driver (see above)"
        echo 'worker_sandbox = false' >>"$state/gpupoold.toml"
    fi
    # Without a GPU gpupoold refuses to start, unless told to serve a simulated one instead:
    # only to try the script's machinery (--smoke), never for a recorded validation.
    if [[ "${GPUPOOL_VALIDATION_ALLOW_SIMULATED:-}" == 1 ]]; then
        echo 'fallback_to_simulated = true' >>"$state/gpupoold.toml"
    fi
    PYTHONPATH="$PWD:$PWD/protocol/python${PYTHONPATH:+:$PYTHONPATH}" setsid "$PY" -m gpupoold serve \
        --config "$state/gpupoold.toml" --listen 127.0.0.1:0 --http 127.0.0.1:0 --state-dir "$state" \
        --worker "$BUILD/gpupool-worker" >"$LOGS/gpupoold.log" 2>&1 </dev/null &
    DAEMON_PID=$!
    deadline=$(($(date +%s) + limit))
    GP_ADDRESS="" GP_HTTP=""
    while (($(date +%s) < deadline)); do
        GP_ADDRESS=$(sed -n 's/^gpupoold: remoting on //p' "$LOGS/gpupoold.log" | head -n 1)
        GP_HTTP=$(sed -n 's/^gpupoold: http on //p' "$LOGS/gpupoold.log" | head -n 1)
        [[ -n "$GP_ADDRESS" && -n "$GP_HTTP" ]] && break
        kill -0 "$DAEMON_PID" 2>/dev/null || break
        sleep 0.2
    done
    if [[ -z "$GP_ADDRESS" || -z "$GP_HTTP" ]]; then
        tail -n 30 "$LOGS/gpupoold.log"
        if grep -q '^gpupoold: error: no GPU to serve' "$LOGS/gpupoold.log"; then
            echo "  gpupoold serves no real GPU (no driver?): it refused to start (above); nothing to validate"
            record daemon "FAILED (no real GPU served)" $(($(date +%s) - t0))
        else
            record daemon "FAILED (gpupoold did not start)" $(($(date +%s) - t0))
        fi
        return 1
    fi
    # The identity its clients pin (`gpupoold: identity SHA256:...`; `identity none` with tls = "off").
    GP_FINGERPRINT=$(sed -n 's/^gpupoold: identity \(SHA256:[^ ]*\).*/\1/p' "$LOGS/gpupoold.log" | head -n 1)
    if ! grep -q '^gpupoold: identity ' "$LOGS/gpupoold.log"; then
        tail -n 30 "$LOGS/gpupoold.log"
        record daemon "FAILED (gpupoold printed no identity)" $(($(date +%s) - t0))
        return 1
    fi
    GP_TOKEN=$(PYTHONPATH="$PWD:$PWD/protocol/python" "$PY" -m gpupoold token create --name validation \
        --state-dir "$state" 2>>"$LOGS/gpupoold.log" | tail -n 1)
    GP_ADMIN=$(cat "$state/local-admin.token")
    export GP_ADDRESS GP_HTTP GP_TOKEN GP_ADMIN GP_FINGERPRINT
    local gpus
    gpus=$(api_gpus)
    echo "  gpupoold on $GP_ADDRESS (http $GP_HTTP), identity ${GP_FINGERPRINT:-none (plain TCP)}: $gpus" | cut -c1-400
    # GPUPOOL_VALIDATION_ALLOW_SIMULATED=1: only to try the script's machinery on a machine
    # without a GPU (its native runs then fail); never for a recorded validation.
    if [[ "$gpus" == "[]" || ("$gpus" == *'"simulated": true'* && "${GPUPOOL_VALIDATION_ALLOW_SIMULATED:-}" != 1) ]]; then
        echo "  gpupoold serves no real GPU (no driver?): refusing to validate against a simulated one"
        record daemon "FAILED (no real GPU served)" $(($(date +%s) - t0))
        return 1
    fi
    if ! wait_free; then
        record daemon "FAILED (GPU not free)" $(($(date +%s) - t0))
        return 1
    fi
    stamp "<== daemon: ok"
    record daemon ok $(($(date +%s) - t0))
}
stop_daemon() {
    [[ -n "$DAEMON_PID" ]] || return 0
    kill -TERM -- "-$DAEMON_PID" 2>/dev/null
    for _ in $(seq 1 100); do
        kill -0 "$DAEMON_PID" 2>/dev/null || break
        sleep 0.2
    done
    kill -KILL -- "-$DAEMON_PID" 2>/dev/null
    DAEMON_PID=""
    # A gpupoold that fell back to a simulated GPU (refused above) left its memory in /dev/shm.
    PYTHONPATH="$PWD" "$PY" -c 'import shutil, sys; from pathlib import Path; from gpupoold.gpu.sim import sim_memory_dir
shutil.rmtree(sim_memory_dir(Path(sys.argv[1])), ignore_errors=True)' "$WORK/gpupoold" 2>/dev/null
}
finish() {
    stop_daemon
    write_summary
    rm -rf "$WORK" # everything worth keeping is in $OUT (logs.tar.gz)
}
trap finish EXIT

# ------------------------------------------------------------------------------ main
stamp "gpu-validation.sh: GPU $GPU_NAME, driver $GPU_DRIVER, commit $COMMIT; budget $BUDGET s; logs in $OUT"
[[ -n "$(left_out)" ]] && stamp "left out of this call (they do not fit; --long or --only): $(left_out)"
for s in $(plan_steps); do
    case "$s" in
    daemon)
        if [[ ! -x $BUILD/gpupool-worker || ! -e $BUILD/client/libcuda.so.1 ]]; then
            stamp "no $BUILD/gpupool-worker or $BUILD/client/libcuda.so.1: the gpupool steps cannot run"
            record daemon "FAILED (not built)" 0
        else
            start_daemon || stop_daemon # a daemon that failed to start serves no step
        fi
        ;;
    stop-daemon) stop_daemon ;;
    cuda | torch-scripts | frameworks | remoting) # the script's own gpupoold
        if [[ -n "$DAEMON_PID" ]]; then
            run_step "$s" "step_${s//-/_}"
        else
            record "$s" "not run (no gpupoold)" 0
        fi
        ;;
    sandbox)
        run_step sandbox step_sandbox
        # When the sandbox breaks the driver, the later steps run without it, so that they tell
        # about everything else (their gpupoold configurations say worker_sandbox = false).
        if grep -q '^sandbox: THE SANDBOX BREAKS THE DRIVER' "$LOGS/sandbox.log" 2>/dev/null; then
            export GPUPOOL_VALIDATION_SANDBOX_OFF=1
            stamp "the later steps run with worker_sandbox = false (bench/torch_workloads.py's own gpupoold keeps the default)"
        fi
        ;;
    build)
        # The plan counts on the prepared binaries (20 s). Without them the build is what every
        # later step needs: it gets up to 240 s, taken from the last steps, and says so.
        if [[ ! -f "$PREPARED/PREPARED" ]]; then
            LIMIT[build]=240
            stamp "nothing prepared (scripts/gpu-validation.sh --prepare): the build may take 240 s from the last steps"
        fi
        run_step build step_build
        ;;
    *) run_step "$s" "step_${s//-/_}" ;; # info, or a step that starts its own gpupoold
    esac
done

stamp "summary:"
for r in "${RESULTS[@]}"; do
    IFS='|' read -r s res secs <<<"$r"
    printf '    %-14s %-34s %5ss\n' "$s" "$res" "$secs"
done
if ((FAILED)); then
    stamp "gpu-validation.sh: FAILED (see $OUT/summary.md)"
    exit 1
fi
stamp "gpu-validation.sh: every step passed ($OUT/summary.md)"
