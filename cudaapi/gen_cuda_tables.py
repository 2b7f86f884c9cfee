#!/usr/bin/env python3
"""Generate the shim's symbol tables from the CUDA toolkit's cuda.h and cudaTypedefs.h (with
cudaProfiler.h and cudaProfilerTypedefs.h: libcuda also exports the profiler-control functions).

Outputs, under ROOT/client/shim/generated/ (all marked DO NOT EDIT with the inputs' SHA-256):
  gp_symbols.txt          every cu* function name the shim exports, one per line, sorted
  gp_stubs.c              a weak default definition of each of them (returns NOT_SUPPORTED, logs once)
  gp_procaddr_table.c     the cuGetProcAddress table (base name, CUDA version, ptds flag, function)
                          plus a sorted name -> function array of every exported symbol
  gp_errors.c             CUresult -> name and short description
  gp_cuda_tables.h        the declarations the three C files and client/shim/procaddr.c share

How the cuGetProcAddress table is derived (see docs in cudaapi/procaddr_overrides.toml):
  * cuda.h is preprocessed three times (default, CUDA_API_PER_THREAD_DEFAULT_STREAM,
    __CUDA_API_VERSION_INTERNAL) and every CUresult-returning cu* function declared in any of them
    is exported, including the legacy v1 names and the _ptsz/_ptds variants.
  * cudaTypedefs.h (preprocessed with __CUDA_API_VERSION_INTERNAL, with and without per-thread
    default stream, so the legacy typedef block is included) names each API revision as
    PFN_<base>_v<version>[_ptds|_ptsz].  For one base, its non-ptds versions in ascending order map
    onto the declared names base, base_v2, base_v3, ...  A _ptds/_ptsz typedef at version V maps to
    <the non-ptds symbol in force at V> + suffix, which must be declared.
  * Where that rule does not fit, procaddr_overrides.toml says what to do, with a reason; an
    override that no longer applies is itself an error.
  * The result is checked against cuda.h's own macros (what `cuFoo` expands to at CUDA_VERSION),
    against a few measured facts, and for consistency of the per-thread variants.

The generator stops at the first inconsistency and writes nothing: a half-right table would send
programs into functions with the wrong signature, which is far worse than a build failure.

Usage: gen_cuda_tables.py [--cuda-include DIR] [--out-dir ROOT] [--overrides FILE] [--cc CC]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GEN_SUBDIR = Path("client/shim/generated")
SCRIPT_NAME = "cudaapi/gen_cuda_tables.py"

# Preprocessor configurations of cuda.h whose declarations together make up the exported set.
DECL_CONFIGS: dict[str, list[str]] = {
    "default": [],
    "ptds": ["-DCUDA_API_PER_THREAD_DEFAULT_STREAM"],
    "internal": ["-D__CUDA_API_VERSION_INTERNAL"],
}
# cudaTypedefs.h: the legacy typedefs only exist with __CUDA_API_VERSION_INTERNAL.
TYPEDEF_CONFIGS: dict[str, list[str]] = {
    "internal": ["-D__CUDA_API_VERSION_INTERNAL"],
    "internal+ptds": ["-D__CUDA_API_VERSION_INTERNAL", "-DCUDA_API_PER_THREAD_DEFAULT_STREAM"],
}
# libcuda.so.1 exports cuProfilerInitialize/Start/Stop too, declared apart from cuda.h (pycuda
# links them; cudart's cudaProfilerStart asks cuGetProcAddress for them).
PROFILER_DECLS = "#include <cudaProfiler.h>"
PROFILER_TYPEDEFS = "#include <cudaProfilerTypedefs.h>"
# Configurations in which a program sees cuda.h's name macros (for the macro cross-check).
MACRO_CONFIGS: dict[str, tuple[list[str], bool]] = {
    "default": ([], False),
    "ptds": (["-DCUDA_API_PER_THREAD_DEFAULT_STREAM"], True),
}

# Graphics interop lives in cudaGL.h / cudaEGL.h / cudaVDPAU.h (and D3D on Windows); none of it
# may leak into the exported set, because a program that finds such a name expects it to work.
GRAPHICS_PREFIXES = ("cuGL", "cuEGL", "cuVDPAU", "cuWGL", "cuD3D", "cuGraphicsGL", "cuGraphicsEGL",
                     "cuGraphicsVDPAU", "cuGraphicsD3D")

# Measured facts (docs: shared/research/driver-shim-facts.md section 2): the table must give these
# answers, or cudart 13 calls a function with the wrong signature.  (base, version, ptds, symbol)
FACTS: list[tuple[str, int, bool, str | None]] = [
    ("cuCtxGetDevice", 13000, False, "cuCtxGetDevice_v2"),
    ("cuCtxGetDevice", 12090, False, "cuCtxGetDevice"),
    ("cuCtxSynchronize", 13000, False, "cuCtxSynchronize_v2"),
    ("cuEventElapsedTime", 12080, False, "cuEventElapsedTime_v2"),
    ("cuMemAlloc", 3020, False, "cuMemAlloc_v2"),
    ("cuMemAlloc", 13000, False, "cuMemAlloc_v2"),
    ("cuDeviceGetUuid", 9020, False, "cuDeviceGetUuid"),
    ("cuDeviceGetUuid", 11040, False, "cuDeviceGetUuid_v2"),
    ("cuDevicePrimaryCtxRelease", 11000, False, "cuDevicePrimaryCtxRelease_v2"),
    ("cuDevicePrimaryCtxRelease", 10020, False, "cuDevicePrimaryCtxRelease"),
    ("cuGetProcAddress", 11030, False, "cuGetProcAddress"),
    ("cuGetProcAddress", 12000, False, "cuGetProcAddress_v2"),
    ("cuMemcpyHtoD", 13000, True, "cuMemcpyHtoD_v2_ptds"),
    ("cuMemcpyDtoHAsync", 13000, False, "cuMemcpyDtoHAsync_v2"),
    ("cuLaunchKernel", 13000, True, "cuLaunchKernel_ptsz"),
    ("cuDeviceGetUuid", 9010, False, None),
]

# Short descriptions of each CUresult, in our own words.  Names and values come from cuda.h; a
# code without a description here stops the generator so that a newer toolkit cannot silently
# produce "unknown" strings.
ERROR_TEXT: dict[str, str] = {
    "CUDA_SUCCESS": "no error",
    "CUDA_ERROR_INVALID_VALUE": "an argument is out of range or invalid",
    "CUDA_ERROR_OUT_OF_MEMORY": "out of memory",
    "CUDA_ERROR_NOT_INITIALIZED": "the driver is not initialized (call cuInit first)",
    "CUDA_ERROR_DEINITIALIZED": "the driver is shutting down",
    "CUDA_ERROR_PROFILER_DISABLED": "the profiler is disabled for this run",
    "CUDA_ERROR_PROFILER_NOT_INITIALIZED": "profiler not initialized (deprecated code)",
    "CUDA_ERROR_PROFILER_ALREADY_STARTED": "profiler already started (deprecated code)",
    "CUDA_ERROR_PROFILER_ALREADY_STOPPED": "profiler already stopped (deprecated code)",
    "CUDA_ERROR_STUB_LIBRARY": "the loaded libcuda is a stub, not a working driver",
    "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER": "this call needs a newer driver",
    "CUDA_ERROR_DEVICE_UNAVAILABLE": "the device is unavailable",
    "CUDA_ERROR_NO_DEVICE": "no CUDA device is available",
    "CUDA_ERROR_INVALID_DEVICE": "invalid device ordinal",
    "CUDA_ERROR_DEVICE_NOT_LICENSED": "the device is not licensed for this operation",
    "CUDA_ERROR_INVALID_IMAGE": "the device code image is invalid",
    "CUDA_ERROR_INVALID_CONTEXT": "invalid or missing context",
    "CUDA_ERROR_CONTEXT_ALREADY_CURRENT": "the context is already current (deprecated code)",
    "CUDA_ERROR_MAP_FAILED": "mapping failed",
    "CUDA_ERROR_UNMAP_FAILED": "unmapping failed",
    "CUDA_ERROR_ARRAY_IS_MAPPED": "the array is mapped and cannot be destroyed",
    "CUDA_ERROR_ALREADY_MAPPED": "the resource is already mapped",
    "CUDA_ERROR_NO_BINARY_FOR_GPU": "no device code for this GPU in the image",
    "CUDA_ERROR_ALREADY_ACQUIRED": "the resource is already acquired",
    "CUDA_ERROR_NOT_MAPPED": "the resource is not mapped",
    "CUDA_ERROR_NOT_MAPPED_AS_ARRAY": "the resource is not mapped as an array",
    "CUDA_ERROR_NOT_MAPPED_AS_POINTER": "the resource is not mapped as a pointer",
    "CUDA_ERROR_ECC_UNCORRECTABLE": "uncorrectable ECC error",
    "CUDA_ERROR_UNSUPPORTED_LIMIT": "this limit is not supported by the device",
    "CUDA_ERROR_CONTEXT_ALREADY_IN_USE": "the context is already in use by another thread",
    "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED": "peer access is not supported between these devices",
    "CUDA_ERROR_INVALID_PTX": "PTX compilation failed",
    "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT": "invalid graphics interop context",
    "CUDA_ERROR_NVLINK_UNCORRECTABLE": "uncorrectable NVLink error",
    "CUDA_ERROR_JIT_COMPILER_NOT_FOUND": "the PTX JIT compiler is not available",
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION": "the PTX version is not supported by this driver",
    "CUDA_ERROR_JIT_COMPILATION_DISABLED": "JIT compilation is disabled",
    "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY": "the execution affinity type is not supported",
    "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC": "device-side synchronisation is not supported here",
    "CUDA_ERROR_CONTAINED": "a contained device error occurred",
    "CUDA_ERROR_INVALID_SOURCE": "invalid device code source",
    "CUDA_ERROR_FILE_NOT_FOUND": "file not found",
    "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND": "shared object symbol not found",
    "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED": "shared object initialisation failed",
    "CUDA_ERROR_OPERATING_SYSTEM": "an operating system call failed",
    "CUDA_ERROR_INVALID_HANDLE": "invalid handle",
    "CUDA_ERROR_ILLEGAL_STATE": "the resource is in a state that forbids this call",
    "CUDA_ERROR_LOSSY_QUERY": "the query result would lose information",
    "CUDA_ERROR_NOT_FOUND": "named symbol not found",
    "CUDA_ERROR_NOT_READY": "the operation has not completed yet",
    "CUDA_ERROR_ILLEGAL_ADDRESS": "a kernel accessed an illegal address",
    "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES": "too many resources requested for the launch",
    "CUDA_ERROR_LAUNCH_TIMEOUT": "the kernel ran past the watchdog timeout",
    "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING": "incompatible texturing mode for the launch",
    "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED": "peer access is already enabled",
    "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED": "peer access is not enabled",
    "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE": "the primary context is already active",
    "CUDA_ERROR_CONTEXT_IS_DESTROYED": "the context has been destroyed",
    "CUDA_ERROR_ASSERT": "a device-side assert failed",
    "CUDA_ERROR_TOO_MANY_PEERS": "too many peer mappings",
    "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED": "host memory is already registered",
    "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED": "host memory is not registered",
    "CUDA_ERROR_HARDWARE_STACK_ERROR": "a kernel hit a hardware stack error",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION": "a kernel executed an illegal instruction",
    "CUDA_ERROR_MISALIGNED_ADDRESS": "a kernel used a misaligned address",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE": "a kernel used an address in the wrong address space",
    "CUDA_ERROR_INVALID_PC": "a kernel reached an invalid program counter",
    "CUDA_ERROR_LAUNCH_FAILED": "the kernel launch failed",
    "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE": "the cooperative launch has too many blocks",
    "CUDA_ERROR_TENSOR_MEMORY_LEAK": "a kernel exited without releasing tensor memory",
    "CUDA_ERROR_NOT_PERMITTED": "operation not permitted",
    "CUDA_ERROR_NOT_SUPPORTED": "operation not supported",
    "CUDA_ERROR_SYSTEM_NOT_READY": "the system is not ready for CUDA",
    "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH": "driver and kernel module versions do not match",
    "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE": "forward compatibility is not supported on this device",
    "CUDA_ERROR_MPS_CONNECTION_FAILED": "cannot connect to the MPS server",
    "CUDA_ERROR_MPS_RPC_FAILURE": "an MPS remote call failed",
    "CUDA_ERROR_MPS_SERVER_NOT_READY": "the MPS server is not ready",
    "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED": "the MPS server has too many clients",
    "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED": "the MPS server has too many connections",
    "CUDA_ERROR_MPS_CLIENT_TERMINATED": "the MPS client was terminated",
    "CUDA_ERROR_CDP_NOT_SUPPORTED": "dynamic parallelism is not supported here",
    "CUDA_ERROR_CDP_VERSION_MISMATCH": "dynamic parallelism version mismatch",
    "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED": "the operation is not allowed while capturing",
    "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED": "the stream capture was invalidated",
    "CUDA_ERROR_STREAM_CAPTURE_MERGE": "the operation would merge two captures",
    "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED": "the capture was not started in this stream",
    "CUDA_ERROR_STREAM_CAPTURE_UNJOINED": "a forked capture stream was not joined",
    "CUDA_ERROR_STREAM_CAPTURE_ISOLATION": "the capture would cross an isolation boundary",
    "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT": "implicit dependency on a capturing stream",
    "CUDA_ERROR_CAPTURED_EVENT": "the event was recorded in a capture",
    "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD": "the capture was ended from another thread",
    "CUDA_ERROR_TIMEOUT": "the wait timed out",
    "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE": "the graph update was not applied",
    "CUDA_ERROR_EXTERNAL_DEVICE": "an external device reported an error",
    "CUDA_ERROR_INVALID_CLUSTER_SIZE": "invalid cluster size for the launch",
    "CUDA_ERROR_FUNCTION_NOT_LOADED": "the function is not loaded yet",
    "CUDA_ERROR_INVALID_RESOURCE_TYPE": "invalid resource type",
    "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION": "invalid resource configuration",
    "CUDA_ERROR_KEY_ROTATION": "encryption key rotation failed",
    "CUDA_ERROR_UNKNOWN": "unknown error",
}

PFN_RE = re.compile(r"^(?P<base>cu[A-Za-z0-9_]+?)_v(?P<ver>\d{4,5})(?P<pt>_ptds|_ptsz)?$")
DECL_RE = re.compile(
    r"^(?:__attribute__\s*\(\(\s*\w+\s*\)\)\s*)*(?:extern\s+(?:\"C\"\s+)?)?"
    r"(?:__attribute__\s*\(\(\s*\w+\s*\)\)\s*)*CUresult\s+(cu[A-Za-z0-9_]+)\s*\(")
ANY_CU_FN_RE = re.compile(r"\bCUresult\s+(cu[A-Za-z0-9_]+)\s*\(")
TYPEDEF_RE = re.compile(r"\btypedef\s+CUresult\s*\(\s*\*\s*(PFN_\w+)\s*\)\s*\(")


class GenError(Exception):
    """An inconsistency in the inputs: the generator stops and writes nothing."""


@dataclass(frozen=True)
class Entry:
    base: str
    version: int
    ptds: bool
    symbol: str
    why: str = ""  # set for override entries


@dataclass
class Inputs:
    cuda_h: Path
    typedefs_h: Path
    overrides: Path
    cc: str


def preprocess(inputs: Inputs, header: str, flags: list[str], extra: str = "") -> str:
    """Run the C preprocessor over `#include <header>` (+ extra lines); fail loudly."""
    src = f"#include <{header}>\n{extra}"
    cmd = [inputs.cc, "-E", "-P", *flags, "-I", str(inputs.cuda_h.parent), "-x", "c", "-"]
    try:
        res = subprocess.run(cmd, input=src, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise GenError(f"cannot run the preprocessor {inputs.cc!r}: {exc}") from exc
    if res.returncode != 0:
        raise GenError(f"preprocessing {header} with {flags} failed:\n{res.stderr.strip()}")
    return res.stdout


def top_level_statements(text: str) -> list[str]:
    """Split preprocessed C into top-level items (declarations end at ';', definitions at '}')."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]  # pragmas
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in "\n".join(lines):
        cur.append(ch)
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                raise GenError("unbalanced braces in preprocessed cuda.h")
            if depth == 0:
                out.append(" ".join("".join(cur).split()))
                cur = []
        elif ch == ";" and depth == 0:
            out.append(" ".join("".join(cur).split()))
            cur = []
    if depth != 0:
        raise GenError("unbalanced braces at the end of preprocessed cuda.h")
    return out


def declared_functions(inputs: Inputs) -> tuple[set[str], set[str]]:
    """All exported cu* functions over every configuration, and the static inline wrappers."""
    names: set[str] = set()
    inline: set[str] = set()
    for cfg, flags in DECL_CONFIGS.items():
        found = 0
        for stmt in top_level_statements(preprocess(inputs, "cuda.h", flags, PROFILER_DECLS)):
            if stmt.startswith("typedef") or not ANY_CU_FN_RE.search(stmt):
                continue
            m = DECL_RE.match(stmt)
            if m and stmt.endswith(";"):
                names.add(m.group(1))
                found += 1
            elif stmt.startswith("static inline") or stmt.startswith("static __inline"):
                # A header-only wrapper (cuGetProcAddress_v2_ptsz): not a driver symbol.
                inline.update(ANY_CU_FN_RE.findall(stmt)[:1])
            else:
                raise GenError(f"[{cfg}] unrecognised declaration form: {stmt[:160]}")
        if found < 100:
            raise GenError(f"[{cfg}] only {found} functions found in cuda.h: parser broken?")
    if not names:
        raise GenError("no functions found in cuda.h")
    bad = sorted(n for n in names if n.startswith(GRAPHICS_PREFIXES))
    if bad:
        raise GenError(f"graphics interop names in cuda.h, update GRAPHICS_PREFIXES policy: {bad}")
    return names, inline - names


def parse_typedefs(inputs: Inputs) -> dict[str, set[tuple[int, str]]]:
    """base -> {(version, '' | '_ptds' | '_ptsz')} from every PFN typedef in cudaTypedefs.h."""
    out: dict[str, set[tuple[int, str]]] = {}
    for cfg, flags in TYPEDEF_CONFIGS.items():
        text = preprocess(inputs, "cudaTypedefs.h", flags, PROFILER_TYPEDEFS)
        typedefs = TYPEDEF_RE.findall(text)
        mentioned = set(re.findall(r"\bPFN_\w+", text))
        if set(typedefs) != mentioned:
            raise GenError(f"[{cfg}] PFN names not in a recognised typedef: "
                           f"{sorted(mentioned - set(typedefs))[:10]}")
        if len(typedefs) < 100:
            raise GenError(f"[{cfg}] only {len(typedefs)} PFN typedefs: parser broken?")
        for td in typedefs:
            m = PFN_RE.match(td[len("PFN_"):])
            if not m:
                raise GenError(f"[{cfg}] typedef {td} does not read as PFN_<base>_v<ver>[_ptds]")
            ver = int(m.group("ver"))
            if not 2000 <= ver <= 99999:
                raise GenError(f"typedef {td}: implausible CUDA version {ver}")
            out.setdefault(m.group("base"), set()).add((ver, m.group("pt") or ""))
    return out


def cuda_version(inputs: Inputs) -> int:
    m = re.search(r"^#define\s+CUDA_VERSION\s+(\d+)\s*$", inputs.cuda_h.read_text(), re.M)
    if not m:
        raise GenError("no '#define CUDA_VERSION N' in cuda.h")
    return int(m.group(1))


def load_overrides(path: Path) -> dict[str, list[dict[str, object]]]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise GenError(f"{path}: {exc}") from exc
    known = {"mapping", "entry", "macro_exception", "not_in_typedefs"}
    unknown = set(data) - known
    if unknown:
        raise GenError(f"{path}: unknown sections {sorted(unknown)}")
    out: dict[str, list[dict[str, object]]] = {k: list(data.get(k, [])) for k in known}
    for kind, items in out.items():
        for item in items:
            why = item.get("why")
            if not isinstance(why, str) or len(why.strip()) < 10:
                raise GenError(f"{path}: every [[{kind}]] needs a 'why' that explains it: {item}")
    return out


def versioned_names(base: str, declared: set[str]) -> list[str]:
    """Declared names base, base_v2, base_v3, ... in order; gaps are an error."""
    seq: list[str] = []
    if base in declared:
        seq.append(base)
    n = 2
    while seq and f"{base}_v{n}" in declared:
        seq.append(f"{base}_v{n}")
        n += 1
    stray = sorted(d for d in declared
                   if re.fullmatch(re.escape(base) + r"_v\d+", d) and d not in seq)
    if stray:
        raise GenError(f"{base}: declared {stray} but not every lower revision is declared")
    return seq


def build_table(declared: set[str], typedefs: dict[str, set[tuple[int, str]]],
                ov: dict[str, list[dict[str, object]]]) -> list[Entry]:
    mappings: dict[str, dict[str, object]] = {}
    for m in ov["mapping"]:
        base = str(m.get("base"))
        if base in mappings:
            raise GenError(f"override mapping for {base} given twice")
        mappings[base] = m
    for base in mappings:
        if base not in typedefs:
            raise GenError(f"override mapping for {base}: no PFN_{base}_v* typedef (stale?)")

    entries: list[Entry] = []
    for base in sorted(typedefs):
        vers = typedefs[base]
        nonpt = sorted(v for v, pt in vers if not pt)
        suffixes = {pt for _, pt in vers if pt}
        if len(suffixes) > 1:
            raise GenError(f"{base}: both _ptds and _ptsz typedefs")
        if not nonpt:
            raise GenError(f"{base}: only per-thread typedefs, no default-stream revision")
        if base in mappings:
            raw = mappings[base].get("symbols")
            if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
                raise GenError(f"override mapping for {base}: 'symbols' must be a list of names")
            symbols = [str(s) for s in raw]
            if len(symbols) != len(nonpt):
                raise GenError(f"override mapping for {base}: {len(symbols)} symbols for "
                               f"{len(nonpt)} versions {nonpt}")
            try:
                default_rule: list[str] | None = versioned_names(base, declared)
            except GenError:
                default_rule = None  # the rule fails here, which is why the mapping exists
            if default_rule == symbols:
                raise GenError(f"override mapping for {base} equals the default rule: remove it")
        else:
            symbols = versioned_names(base, declared)
            if len(symbols) != len(nonpt):
                raise GenError(
                    f"{base}: typedef versions {nonpt} but declared names {symbols}; add a "
                    "[[mapping]] to cudaapi/procaddr_overrides.toml saying which is which")
        for sym in symbols:
            if sym not in declared:
                raise GenError(f"{base}: symbol {sym} is not declared by cuda.h")
        by_ver = dict(zip(nonpt, symbols, strict=True))
        for v in nonpt:
            entries.append(Entry(base, v, False, by_ver[v]))
        for v, pt in sorted(vers):
            if not pt:
                continue
            below = [x for x in nonpt if x <= v]
            if not below:
                raise GenError(f"{base}: {pt} revision {v} is older than every default revision")
            sym = by_ver[below[-1]] + pt
            if sym not in declared:
                raise GenError(f"{base}@{v}{pt}: expected declared symbol {sym}")
            entries.append(Entry(base, v, True, sym))

    seen = {(e.base, e.version, e.ptds) for e in entries}
    for item in ov["entry"]:
        try:
            e = Entry(str(item["base"]), int(str(item["version"])), bool(item.get("ptds", False)),
                      str(item["symbol"]), str(item["why"]))
        except (KeyError, ValueError) as exc:
            raise GenError(f"override entry {item}: needs base, version, symbol ({exc})") from exc
        if (e.base, e.version, e.ptds) in seen:
            raise GenError(f"override entry {e.base}@{e.version}: collides with a typedef revision")
        if e.symbol not in declared:
            raise GenError(f"override entry {e.base}@{e.version}: {e.symbol} is not declared")
        seen.add((e.base, e.version, e.ptds))
        entries.append(e)

    entries.sort(key=lambda e: (e.base, e.version, e.ptds))
    return entries


def resolve(entries_by_base: dict[str, list[Entry]], base: str, version: int,
            ptds: bool) -> str | None:
    """The lookup client/shim/procaddr.c performs, in Python (for the checks)."""
    best: Entry | None = None
    best_pt: Entry | None = None
    for e in entries_by_base.get(base, []):
        if e.version > version:
            continue
        if not e.ptds and (best is None or e.version >= best.version):
            best = e
        if e.ptds and (best_pt is None or e.version >= best_pt.version):
            best_pt = e
    if ptds and best_pt is not None:
        return best_pt.symbol
    return best.symbol if best else None


def check_table(inputs: Inputs, entries: list[Entry], declared: set[str], inline: set[str],
                ov: dict[str, list[dict[str, object]]], cuda_ver: int) -> None:
    by_base: dict[str, list[Entry]] = {}
    for e in entries:
        by_base.setdefault(e.base, []).append(e)

    # Every declared name must be reachable through the table (else cudart could never get it).
    reachable = {e.symbol for e in entries}
    excused = {str(x.get("name")) for x in ov["not_in_typedefs"]}
    unreachable = declared - reachable
    if unreachable - excused:
        raise GenError(f"declared but no PFN typedef reaches them: {sorted(unreachable - excused)}"
                       "; add [[not_in_typedefs]] entries if that is right")
    stale = excused - unreachable
    if stale:
        raise GenError(f"stale [[not_in_typedefs]] overrides: {sorted(stale)}")

    # Per-thread variants must be the same API revision as the default one they stand for,
    # at every version where the answer could change.
    for base, es in by_base.items():
        for v in sorted({e.version for e in es}):
            plain = resolve(by_base, base, v, False)
            pt = resolve(by_base, base, v, True)
            if plain is None or pt is None:
                raise GenError(f"{base}@{v}: no default-stream entry")
            if pt != plain and pt.removesuffix("_ptds").removesuffix("_ptsz") != plain:
                raise GenError(f"{base}@{v}: per-thread lookup gives {pt} but the default "
                               f"lookup gives {plain}: different API revisions")

    # cuda.h's own macros say what a program compiled at CUDA_VERSION calls.
    exceptions: dict[tuple[str, str], str] = {}
    for x in ov["macro_exception"]:
        cfgs = x.get("configs", list(MACRO_CONFIGS))
        if not isinstance(cfgs, list):
            raise GenError(f"macro_exception {x}: configs must be a list")
        for cfg in cfgs:
            if cfg not in MACRO_CONFIGS:
                raise GenError(f"macro_exception {x}: unknown config {cfg}")
            key = (str(x.get("name")), str(cfg))
            if key in exceptions:
                raise GenError(f"macro_exception {key} given twice")
            exceptions[key] = str(x.get("expands_to"))
    used: set[tuple[str, str]] = set()
    bases = sorted(by_base)
    probe = "".join(f"GP_PROBE_{i} {b}\n" for i, b in enumerate(bases))
    for cfg, (flags, ptds) in MACRO_CONFIGS.items():
        text = preprocess(inputs, "cuda.h", flags, probe)
        got = dict(re.findall(r"^GP_PROBE_(\d+) (\w+)\s*$", text, re.M))
        if len(got) != len(bases):
            raise GenError(f"[{cfg}] macro probe lost lines ({len(got)} of {len(bases)})")
        for i, base in enumerate(bases):
            expanded = got[str(i)]
            ours = resolve(by_base, base, cuda_ver, ptds)
            if expanded == ours:
                continue
            key = (base, cfg)
            if key not in exceptions:
                raise GenError(
                    f"[{cfg}] cuda.h maps {base} to {expanded} but the table gives {ours} at "
                    f"{cuda_ver}; explain it with a [[macro_exception]] or fix it with an [[entry]]")
            if exceptions[key] != expanded:
                raise GenError(f"[{cfg}] macro_exception {base}: cuda.h now expands to {expanded}, "
                               f"the override says {exceptions[key]}")
            if expanded not in declared and expanded not in inline:
                raise GenError(f"[{cfg}] cuda.h maps {base} to {expanded}, which it never declares")
            used.add(key)
    if set(exceptions) - used:
        raise GenError(f"stale [[macro_exception]] overrides: {sorted(set(exceptions) - used)}")

    for base, ver, ptds, want in FACTS:
        got = resolve(by_base, base, ver, ptds)
        if got != want:
            raise GenError(f"fact check: {base}@{ver}{' ptds' if ptds else ''} -> {got}, "
                           f"expected {want}")


def parse_errors(inputs: Inputs) -> list[tuple[str, int]]:
    text = preprocess(inputs, "cuda.h", [])
    m = re.search(r"typedef\s+enum\s+cudaError_enum\s*\{(.*?)\}\s*CUresult\s*;", text, re.S)
    if not m:
        raise GenError("CUresult enum (cudaError_enum) not found in cuda.h")
    out: list[tuple[str, int]] = []
    for item in m.group(1).split(","):
        item = item.strip()
        if not item:
            continue
        em = re.fullmatch(r"(CUDA_\w+)\s*=\s*(\d+)", item)
        if not em:
            raise GenError(f"CUresult enumerator not of the form NAME = number: {item!r}")
        out.append((em.group(1), int(em.group(2))))
    values = [v for _, v in out]
    if len(set(values)) != len(values):
        raise GenError("duplicate CUresult values")
    missing = [n for n, _ in out if n not in ERROR_TEXT]
    if missing:
        raise GenError(f"no description for {missing}: add them to ERROR_TEXT")
    stale = sorted(set(ERROR_TEXT) - {n for n, _ in out})
    if stale:
        raise GenError(f"ERROR_TEXT has codes cuda.h no longer defines: {stale}")
    return out


def c_str(s: str) -> str:
    if not re.fullmatch(r"[ -~]*", s) or '"' in s or "\\" in s:
        raise GenError(f"string not safe to emit as a C literal: {s!r}")
    return f'"{s}"'


def banner_text(inputs: Inputs) -> str:
    def sha(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()

    profiler_h = inputs.cuda_h.parent / "cudaProfiler.h"
    profiler_typedefs_h = inputs.cuda_h.parent / "cudaProfilerTypedefs.h"
    return (f"GENERATED by {SCRIPT_NAME} from cuda.h/cudaTypedefs.h (sha256 cuda.h "
            f"{sha(inputs.cuda_h)}, cudaTypedefs.h {sha(inputs.typedefs_h)}, "
            f"cudaProfiler.h {sha(profiler_h)}, cudaProfilerTypedefs.h {sha(profiler_typedefs_h)}, "
            f"procaddr_overrides.toml {sha(inputs.overrides)}) — DO NOT EDIT")


def gen_symbols(banner: str, names: list[str]) -> str:
    return f"# {banner}\n" + "".join(f"{n}\n" for n in names)


def gen_header(banner: str, cuda_ver: int) -> str:
    return f"""/* {banner} */
/* Declarations shared by the generated tables and client/shim/procaddr.c. */
#ifndef GP_CUDA_TABLES_H
#define GP_CUDA_TABLES_H

#include <stddef.h>
#include <stdint.h>

#include "gp_cuda.h"

/* The toolkit version the tables were generated from. */
#define GP_CUDA_TABLES_VERSION {cuda_ver}

/* Every exported function has a different real signature; the tables only store addresses,
 * so one plain function-pointer type stands for all of them. */
typedef CUresult (*gp_cu_fn)(void);

/* One revision of a driver function as cuGetProcAddress hands it out. */
typedef struct gp_procaddr_entry {{
    int version; /* the CUDA version that introduced this revision */
    int ptds;    /* 1: the per-thread-default-stream variant (_ptds / _ptsz) */
    gp_cu_fn fn;
}} gp_procaddr_entry;

/* A base name and its revisions: gp_procaddr_entries[first .. first + count), by version. */
typedef struct gp_procaddr_base {{
    const char *name;
    uint16_t first;
    uint16_t count;
}} gp_procaddr_base;

/* Sorted by name (strcmp order) for binary search. */
extern const gp_procaddr_base gp_procaddr_bases[];
extern const size_t gp_procaddr_bases_len;
extern const gp_procaddr_entry gp_procaddr_entries[];
extern const size_t gp_procaddr_entries_len;

/* Every exported symbol by its exact name, sorted (strcmp order) for binary search. */
typedef struct gp_symbol_entry {{
    const char *name;
    gp_cu_fn fn;
}} gp_symbol_entry;
extern const gp_symbol_entry gp_symbol_table[];
extern const size_t gp_symbol_table_len;

/* "CUDA_ERROR_INVALID_VALUE" etc., or NULL for a value cuda.h does not define. */
const char *gp_cuda_error_name(CUresult err);
/* A short description of the error, or NULL for a value cuda.h does not define. */
const char *gp_cuda_error_string(CUresult err);

#endif /* GP_CUDA_TABLES_H */
"""


def gen_stubs(banner: str, names: list[str]) -> str:
    out = [f"/* {banner} */",
           "/* Weak default definitions of every driver function cuda.h declares.  Hand-written",
           " * strong definitions elsewhere in the shim replace them at link time; what is left",
           " * answers CUDA_ERROR_NOT_SUPPORTED and says so once on stderr, so that a library that",
           " * dlsym()s a name it never calls still loads.  The arguments are ignored, which the",
           " * x86-64 SysV calling convention allows (the caller cleans up). */",
           '#include "gp_unimplemented.h"  /* client/shim, by include path */',
           ""]
    for n in names:
        out.append(f'__attribute__((weak, visibility("default"))) CUresult {n}(void) '
                   f'{{ return gp_unimplemented({c_str(n)}); }}')
    return "\n".join(out) + "\n"


def gen_procaddr(banner: str, names: list[str], entries: list[Entry]) -> str:
    out = [f"/* {banner} */",
           "/* The cuGetProcAddress table and the exact-name symbol table.  The functions are",
           " * declared here without their real parameters: only their addresses are taken. */",
           '#include "gp_cuda_tables.h"',
           ""]
    for n in names:
        out.append(f'extern __attribute__((visibility("default"))) CUresult {n}(void);')
    out.append("")
    out.append("const gp_procaddr_entry gp_procaddr_entries[] = {")
    bases: list[tuple[str, int, int]] = []
    for i, e in enumerate(entries):
        if not bases or bases[-1][0] != e.base:
            bases.append((e.base, i, 0))
        b = bases[-1]
        bases[-1] = (b[0], b[1], b[2] + 1)
        note = (f" /* {e.base}: override, see cudaapi/procaddr_overrides.toml */" if e.why
                else f" /* {e.base} */")
        out.append(f"    {{{e.version}, {int(e.ptds)}, {e.symbol}}},{note}")
    out.append("};")
    out.append(f"const size_t gp_procaddr_entries_len = {len(entries)};")
    out.append("")
    if len(entries) > 0xFFFF:
        raise GenError("too many entries for uint16_t indices")
    out.append("const gp_procaddr_base gp_procaddr_bases[] = {")
    for name, first, count in bases:
        out.append(f"    {{{c_str(name)}, {first}, {count}}},")
    out.append("};")
    out.append(f"const size_t gp_procaddr_bases_len = {len(bases)};")
    out.append("")
    out.append("const gp_symbol_entry gp_symbol_table[] = {")
    for n in names:
        out.append(f"    {{{c_str(n)}, {n}}},")
    out.append("};")
    out.append(f"const size_t gp_symbol_table_len = {len(names)};")
    return "\n".join(out) + "\n"


def gen_errors(banner: str, errors: list[tuple[str, int]]) -> str:
    out = [f"/* {banner} */",
           "/* CUresult names (facts from cuda.h) and short descriptions (our own words). */",
           '#include "gp_cuda_tables.h"',
           "",
           "const char *gp_cuda_error_name(CUresult err) {",
           "    switch (err) {"]
    for name, val in errors:
        out.append(f"    case {val}: return {c_str(name)};")
    out += ["    default: return NULL;", "    }", "}", "",
            "const char *gp_cuda_error_string(CUresult err) {",
            "    switch (err) {"]
    for name, val in errors:
        out.append(f"    case {val}: return {c_str(ERROR_TEXT[name])};")
    out += ["    default: return NULL;", "    }", "}"]
    return "\n".join(out) + "\n"


def generate(inputs: Inputs) -> dict[str, str]:
    """All output files by name; raises GenError on any inconsistency."""
    for p in (inputs.cuda_h, inputs.typedefs_h, inputs.overrides):
        if not p.is_file():
            raise GenError(f"{p}: not found")
    declared, inline = declared_functions(inputs)
    typedefs = parse_typedefs(inputs)
    ov = load_overrides(inputs.overrides)
    cuda_ver = cuda_version(inputs)
    entries = build_table(declared, typedefs, ov)
    check_table(inputs, entries, declared, inline, ov, cuda_ver)
    errors = parse_errors(inputs)
    banner = banner_text(inputs)
    names = sorted(declared)
    return {
        "gp_symbols.txt": gen_symbols(banner, names),
        "gp_cuda_tables.h": gen_header(banner, cuda_ver),
        "gp_stubs.c": gen_stubs(banner, names),
        "gp_procaddr_table.c": gen_procaddr(banner, names, entries),
        "gp_errors.c": gen_errors(banner, errors),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--cuda-include", type=Path, default=Path("/usr/local/cuda/include"),
                    help="folder holding the toolkit's cuda.h and cudaTypedefs.h")
    ap.add_argument("--out-dir", type=Path, default=REPO,
                    help="root under which client/shim/generated/ is written (default: the repo)")
    ap.add_argument("--overrides", type=Path, default=REPO / "cudaapi" / "procaddr_overrides.toml")
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"), help="C compiler used as preprocessor")
    args = ap.parse_args(argv)
    inputs = Inputs(cuda_h=args.cuda_include / "cuda.h",
                    typedefs_h=args.cuda_include / "cudaTypedefs.h",
                    overrides=args.overrides, cc=args.cc)
    try:
        files = generate(inputs)
    except GenError as exc:
        print(f"gen_cuda_tables.py: error: {exc}", file=sys.stderr)
        return 1
    outdir = args.out_dir / GEN_SUBDIR
    outdir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (outdir / name).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
