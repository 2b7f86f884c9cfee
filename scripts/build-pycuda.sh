#!/usr/bin/env bash
# Builds pycuda from its source distribution into a virtual environment, for the pycuda client
# tests (tests/test_e2e_python_clients.py). Called by scripts/bootstrap.sh; by hand:
#     scripts/build-pycuda.sh .venv
#
# pycuda has no wheels: it compiles against the CUDA toolkit's headers and links libcuda. Two things
# on a GPU-less machine need saying to its build (siteconf.py, pycuda's own configuration file):
#   - no cuRAND: the toolkit here has no curand.h, and the tests do not use pycuda.curandom;
#   - libcuda to link against: machines without a driver have no libcuda.so, and the toolkit's
#     stubs/ folder may be missing too. A one-symbol stub with the soname libcuda.so.1 is enough,
#     since the linker only records that name; at run time the process loads the libcuda.so.1 it
#     finds first, which under gpupool is the client shim, on a GPU server the real driver.
set -euo pipefail
VENV=${1:?usage: build-pycuda.sh VENV}
VENV=$(cd "$VENV" && pwd)   # pip builds elsewhere: every path handed to the build is absolute
VERSION=2026.1   # the version tested; change it here (bootstrap re-runs when this file changes)

# The toolkit: $CUDA_HOME, $CUDA_PATH, the folder above nvcc, /usr/local/cuda; the first with
# both bin/nvcc and include/cuda.h (an nvcc on PATH may be a wrapper script elsewhere).
cuda_root=
nvcc_dir=$(dirname "$(command -v nvcc || echo /nonexistent/nvcc)")
for c in "${CUDA_HOME:-}" "${CUDA_PATH:-}" "$nvcc_dir/.." /usr/local/cuda; do
    if [[ -n $c && -x $c/bin/nvcc && -f $c/include/cuda.h ]]; then
        cuda_root=$(cd "$c" && pwd -P)
        break
    fi
done
if [[ -z $cuda_root ]]; then
    echo "build-pycuda: no CUDA toolkit (bin/nvcc and include/cuda.h under \$CUDA_HOME, the folder" \
         "above nvcc, or /usr/local/cuda): pycuda not built, its tests will skip and say so" >&2
    exit 0
fi
nvcc=$cuda_root/bin/nvcc

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
stubs="$VENV/lib/gpupool-stubs"
mkdir -p "$stubs"
printf 'int cuInit(unsigned int flags);\nint cuInit(unsigned int flags) { (void)flags; return 3; }\n' \
    > "$work/stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so" "$work/stub.c"

echo "build-pycuda: building pycuda $VERSION against $cuda_root (first time: about 2 minutes)"
"$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
    --no-binary pycuda -d "$work" "pycuda==$VERSION"
tar -xzf "$work/pycuda-$VERSION.tar.gz" -C "$work"
cat > "$work/pycuda-$VERSION/siteconf.py" <<EOF
CUDA_ROOT = "$cuda_root"
CUDA_INC_DIR = ["$cuda_root/include"]
CUDA_ENABLE_CURAND = False
CUDADRV_LIB_DIR = ["$stubs"]
CUDADRV_LIBNAME = ["cuda"]
EOF
log="$work/build.log"
# Built against the environment's own numpy (no build isolation): an isolated build would fetch
# the newest numpy, which may come as a source distribution only, and build that first.
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check)
if ! "${pip[@]}" --quiet setuptools wheel numpy > "$log" 2>&1 ||
        ! PATH="$(dirname "$nvcc"):$PATH" "${pip[@]}" --no-build-isolation \
        "$work/pycuda-$VERSION" >> "$log" 2>&1; then
    grep -E "error:|Error:|fatal|cannot find" "$log" | tail -20 >&2
    echo "build-pycuda: pycuda $VERSION failed to build (the lines above are from its log)" >&2
    exit 1
fi
"$VENV/bin/python" - <<'EOF'
import importlib.util
spec = importlib.util.find_spec("pycuda._driver")
assert spec is not None, "pycuda._driver is missing after the build"
print(f"build-pycuda: installed {spec.origin}")
EOF
