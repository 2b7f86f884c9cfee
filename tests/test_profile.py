"""GPUPOOL_PROFILE (client/shim/profile.c, entry_profile.c, call_counts.c): the program's calls
written at exit, per protocol op and per CUDA entry point, through a real gpupoold on a simulated
GPU.

tests/tools/known_calls.py (test_link_model.py's program, whose calls are known) runs with both
the link model's counters (GPUPOOL_CALL_COUNTS=1, read in the program) and the profile (JSON): the
two agree op by op on calls, round trips and bytes, and the entry points show exactly the calls the
program made. A tests/cuda program (built with nvcc, cudart finding the shim through
cuGetProcAddress) writes the text table."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from typing import Any

import pytest
from conftest import REPO, require, run_client
from test_e2e_cuda import cuda_programs, show  # noqa: F401 - the fixture
from test_link_model import KNOWN, STEPS, known

OP_COLUMNS = ["protocol op", "calls", "round trips", "detached", "bytes sent", "bytes received",
              "client ms", "worker ms"]


def read_text_table(text: str, title: str) -> list[list[str]]:
    """The rows of the table whose header line starts with title (split on runs of 2+ spaces
    in the header, on whitespace in the rows: names have no spaces, but the headers do)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


@pytest.mark.san
def test_profile_agrees_with_the_link_models_counts(gpupool_server, tmp_path):
    """The known program: the profile's ops are the link model's counts (plus what the program
    sends after its last count: one cuMemcpyDtoH reading the result back), and its entry points
    are the program's calls."""
    path = tmp_path / "known-%p.json"
    env = gpupool_server.client_env({"GPUPOOL_CALL_COUNTS": "1", "GPUPOOL_PROFILE": str(path)})
    proc = run_client([sys.executable, str(KNOWN), str(STEPS)], env=env, timeout=120)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    files = list(tmp_path.glob("known-*.json"))
    assert len(files) == 1 and re.fullmatch(r"known-\d+\.json", files[0].name), files
    prof: dict[str, Any] = json.loads(files[0].read_text())
    assert not list(tmp_path.glob("*.tmp.*"))

    ops = prof["ops"]
    after = out["after"]["ops"]
    late = {"memcpy_dtoh"}  # the read-back after the last count
    for name, counted in after.items():
        mine = ops[name]
        if name in late:
            assert mine["calls"] == counted["frames"] + 1
            assert mine["round_trips"] == counted["round_trips"] + 1
        else:
            assert (mine["calls"], mine["round_trips"], mine["detached"], mine["sent"], mine["received"]) == (
                counted["frames"], counted["round_trips"], counted["detached"], counted["sent"],
                counted["received"]), name
        assert mine["round_trips"] <= mine["calls"]
        # The worker timed the same calls (op_times, asked at exit).
        assert mine["worker_calls"] == mine["calls"], name
        assert mine["worker_ns"] > 0, name
    assert set(ops) - set(after) <= late | {"device_get_attribute", "device_get_name"}
    phases = prof["module_load_phases"]
    assert phases["hash"]["calls"] == phases["probe"]["calls"] >= 1
    assert phases["probe"]["calls"] + phases["upload"]["calls"] == ops["module_load"]["calls"]
    # Costliest first.
    times = [op["client_ns"] for op in ops.values()]
    assert times == sorted(times, reverse=True) and times[0] > 0

    k = known()
    eps = prof["entry_points"]
    launches = sum(k.KERNEL_LAUNCHES.values()) * STEPS
    assert eps["cuLaunchKernel"]["calls"] == launches == ops["launch"]["calls"]
    assert eps["cuLaunchKernel"]["frames"] == launches and eps["cuLaunchKernel"]["round_trips"] == 0
    assert eps["cuStreamSynchronize"]["calls"] == STEPS + 1
    assert eps["cuStreamSynchronize"]["round_trips"] == STEPS + 1
    assert eps["cuMemcpyDtoH_v2"]["calls"] == STEPS + 1 == eps["cuMemcpyDtoH_v2"]["round_trips"]
    assert eps["cuMemcpyDtoHAsync_v2"]["calls"] == STEPS
    assert eps["cuMemcpyDtoHAsync_v2"]["round_trips"] == 0
    assert eps["cuMemcpyHtoD_v2"]["calls"] == STEPS + 2
    assert eps["cuModuleGetFunction"]["calls"] == len(k.KERNEL_LAUNCHES) + 1
    assert eps["cuInit"]["calls"] == 1
    # Every frame of an op is one entry point's: the sums agree.
    for key in ("round_trips", "sent", "received"):
        assert sum(e[key] for e in eps.values()) == sum(o[key] for o in ops.values()), key
    assert sum(e["frames"] for e in eps.values()) == sum(o["calls"] for o in ops.values())
    for e in eps.values():
        assert e["wait_ns"] <= e["client_ns"] or e["calls"] == 0

    # Off by default: nothing is written, and the call counts stay off too.
    env = gpupool_server.client_env()
    env.pop("GPUPOOL_PROFILE", None)
    env.pop("GPUPOOL_CALL_COUNTS", None)
    quiet = tmp_path / "off"
    quiet.mkdir()
    proc = run_client([sys.executable, str(KNOWN), "1"], env=env, cwd=quiet, timeout=120)
    assert proc.returncode != 0 and "set GPUPOOL_CALL_COUNTS=1" in proc.stderr + proc.stdout
    assert list(quiet.iterdir()) == []


def test_profile_text_table_of_a_cuda_program(cuda_programs, gpupool_server, tmp_path):  # noqa: F811
    """A cudart program (tests/cuda/kernels.cu) through gpupool: the text table lists the ops and
    the entry points cudart reached through cuGetProcAddress, costliest first."""
    path = tmp_path / "kernels.txt"
    exe = cuda_programs.path("kernels", "shared")
    proc = run_client([exe], env=gpupool_server.client_env({"GPUPOOL_PROFILE": str(path)}),
                      timeout=120)
    assert proc.returncode == 0 and "PASS kernels" in proc.stdout, show(proc, gpupool_server)
    text = path.read_text()
    assert text.startswith("# gpupool profile of kernels (pid ")
    header = next(line for line in text.splitlines() if line.startswith("protocol op"))
    assert re.split(r"\s{2,}", header.strip()) == OP_COLUMNS
    ops = {r[0]: r for r in read_text_table(text, "protocol op")}
    assert "launch" in ops and "module_load" in ops and "total" in ops
    # A module load's phases (client/shim/module_phases.h): every load hashes its image and asks
    # the server (a probe); only the server's misses send it. Probes and uploads are module_load.
    phases = {r[0]: (int(r[-3]), int(r[-2]), float(r[-1])) for r in read_text_table(text, "module load phase")}
    assert set(phases) == {"hash", "probe", "upload"}, phases
    assert phases["hash"][0] == phases["probe"][0] >= 1 and phases["probe"][1] == 0
    assert phases["probe"][0] + phases["upload"][0] == int(ops["module_load"][1])
    assert phases["upload"][1] <= phases["hash"][1] and phases["hash"][1] > 0
    body = [r for name, r in ops.items() if name != "total"]
    for r in body:
        calls, round_trips = int(r[1]), int(r[2])
        assert 0 < calls and round_trips <= calls and float(r[7]) >= 0  # worker ms: the worker's
    assert float(ops["total"][7]) == pytest.approx(sum(float(r[7]) for r in body), abs=0.01 * len(body))
    client_ms = [float(r[6]) for r in body]
    assert client_ms == sorted(client_ms, reverse=True)
    assert int(ops["total"][1]) == sum(int(r[1]) for r in body)
    eps = {r[0]: r for r in read_text_table(text, "CUDA entry point")}
    # kernels.cu launches through cudart's cudaLaunchKernel and once with launch attributes.
    assert int(eps["cuLaunchKernel"][1]) + int(eps["cuLaunchKernelEx"][1]) == int(ops["launch"][1])
    assert int(eps["cuLaunchKernel"][1]) > 1000 and int(eps["cuLaunchKernel"][3]) == 0
    assert int(eps["cuStreamSynchronize"][3]) == int(ops["stream_synchronize"][2])
    assert all(name.startswith("cu") or name == "(shim_threads)" for name in eps)

    # Many threads on one connection (tests/cuda/threads.cu): every frame is counted once, under
    # its op and under the entry point of the thread that sent it.
    threads = tmp_path / "threads.json"
    proc = run_client([cuda_programs.path("threads", "shared")],
                      env=gpupool_server.client_env({"GPUPOOL_PROFILE": str(threads)}), timeout=120)
    assert proc.returncode == 0 and "PASS threads" in proc.stdout, show(proc, gpupool_server)
    prof = json.loads(threads.read_text())
    ops, entries = prof["ops"].values(), prof["entry_points"].values()
    for key in ("round_trips", "sent", "received"):
        assert sum(e[key] for e in entries) == sum(o[key] for o in ops) > 0, key
    assert sum(e["frames"] for e in entries) == sum(o["calls"] for o in ops)
    assert prof["entry_points"]["cuLaunchKernel"]["calls"] >= 8 * 40  # 8 threads, 40 iterations each

    # A file that cannot be written: the program still runs, and one line says why and what to do.
    path = tmp_path / "missing" / "p.txt"
    proc = run_client([exe], env=gpupool_server.client_env({"GPUPOOL_PROFILE": str(path)}), timeout=120)
    assert proc.returncode == 0 and "PASS kernels" in proc.stdout, show(proc, gpupool_server)
    assert f"GPUPOOL_PROFILE: cannot write {path}.tmp." in proc.stderr
    assert "in a folder that exists" in proc.stderr


def test_profile_of_pytorch_generate_in_count_mode(native_build, tmp_path):
    """PyTorch's generate (bench/torch_workloads.py) through a count-mode gpupoold, as
    bench/link_model.py runs it, with --profile: the shim's table covers every op the link model
    counted, with at least its calls and round trips (the profile runs to the process's exit, the
    counts stop after the last timed token), and cuDNN/cuBLAS's module loads and launches show."""
    require(importlib.util.find_spec("torch") is not None, f"torch is not installed in {sys.executable}")
    out, prof = tmp_path / "lm.json", tmp_path / "profile"
    proc = run_client([sys.executable, str(REPO / "bench" / "link_model.py"), "--only", "generate",
                       "--steps", "1", "--warmup", "0", "--json", out, "--profile", prof,
                       "--build-dir", native_build], env=dict(os.environ), timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    counts = json.loads(out.read_text())["workloads"][0]["result"]["counts"]
    counted: dict[str, list[int]] = {}
    for part in ("setup", "steps"):
        for name, op in counts[part]["ops"].items():
            c = counted.setdefault(name, [0, 0])
            c[0] += op["frames"]
            c[1] += op["round_trips"]
    text = (prof / "generate.txt").read_text()
    ops = {r[0]: (int(r[1]), int(r[2])) for r in read_text_table(text, "protocol op") if r[0] != "total"}
    assert set(counted) <= set(ops), set(counted) - set(ops)
    for name, (calls, round_trips) in counted.items():
        assert ops[name][0] >= calls and ops[name][1] >= round_trips, (name, ops[name], calls, round_trips)
        assert ops[name][1] <= ops[name][0]
    total_counted = sum(c[0] for c in counted.values())
    assert sum(c for c, _ in ops.values()) - total_counted <= total_counted // 10
    assert ops["launch"][0] > 100 and ops["module_load"][0] > 0
    eps = {r[0]: int(r[1]) for r in read_text_table(text, "CUDA entry point")}
    assert eps["cuLaunchKernel"] > 100
