#!/usr/bin/env bash
# `make demo`: gpupoold on one simulated GPU (loopback, free ports), a CUDA program run through it
# with `gpupool run`, what both sides saw, then a clean stop.
# The program is tests/cuda/demo.cu built with nvcc; without nvcc, scripts/demo_client.py
# (PyTorch through the shim). `scripts/demo.sh --torch` runs the PyTorch one.
set -euo pipefail
cd "$(dirname "$0")/.."

use_torch=0
[[ "${1:-}" == "--torch" ]] && use_torch=1

if [[ -t 1 ]]; then
    bold() { printf '\n\033[1m%s\033[0m\n' "$*"; }
else
    bold() { printf '\n%s\n' "$*"; }
fi

bold "1. Setting up (.venv, native build)"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [[ $use_torch == 1 || ! -x $NVCC ]]; then
    scripts/bootstrap.sh  # the PyTorch client: the full set-up
else
    scripts/bootstrap.sh --demo  # only the daemon and the client: no test tools, no PyTorch
fi
make -s -j2 native
client=(.venv/bin/python scripts/demo_client.py)
if [[ $use_torch == 0 && -x $NVCC && -f tests/cuda/demo.cu ]]; then
    mkdir -p build/demo
    stale=0
    for src in tests/cuda/demo.cu tests/cuda/gp_check.cuh tests/sim/gp_test_kernels.cuh; do
        [[ build/demo/demo -nt $src ]] || stale=1
    done
    if [[ $stale == 1 ]]; then
        echo "nvcc tests/cuda/demo.cu -> build/demo/demo"
        "$NVCC" -O2 -arch=sm_90 -o build/demo/demo tests/cuda/demo.cu
    fi
    client=(build/demo/demo)
fi

state=$(mktemp -d /tmp/gpupool-demo.XXXXXX)
log=$state/gpupoold.log
daemon=
cleanup() {
    if [[ -n $daemon ]] && kill -0 "$daemon" 2>/dev/null; then kill -KILL "$daemon" 2>/dev/null; fi
    rm -rf "$state"
}
trap cleanup EXIT

bold "2. Starting gpupoold with one SIMULATED GPU"
.venv/bin/gpupoold serve --simulated 1 --listen 127.0.0.1:0 --http 127.0.0.1:0 \
    --state-dir "$state" >"$log" 2>&1 &
daemon=$!
for _ in $(seq 200); do
    grep -q '^gpupoold: http on ' "$log" && break
    kill -0 "$daemon" 2>/dev/null || { cat "$log"; echo "demo: gpupoold failed to start"; exit 1; }
    sleep 0.05
done
server=$(sed -n 's/^gpupoold: remoting on //p' "$log")
http=$(sed -n 's/^gpupoold: http on //p' "$log")
[[ -n $server && -n $http ]] || { cat "$log"; echo "demo: gpupoold did not start"; exit 1; }
echo "remoting listener: $server     HTTP API: http://$http"
# The remoting port speaks TLS with the identity gpupoold made at its first start: clients pin
# its fingerprint (on a real network: `gpupool login HOST:PORT`, which shows it and asks).
echo "\$ gpupoold fingerprint --state-dir $state"
fingerprint=$(.venv/bin/gpupoold fingerprint --state-dir "$state")
echo "$fingerprint  (the server's identity: the client pins it, GPUPOOL_TLS_FINGERPRINT)"
echo "\$ gpupoold token create --name demo"
token=$(.venv/bin/gpupoold token create --name demo --state-dir "$state" 2>/dev/null)
echo "${token:0:20}...  (the client's GPUPOOL_TOKEN)"
for _ in $(seq 300); do  # the GPU is scrubbed once at start before its first lease
    .venv/bin/gpupoold status --state-dir "$state" --http "$http" 2>/dev/null | grep -q ' free ' && break
    sleep 0.05
done
echo "\$ gpupoold status"
.venv/bin/gpupoold status --state-dir "$state" --http "$http"

bold "3. Running a CUDA program through gpupool: gpupool run -- ${client[*]}"
echo "(GPUPOOL_SERVER=$server, pinned to $fingerprint; the program is unmodified: its CUDA"
echo " calls go over TCP, encrypted with TLS)"
set +e
GPUPOOL_SERVER=$server GPUPOOL_TOKEN=$token GPUPOOL_TLS_FINGERPRINT=$fingerprint \
    .venv/bin/gpupool run -- "${client[@]}"
status=$?
set -e

bold "4. What gpupoold saw"
grep -E 'identity|TLS|lease|scrub|clean' "$log" | sed 's/^/  /' || true
for _ in $(seq 300); do  # the lease's record gets its scrub result once the GPU is clean
    .venv/bin/gpupoold status --state-dir "$state" --http "$http" 2>/dev/null | grep -q ' free ' && break
    sleep 0.05
done
echo "\$ gpupoold status"
.venv/bin/gpupoold status --state-dir "$state" --http "$http"

bold "5. Stopping gpupoold (SIGTERM)"
kill -TERM "$daemon"
wait "$daemon" && echo "gpupoold stopped cleanly (exit status 0)" || echo "gpupoold exit status $?"
daemon=

if [[ $status -ne 0 ]]; then
    echo; echo "demo: the client program failed (exit status $status)"; exit "$status"
fi
echo; echo "demo: done. Everything above ran on a SIMULATED GPU (no GPU on this machine needed)."
