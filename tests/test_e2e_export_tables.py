"""End to end: cuGetExportTable for tables the shim does not implement (issue 31, item 4), through
the driver API on a gpupoold with a simulated GPU (tests/cuda/export_tables.cu): the tools-module
table with its slot 7 iterating a loaded module's kernels on the server, trampolines for a table
only the server's driver knows (a slot answers CUDA_ERROR_NOT_SUPPORTED and is logged once though
called twice), and a uuid nobody knows refused as before.

Needs nvcc; the program links against our libcuda.so (build/client) for its driver calls.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from conftest import REPO, require, run_client
from test_e2e_cuda import nvcc_path

SOURCE = REPO / "tests" / "cuda" / "export_tables.cu"
DEPS = (SOURCE, REPO / "tests" / "cuda" / "gp_check.cuh")
ARCH = os.environ.get("GPUPOOL_TEST_ARCH", "sm_90")
SIM_ONLY = "67707570-6f6f-6c20-7369-6d2074626c00"  # "gpupool sim tbl\0" (worker/sim/sim_export.c)
TOOLS_MODULE = "6e163fbe-b958-444d-835c-e182aff1991e"  # CU_ETID_ToolsModule
NOBODY = "e57a0b1e-0011-2233-4455-66778899aabb"


def _nvcc(nvcc: str, out: Path, *args: str) -> Path:
    if out.exists() and all(d.stat().st_mtime <= out.stat().st_mtime for d in DEPS):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    proc = subprocess.run([nvcc, f"-arch={ARCH}", *args, "-o", str(tmp), str(SOURCE)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tmp.replace(out)
    return out


def test_export_tables(native_build, gpupool_server):
    nvcc = nvcc_path()
    require(nvcc is not None, "nvcc (CUDA toolkit) not found: the CUDA test programs cannot be built")
    assert nvcc is not None
    out = native_build / "cuda-tests" / "export_tables"
    cubin = _nvcc(nvcc, out / "export_tables.cubin", "-cubin")
    program = _nvcc(nvcc, out / "export_tables", "-O2", "-L", str(native_build / "client"), "-lcuda")

    profile = out / f"profile-{os.getpid()}.json"
    profile.unlink(missing_ok=True)
    proc = run_client([program, cubin], env=gpupool_server.client_env({"GPUPOOL_PROFILE": str(profile)}),
                      timeout=120)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith("PASS export_tables"), (
        f"export_tables did not pass: exit {proc.returncode}\n--- stdout\n{proc.stdout[-8000:]}\n"
        f"--- stderr\n{proc.stderr[-8000:]}\n--- gpupoold log\n{gpupool_server.log_text()[-4000:]}")
    err = proc.stderr
    # The trampoline's line: once, though the program calls the slot twice.
    assert err.count(f"gpupool: export table {SIM_ONLY} slot 4 called") == 1, err
    assert err.count(f"gpupool: cuGetExportTable: table {SIM_ONLY} is not implemented by gpupool") == 1, err
    # Slot 7 of the tools-module table is forwarded, not a trampoline: no line for it.
    assert "slot 7 called" not in err, err
    # Refused once, said once, as before.
    assert err.count(f"gpupool: cuGetExportTable: unknown table {NOBODY}") == 1, err
    # The profile (GPUPOOL_PROFILE, issue 31 item 1) counts every call of a served table's slots.
    slots = {(s["table"], s["slot"]): s["calls"] for s in json.loads(profile.read_text())["export_table_slots"]}
    profile.unlink()
    assert slots[(SIM_ONLY, 4)] == 2, slots
    assert slots[(TOOLS_MODULE, 7)] >= 1, slots
