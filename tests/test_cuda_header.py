"""cudaapi/gp_cuda.h against the toolkit's cuda.h: every constant, size and offset we declare.

A probe program is generated from gp_cuda.h itself (every enumerator and every CU* / CUDA_*
object-like macro it declares), plus explicit sizeof/offsetof checks of the structures whose
layout crosses the ABI. The probe is compiled twice, once against the toolkit's cuda.h and once
against gp_cuda.h, and the two printouts must be identical. A name gp_cuda.h declares that
cuda.h does not know fails the toolkit build, which is also a failure: our header must use the
driver's names and values only.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GP_CUDA_H = REPO / "cudaapi" / "gp_cuda.h"
CUDA_INCLUDE = Path(os.environ.get("GPUPOOL_CUDA_INCLUDE", "/usr/local/cuda/include"))
CC = os.environ.get("CC", "cc")

# Structures whose layout must match the driver ABI: sizeof of each and offsetof of each member
# gp_cuda.h declares (members reached by designator, e.g. "allocFlags.usage").
LAYOUTS: dict[str, list[str]] = {
    "CUuuid": ["bytes"],
    "CUmemLocation": ["type", "id"],
    "CUmemAllocationProp": ["type", "requestedHandleTypes", "location", "location.id",
                            "win32HandleMetaData", "allocFlags", "allocFlags.compressionType",
                            "allocFlags.gpuDirectRDMACapable", "allocFlags.usage",
                            "allocFlags.reserved"],
    "CUmemAccessDesc": ["location", "flags"],
    "CUlaunchAttributeValue": ["pad", "cooperative", "clusterDim", "clusterDim.x",
                               "clusterDim.y", "clusterDim.z"],
    "CUlaunchAttribute": ["id", "pad", "value"],
    "CUcheckpointLockArgs": ["timeoutMs", "reserved0", "reserved1"],
    "CUcheckpointCheckpointArgs": ["reserved"],
    "CUcheckpointGpuPair": ["oldUuid", "newUuid"],
    "CUcheckpointRestoreArgs": ["gpuPairs", "gpuPairsCount", "reserved", "reserved1"],
    "CUcheckpointUnlockArgs": ["reserved"],
    "CUDA_MEMCPY2D": ["srcXInBytes", "srcY", "srcMemoryType", "srcHost", "srcDevice", "srcArray",
                      "srcPitch", "dstXInBytes", "dstY", "dstMemoryType", "dstHost", "dstDevice",
                      "dstArray", "dstPitch", "WidthInBytes", "Height"],
    "CUlaunchConfig": ["gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY", "blockDimZ",
                       "sharedMemBytes", "hStream", "attrs", "numAttrs"],
    "CUtensorMap": ["opaque"],
}
# Scalar and handle types whose size must match.
SIZES = ["CUresult", "CUdevice", "CUdeviceptr", "CUmemGenericAllocationHandle", "cuuint64_t",
         "cuuint32_t", "CUcontext", "CUmodule", "CUfunction", "CUlibrary", "CUkernel", "CUstream",
         "CUevent", "CUmemoryPool", "CUgraph", "CUgraphExec", "CUlinkState", "CUarray", "CUprocessState",
         "CUdriverProcAddressQueryResult", "CUdevice_attribute", "CUfunction_attribute",
         "CUlimit", "CUpointer_attribute", "CUmemorytype", "CUlaunchAttributeID",
         "CUoccupancyB2DSize", "CUjit_option", "CUlibraryOption", "CUmoduleLoadingMode",
         "CUtensorMapDataType", "CUtensorMapInterleave", "CUtensorMapSwizzle",
         "CUtensorMapL2promotion", "CUtensorMapFloatOOBfill", "CUtensorMapIm2ColWideMode"]


def require_toolkit() -> None:
    """Skip without a toolkit, except in CI, where a missing toolkit is itself a failure."""
    if (CUDA_INCLUDE / "cuda.h").is_file():
        return
    reason = f"CUDA toolkit header not found in {CUDA_INCLUDE} (set GPUPOOL_CUDA_INCLUDE)"
    if os.environ.get("CI") == "true":
        pytest.fail(reason + "; CI must have it")
    pytest.skip(reason)


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def declared_constants() -> tuple[list[str], list[str]]:
    """(enumerators, object-like CU*/CUDA_* macros) declared by gp_cuda.h."""
    text = strip_comments(GP_CUDA_H.read_text())
    enumerators: list[str] = []
    for body in re.findall(r"\benum\b[^{;]*\{([^}]*)\}", text):
        for item in body.split(","):
            m = re.match(r"\s*([A-Za-z_]\w*)\s*(?:=|$)", item)
            if m:
                enumerators.append(m.group(1))
    macros = re.findall(r"^\s*#\s*define\s+((?:CU|CUDA)_\w+)[ \t]+\S", text, re.M)
    return enumerators, macros


def build_probe() -> str:
    enumerators, macros = declared_constants()
    lines = ["#include <stddef.h>", "#include <stdint.h>", "#include <stdio.h>",
             "#ifdef PROBE_TOOLKIT", "#include <cuda.h>", "#else", '#include "gp_cuda.h"',
             "#endif", "int main(void) {"]
    for name in enumerators:
        lines.append(f'    printf("enum {name} %lld\\n", (long long)({name}));')
    for name in macros:
        lines.append(f'    printf("macro {name} %llu\\n", '
                     f"(unsigned long long)(uintptr_t)({name}));")
    for typ in SIZES:
        lines.append(f'    printf("sizeof {typ} %zu\\n", sizeof({typ}));')
    for typ, members in LAYOUTS.items():
        lines.append(f'    printf("sizeof {typ} %zu\\n", sizeof({typ}));')
        lines.append(f'    printf("alignof {typ} %zu\\n", _Alignof({typ}));')
        for member in members:
            lines.append(f'    printf("offsetof {typ}.{member} %zu\\n", offsetof({typ}, {member}));')
    lines += ["    return 0;", "}"]
    return "\n".join(lines) + "\n"


def run_probe(tmp: Path, src: Path, flags: list[str], tag: str) -> dict[str, str]:
    exe = tmp / f"probe_{tag}"
    cmd = [CC, "-std=c11", "-Wall", "-Werror", *flags, "-o", str(exe), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert res.returncode == 0, f"probe against {tag} does not compile:\n{res.stderr}"
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    values: dict[str, str] = {}
    for line in out.splitlines():
        key, value = line.rsplit(" ", 1)
        values[key] = value
    return values


def test_declared_constants_found() -> None:
    enumerators, macros = declared_constants()
    # A parser that silently found nothing would make the comparison vacuous.
    assert "CUDA_ERROR_NOT_SUPPORTED" in enumerators
    assert "CU_DEVICE_ATTRIBUTE_MAX" in enumerators
    assert "CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT" in enumerators
    assert "CU_STREAM_LEGACY" in macros and "CU_LAUNCH_PARAM_BUFFER_SIZE" in macros
    assert len(enumerators) > 100


def test_gp_cuda_h_matches_toolkit(tmp_path: Path) -> None:
    require_toolkit()
    src = tmp_path / "probe.c"
    src.write_text(build_probe())
    toolkit = run_probe(tmp_path, src, ["-DPROBE_TOOLKIT", "-I", str(CUDA_INCLUDE)], "toolkit")
    ours = run_probe(tmp_path, src, ["-I", str(GP_CUDA_H.parent)], "gp_cuda")
    assert toolkit.keys() == ours.keys()
    wrong = {k: (ours[k], toolkit[k]) for k in toolkit if ours[k] != toolkit[k]}
    assert not wrong, "gp_cuda.h value != cuda.h value: " + ", ".join(
        f"{k}: {a} != {b}" for k, (a, b) in sorted(wrong.items()))
