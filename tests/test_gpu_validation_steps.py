"""scripts/gpu-validation.sh's one-call plan run for real with stubs (issue 31, item 6): every
step of the plan that starts its own gpupoold (sandbox, detach, generate, busy, cuda_graph,
compile) is called in order with its arguments, a failing step does not stop the later ones,
and the summary carries each check's verdict and each profile's top lines; and the parts of
bench/gpu_checks.py that need no GPU (parsing nvidia-smi dmon and /metrics, the dry runs).
The real checks need a lent GPU (docs/validation.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

from conftest import REPO, run_client

SCRIPT = REPO / "scripts" / "gpu-validation.sh"
CHECKS = REPO / "bench" / "gpu_checks.py"

# Stands in for python3: records each call; the checks print a verdict line (the sandbox says it
# breaks the driver, busy fails), the
# workloads write their markdown and a profile as bench/torch_workloads.py would.
STUB_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >>"$STUB_LOG"
case "$1" in
bench/gpu_checks.py)
    echo "sandbox off: ${GPUPOOL_VALIDATION_SANDBOX_OFF:-0}" >>"$STUB_LOG"
    if [[ $2 == sandbox ]]; then echo "sandbox: THE SANDBOX BREAKS THE DRIVER: stub"; exit 1; fi
    echo "$2: stub verdict"
    [[ $2 == busy ]] && exit 1 ;;
bench/torch_workloads.py)
    while (($#)); do
        case "$1" in --only) name=$2 ;; --markdown) md=$2 ;; esac
        shift
    done
    echo "| $name | stub |" >"$md"
    mkdir -p "$GPUPOOL_PROFILE_DIR"
    printf 'op calls\ntop line of %s\n' "$name" >"$GPUPOOL_PROFILE_DIR/$name.txt" ;;
esac
exit 0
"""


def test_one_call_plan_runs_every_step_in_order_with_stubs(tmp_path):
    bin_dir, build = tmp_path / "bin", tmp_path / "build"
    bin_dir.mkdir()
    (build / "validation" / "cuda").mkdir(parents=True)
    (build / "validation" / "PREPARED").write_text("prepared by the test\n")
    stub = bin_dir / "python-stub"
    stub.write_text(STUB_PYTHON)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 580.00'\n")
    for f in (stub, smi):
        f.chmod(0o755)
    out, log = tmp_path / "out", tmp_path / "calls.txt"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(stub), "TMPDIR": str(tmp_path), "STUB_LOG": str(log),
           "GPUPOOL_BUILD_DIR": str(build), "PATH": f"{bin_dir}:/usr/bin:/bin", "GPUPOOL_COMMIT": "test"}
    steps = "info,sandbox,detach,shares,ipc,generate,cuda_graph,compile,busy"
    proc = run_client(["bash", SCRIPT, "--only", steps, "--budget", "500"], env=env, cwd=REPO, timeout=120)
    summary = (out / "summary.md").read_text()
    assert proc.returncode == 1, proc.stdout + proc.stderr  # busy failed
    rows = re.findall(r"^\| (\S+) \| (.+?) \| \d+ \|$", summary, re.M)
    assert rows == [("info", "ok"), ("sandbox", "FAILED (exit 1)"), ("detach", "ok"), ("shares", "ok"), ("ipc", "ok"),
                    ("generate", "ok"), ("cuda_graph", "ok"), ("compile", "ok"), ("busy", "FAILED (exit 1)")], summary
    # Each step gets its planned limit plus the time the steps before it left unused beyond what
    # the later ones are planned for: here 500 s for 420 s of limits, the stubs taking none.
    planned = {"info": 20, "sandbox": 40, "detach": 70, "shares": 55, "ipc": 40, "generate": 95, "cuda_graph": 25,
               "compile": 50, "busy": 25}
    given = {n: int(t) for n, t in re.findall(r"==> (\S+) \(time limit (\d+) s\)", proc.stdout)}
    assert list(given) == list(planned), proc.stdout
    names = list(planned)
    for i, (name, limit) in enumerate(given.items()):
        later = sum(planned[n] for n in names[i + 1:])
        assert 500 - 10 - later - 3 <= limit <= 500 - 10 - later, (name, limit, proc.stdout)
        assert limit > planned[name]
    calls = [c for c in log.read_text().splitlines() if c.startswith("bench/")]
    assert [c.split()[0:2] for c in calls] == [
        ["bench/gpu_checks.py", "sandbox"], ["bench/gpu_checks.py", "detach"], ["bench/gpu_checks.py", "shares"],
        ["bench/gpu_checks.py", "ipc"], ["bench/torch_workloads.py", "--only"], ["bench/torch_workloads.py", "--only"],
        ["bench/torch_workloads.py", "--only"], ["bench/gpu_checks.py", "busy"]]
    assert f"--cuda-dir {build}/validation/cuda" in calls[0]
    assert "--sizes 1G,8G" in calls[1]
    # The real GPU's sizes (issue 32: 16 GiB quotas; issue 37: no ipc_share prepared here), logs' JSON.
    assert calls[2] == f"bench/gpu_checks.py shares --memory 16G --seconds 3 --limit 40 --json {calls[2].split()[-1]}"
    assert calls[2].endswith("/logs/shares.json")
    assert calls[3].startswith("bench/gpu_checks.py ipc --memory 8G --limit 30 --json ")
    assert calls[4].startswith("bench/torch_workloads.py --only generate --quick")
    assert calls[5].startswith("bench/torch_workloads.py --only cuda_graph --steps 100 --warmup 10")
    assert calls[6].startswith("bench/torch_workloads.py --only compile --steps 20 --warmup 3")
    # The verdicts and each profile's top lines are in the summary; at most 8 files come back.
    assert "    sandbox: THE SANDBOX BREAKS THE DRIVER: stub" in summary and "    detach: stub verdict" in summary
    assert "    shares: stub verdict" in summary and "    ipc: stub verdict" in summary
    # After that verdict the later checks' gpupoolds run without the sandbox (they are told so).
    # sandbox, detach, shares, ipc, busy
    assert re.findall(r"^sandbox off: (\d)$", log.read_text(), re.M) == ["0", "1", "1", "1", "1"]
    assert "the later steps run with worker_sandbox = false" in proc.stdout
    for name in ("generate", "cuda_graph", "compile"):
        assert f"## Profile {name}.txt" in summary and f"    top line of {name}" in summary
        assert f"| {name} | stub |" in summary
    assert len(list(out.iterdir())) <= 8


def load_checks():
    spec = importlib.util.spec_from_file_location("gpu_checks", CHECKS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_busy_check_reads_dmon_and_metrics():
    checks = load_checks()
    dmon = ("# gpu    sm   mem   enc   dec   jpg   ofa\n# Idx     %     %     %     %     %     %\n"
            "    0    50    10     0     0     0     0\n    0   100    20     0     0     0     0\n"
            "    0     -     -     -     -     -     -\n    1    90     0     0     0     0     0\n")
    assert checks.dmon_sm_seconds(dmon) == (1.5, 2)  # GPU 0's numeric samples only
    metrics = ('# TYPE gpupool_gpu_busy_seconds counter\ngpupool_gpu_busy_seconds_total{gpu="0"} 12.5\n'
               'gpupool_gpu_busy_seconds_total{gpu="1"} 3.0\n')
    assert checks.busy_seconds(metrics) == 12.5 and checks.busy_seconds(metrics, 1) == 3.0
    assert checks.busy_seconds("") is None
    assert checks.size_arg("8G") == 8 << 30 and checks.size_arg("512M") == 512 << 20


def test_checks_dry_run_start_nothing(tmp_path):
    for args in (["sandbox", "--cuda-dir", str(tmp_path)], ["detach"], ["busy"], ["shares"], ["ipc"]):
        proc = run_client([sys.executable, CHECKS, *args, "--dry-run"], timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"  {args[0]}: "), proc.stdout
    assert "cuda-modules (PTX JIT)" in run_client([sys.executable, CHECKS, "sandbox", "--cuda-dir", str(tmp_path),
                                                   "--dry-run"], timeout=30).stdout
    assert Path(tmp_path).exists() and not list(tmp_path.iterdir())


def test_frameworks_list_export_table_slots_slot_by_slot(tmp_path):
    """The frameworks step's list of the slots a framework called, from the trampolines' lines
    (the script's own function, run on sample logs)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    uuid = "da9151d3-3ae6-cc41-a5c0-4f26d533e328"
    (logs / "fw-cupy-remote.txt").write_text(
        f"gpupool: export table {uuid} slot 3 called (returned CUDA_ERROR_NOT_SUPPORTED: gpupool does not "
        f"forward it)\nother output\ngpupool: export table {uuid} slot 1 called (returned "
        "CUDA_ERROR_NOT_SUPPORTED: gpupool does not forward it)\n"
        "gpupool: export table tools-module slot 9 called (returned 0)\nFAIL cufftPlan1d\n")
    (logs / "fw-jax-remote.txt").write_text("PASS jax\n")
    body = re.search(r"^export_table_slots\(\) \{\n.*?^\}\n", SCRIPT.read_text(), re.M | re.S)
    assert body is not None
    proc = run_client(["bash", "-c", f"{body.group(0)}\nexport_table_slots"], env={**os.environ, "LOGS": str(logs)},
                      timeout=30)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "  fw-cupy: export-table slots called:"
    assert lines[1:] == [
        f"    {uuid} slot 1 (returned CUDA_ERROR_NOT_SUPPORTED: gpupool does not forward it)",
        f"    {uuid} slot 3 (returned CUDA_ERROR_NOT_SUPPORTED: gpupool does not forward it)",
        "    tools-module slot 9 (returned 0)"]
    assert (logs / "export-table-slots.txt").read_text() == proc.stdout


# A driver-API program through the shim (ctypes: no nvcc needed): a context and an allocation.
DRIVER_PROBE = """
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
for what, rc in (("cuInit", cu.cuInit(0)), ("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), 0)),
                 ("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
                 ("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx)),
                 ("cuMemAlloc_v2", cu.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20))):
    assert rc == 0, (what, rc)
print("PASS driver probe")
"""


def test_sandbox_check_reruns_what_fails_without_the_sandbox(native_build, tmp_path):
    """The sandbox check's machinery against a simulated GPU (--simulated, tests only): a program
    that works passes once; one that fails runs again with worker_sandbox = false, and since it
    fails there too the verdict says the sandbox is not the cause (exit 1)."""
    out = tmp_path / "sandbox.json"
    broken = f"{sys.executable} -c 'raise SystemExit(\"FAIL on purpose\")'"
    proc = run_client([sys.executable, CHECKS, "sandbox", "--simulated", "--cuda-dir", str(tmp_path),
                       "--program", f"probe={sys.executable} -c '{DRIVER_PROBE}'", "--program", f"broken={broken}",
                       "--limit", "60", "--json", str(out)],
                      env={**os.environ, "GPUPOOL_BUILD_DIR": str(native_build)}, timeout=150)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["sandbox_on"]["programs"]["probe"]["ok"], result
    assert not result["sandbox_on"]["programs"]["broken"]["ok"]
    assert list(result["sandbox_off"]["programs"]) == ["broken"]  # only what failed runs again
    assert result["verdict"] == "broken fail with and without the sandbox: not the sandbox's doing " \
                                "(see the programs' output)"
    assert f"sandbox: {result['verdict']}" in proc.stdout
