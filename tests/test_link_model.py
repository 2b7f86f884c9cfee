"""The link model (bench/link_model.py) and what it stands on: the shim's call counts
(client/shim/call_counts.c, GPUPOOL_CALL_COUNTS=1) and the simulated device's benchmark-only count
mode (worker/sim: key count_only, refused unless GPUPOOL_BENCH_COUNT_MODE=1).

The counts are checked against tests/tools/known_calls.py, a client whose calls per step are
known, through a real gpupoold on a simulated GPU: every frame, round trip, launch and byte.
The prediction arithmetic is checked on numbers worked out by hand."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gpupool_protocol as gp
import pytest
from conftest import REPO, run_client

sys.path.insert(0, str(REPO / "bench"))
import link_model as lm  # noqa: E402 - bench/ is not a package

KNOWN = REPO / "tests" / "tools" / "known_calls.py"
COUNT_MODE_ENV = {"GPUPOOL_SIM_COUNT_ONLY": "true", "GPUPOOL_BENCH_COUNT_MODE": "1"}
STEPS = 5


def known() -> SimpleNamespace:
    """tests/tools/known_calls.py's constants, read without running it (it loads libcuda.so.1)."""
    consts: dict[str, Any] = {}
    for node in ast.parse(KNOWN.read_text()).body:
        if not isinstance(node, ast.Assign):
            continue
        target = node.targets[0]
        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
            for name, value in zip(target.elts, node.value.elts):
                if isinstance(name, ast.Name):
                    consts[name.id] = ast.literal_eval(value)
        elif isinstance(target, ast.Name) and target.id.isupper():
            consts[target.id] = ast.literal_eval(node.value)
    return SimpleNamespace(**consts)


def frame(msg: Any) -> int:
    """Bytes of a frame: the 16-byte header and the encoded body (bulk data not included)."""
    return 16 + len(msg.encode())


def expected_per_step(unknown_kernel: bool) -> dict[str, dict[str, int]]:
    """What known_calls.py sends in one step, op by op, from the protocol's own encodings."""
    k = known()
    axpy_params = bytes(28)  # float a, (pad), float *x, float *y, int n: the C ABI's 28 bytes
    launches = [frame(gp.Launch(params=axpy_params))] * k.KERNEL_LAUNCHES["gp_test_axpy"]
    launches += [frame(gp.Launch())] * (k.KERNEL_LAUNCHES["gp_test_noop"] + int(unknown_kernel))
    dtoh_sync = frame(gp.MemcpyDtohReply(data=k.DTOH_SYNC)) + k.DTOH_SYNC
    sync_reply = frame(gp.StreamSynchronizeReply())
    return {
        "launch": {"frames": len(launches), "round_trips": 0, "detached": 0, "sent": sum(launches),
                   "received": 0, "waited_bytes": 0},
        "memcpy_htod": {"frames": 2, "round_trips": 0, "detached": 0,
                        "sent": 2 * frame(gp.MemcpyHtod()) + k.HTOD_SYNC + k.HTOD_ASYNC,
                        "received": 0, "waited_bytes": 0},
        "memcpy_dtoh": {"frames": 2, "round_trips": 1, "detached": 1, "sent": 2 * frame(gp.MemcpyDtoh()),
                        "received": dtoh_sync + frame(gp.MemcpyDtohReply(data=k.DTOH_ASYNC)) + k.DTOH_ASYNC,
                        "waited_bytes": frame(gp.MemcpyDtoh()) + dtoh_sync},
        "stream_synchronize": {"frames": 1, "round_trips": 1, "detached": 0,
                               "sent": frame(gp.StreamSynchronize()), "received": sync_reply,
                               "waited_bytes": frame(gp.StreamSynchronize()) + sync_reply},
    }


def run_known(server, *args: str, counting: bool = True) -> subprocess.CompletedProcess[str]:
    env = server.client_env({"GPUPOOL_CALL_COUNTS": "1"} if counting else None)
    if not counting:
        env.pop("GPUPOOL_CALL_COUNTS", None)
    return run_client([sys.executable, str(KNOWN), str(STEPS), *args], env=env, timeout=120)


def check_counts(proc: subprocess.CompletedProcess[str], unknown_kernel: bool) -> dict[str, Any]:
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    diff = out["diff"]
    want_ops = {name: {k: v * STEPS for k, v in op.items()} for name, op in expected_per_step(unknown_kernel).items()}
    assert diff["ops"] == want_ops
    k = known()
    launches = sum(k.KERNEL_LAUNCHES.values()) + int(unknown_kernel)
    assert diff["launches"] == launches * STEPS
    assert diff["round_trips"] == 2 * STEPS  # the synchronous cuMemcpyDtoH and cuStreamSynchronize
    assert diff["detached"] == STEPS  # the cuMemcpyDtoHAsync
    assert diff["frames"] == (launches + 5) * STEPS
    assert diff["graph_launches"] == 0 and diff["module_bytes"] == 0
    assert diff["bytes_sent"] == sum(op["sent"] for op in want_ops.values())
    assert diff["bytes_received"] == sum(op["received"] for op in want_ops.values())
    assert diff["waited_bytes"] == sum(op["waited_bytes"] for op in want_ops.values())
    # Set-up happened before the first snapshot: the module went then, with its image.
    assert out["before"]["module_bytes"] >= len(b".version 9.0") and out["before"]["round_trips"] > 0
    step = lm.per_step(diff, STEPS)
    assert step["launches"] == launches and step["round_trips"] == 2
    return out


def test_counts_of_a_known_program(gpupool_server):
    """On the simulated device (kernels run): the counts are exactly the program's calls."""
    out = check_counts(run_known(gpupool_server), unknown_kernel=False)
    assert "count mode" not in out["device"]
    # Without GPUPOOL_CALL_COUNTS the shim counts nothing, and says how to turn it on.
    proc = run_known(gpupool_server, counting=False)
    assert proc.returncode != 0
    assert "set GPUPOOL_CALL_COUNTS=1" in proc.stderr + proc.stdout


def test_count_mode_accepts_any_kernel(start_daemon, native_build):
    """A count-mode gpupoold (the environment link_model.py gives it): a kernel the simulated
    device cannot run is accepted (not run) and counted; the device's name says so."""
    server = start_daemon(build_dir=native_build, env=COUNT_MODE_ENV)
    out = check_counts(run_known(server, "--unknown-kernel"), unknown_kernel=True)
    assert out["device"].endswith("[count mode: kernels not run]")


def test_unknown_kernel_fails_outside_count_mode(gpupool_server):
    proc = run_known(gpupool_server, "--unknown-kernel")
    assert proc.returncode != 0
    assert "my_real_kernel" in proc.stderr and "cannot run on the simulated device" in proc.stderr


def sim_init(native_build: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); print(lib.cuInit(0)); "
            "name = ctypes.create_string_buffer(256); lib.cuDeviceGetName(name, 256, 0); "
            "print(name.value.decode())")
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    return subprocess.run([sys.executable, "-c", code, str(native_build / "libgpupool-sim.so")],
                          env={**base, **env}, capture_output=True, text=True, timeout=60)


def test_count_mode_is_refused_outside_benchmarks(native_build):
    proc = sim_init(native_build, {"GPUPOOL_SIM_COUNT_ONLY": "true"})
    assert proc.stdout.splitlines()[0] == "1"  # CUDA_ERROR_INVALID_VALUE
    assert "count_only = true is a benchmark-only mode" in proc.stderr
    assert "GPUPOOL_BENCH_COUNT_MODE=1" in proc.stderr
    proc = sim_init(native_build, COUNT_MODE_ENV)
    assert proc.stdout.splitlines() == ["0", "NVIDIA H100 80GB HBM3 (gpupool simulated) [count mode: kernels not run]"]
    proc = sim_init(native_build, {})  # never the default
    assert proc.stdout.splitlines() == ["0", "NVIDIA H100 80GB HBM3 (gpupool simulated)"]


# ------------------------------------------------------------------------------ the arithmetic
LAN = lm.Link("lan", "test LAN", rtt_us=100.0, gbit_s=8.0)  # 1e9 bytes/s


def step_counts(round_trips: float, waited: float, streamed: float) -> dict[str, Any]:
    return {"round_trips": round_trips, "bytes_sent": waited + streamed, "bytes_received": 0.0,
            "waited_bytes": waited, "ops": {}}


def test_prediction_arithmetic():
    # 10 round trips at 100 + 6 us, 1 MB waited at 1 GB/s: 1.06 + 1.0 ms waited; 2 MB streamed: 2 ms.
    step = step_counts(10, 1e6, 2e6)
    assert lm.waited_ms(step, LAN, 6.0) == pytest.approx(2.06)
    assert lm.streamed_ms(step, LAN) == pytest.approx(2.0)
    # The stream hides behind a 5 ms GPU step: remote = 5 + 2.06.
    p = lm.predict(step, 5.0, LAN, 6.0)
    assert p["remote_ms"] == pytest.approx(7.06) and p["ratio"] == pytest.approx(7.06 / 5)
    assert p["added_ms"] == pytest.approx(2.06)
    # ...not behind a 1 ms one: remote = max(1, 2) + 2.06.
    p = lm.predict(step, 1.0, LAN, 6.0)
    assert p["remote_ms"] == pytest.approx(4.06) and p["ratio"] == pytest.approx(4.06)
    # Without a native time: the parts, nothing invented.
    p = lm.predict(step, None, LAN, 6.0)
    assert p["ratio"] is None and p["added_ms"] == pytest.approx(4.06)
    # The shortest native step meeting 1.10x: 2.06 / 0.1 = 20.6 ms (the stream hides there).
    need = lm.native_needed_ms(step, LAN, 1.10, 6.0)
    assert need == pytest.approx(20.6)
    assert lm.predict(step, need, LAN, 6.0)["ratio"] == pytest.approx(1.10)
    # A stream-bound step: no round trips, 10 MB streamed (10 ms) meets 1.10x from 10/1.1 ms.
    stream_only = step_counts(0, 0, 1e7)
    need = lm.native_needed_ms(stream_only, LAN, 1.10, 6.0)
    assert need == pytest.approx(10 / 1.1)
    assert lm.predict(stream_only, need, LAN, 6.0)["ratio"] == pytest.approx(1.10)
    assert lm.native_needed_ms(step, LAN, 1.0) == math.inf
    with pytest.raises(ValueError):
        lm.predict(step, 0.0, LAN)


def test_costliest_names_the_round_trips():
    step = step_counts(0, 0, 0)
    step["ops"] = {
        "launch": {"frames": 500, "round_trips": 0, "detached": 0, "sent": 40_000, "received": 0,
                   "waited_bytes": 0},
        "stream_synchronize": {"frames": 3, "round_trips": 3, "detached": 0, "sent": 72, "received": 60,
                               "waited_bytes": 132},
        "memcpy_dtoh": {"frames": 1, "round_trips": 1, "detached": 0, "sent": 44, "received": 2076,
                        "waited_bytes": 2120},
        "mem_free": {"frames": 1, "round_trips": 0, "detached": 0, "sent": 0, "received": 0, "waited_bytes": 0},
    }
    top = lm.costliest(step, LAN, 6.0, top=3)
    assert [t["op"] for t in top] == ["stream_synchronize", "memcpy_dtoh", "launch"]
    assert top[0]["waited_ms"] == pytest.approx(3 * 0.106 + 132e-6)
    assert top[2]["streamed_ms"] == pytest.approx(0.04) and top[2]["waited_ms"] == 0


def test_counts_helpers_and_links():
    before = {**lm.EMPTY_COUNTS, "round_trips": 2, "ops": {"launch": dict.fromkeys(lm.OP_KEYS, 1)}}
    after = {**lm.EMPTY_COUNTS, "round_trips": 6,
             "ops": {"launch": dict.fromkeys(lm.OP_KEYS, 1),
                     "stream_synchronize": {**dict.fromkeys(lm.OP_KEYS, 0), "frames": 4, "round_trips": 4}}}
    diff = lm.diff_counts(before, after)
    assert diff["round_trips"] == 4 and list(diff["ops"]) == ["stream_synchronize"]
    assert lm.per_step(diff, 4)["ops"]["stream_synchronize"]["round_trips"] == 1.0
    with pytest.raises(ValueError):
        lm.per_step(diff, 0)
    assert lm.parse_link("dc=12:40") == lm.Link("dc", "dc (12 us)", 12.0, 40.0)
    for bad in ("dc", "dc=x:1", "=1:1", "dc=1:0"):
        with pytest.raises(Exception, match="--link"):
            lm.parse_link(bad)
    assert {lk.name: (lk.rtt_us, lk.gbit_s) for lk in lm.DEFAULT_LINKS} == {
        "loopback": (20.0, 28.0), "25gbe": (10.0, 25.0), "100gbe": (5.0, 100.0), "1gbe": (200.0, 1.0)}


def test_report_from_saved_counts(tmp_path, capsys):
    """--counts models an earlier run's counts: per-step table, ratios, the costliest calls."""
    per_step_ops = expected_per_step(unknown_kernel=False)
    steps = 4
    counts = {k: 0 for k in lm.TOTAL_KEYS}
    for op in per_step_ops.values():
        counts["frames"] += op["frames"] * steps
        counts["round_trips"] += op["round_trips"] * steps
        counts["bytes_sent"] += op["sent"] * steps
        counts["bytes_received"] += op["received"] * steps
        counts["waited_bytes"] += op["waited_bytes"] * steps
    counts["launches"] = per_step_ops["launch"]["frames"] * steps
    counts["ops"] = {n: {k: v * steps for k, v in op.items()} for n, op in per_step_ops.items()}
    setup = {**lm.EMPTY_COUNTS, "module_bytes": 5_000_000}
    result = {"steps": steps, "counts": {"setup": setup, "steps": counts}}
    saved = {"meta": {"device": "sim", "torch": "x"}, "workloads": [{"workload": "mlp", "result": result}]}
    path = tmp_path / "counts.json"
    path.write_text(json.dumps(saved))
    out_json = tmp_path / "model.json"
    assert lm.main(["--counts", str(path), "--only", "mlp", "--native-ms", "mlp=2", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "stream_synchronize: 1 round trips" in text
    row = json.loads(out_json.read_text())["workloads"][0]
    assert row["per_step"]["round_trips"] == 2 and row["per_step"]["launches"] == 7
    lan = row["links"]["1gbe"]  # 2 round trips at 206 us, plus bytes at 125 MB/s
    step = lm.per_step(counts, steps)
    want = max(2.0, lm.streamed_ms(step, lm.DEFAULT_LINKS[3])) + lm.waited_ms(step, lm.DEFAULT_LINKS[3])
    assert lan["remote_ms"] == pytest.approx(want) and lan["ratio"] == pytest.approx(want / 2)
    assert lan["module_s"] == pytest.approx(5e6 / 125e6)
    assert f"{want / 2:.2f}x" in text
    with pytest.raises(SystemExit, match="unknown workloads"):
        lm.main(["--counts", str(path), "--native-ms", "nope=1"])


ATTRIBUTE_SETS = r'''
import ctypes, json, sys
sys.path.insert(0, sys.argv[1])
import link_model
cuda = ctypes.CDLL("libcuda.so.1")
def ok(name, *args):
    rc = getattr(cuda, name)(*args)
    assert rc == 0, f"{name}: CUresult {rc}"
p = ctypes.c_void_p
ok("cuInit", 0)
dev, ctx, mod, fn = ctypes.c_int(), p(), p(), p()
ok("cuDeviceGet", ctypes.byref(dev), 0)
ok("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
ok("cuCtxSetCurrent", ctx)
ptx = b".version 9.0\n.target sm_90\n.address_size 64\n.visible .entry gp_test_noop()\n{\n\tret;\n}\n"
ok("cuModuleLoadData", ctypes.byref(mod), ctypes.c_char_p(ptx))
ok("cuModuleGetFunction", ctypes.byref(fn), mod, b"gp_test_noop")
MAX_DYN_SMEM, CARVEOUT = 8, 9  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, _PREFERRED_..
value = ctypes.c_int()
def sets():
    return link_model.read_counts()["ops"].get("func_set_attribute", {}).get("frames", 0)
def get(attr):
    ok("cuFuncGetAttribute", ctypes.byref(value), attr, fn)
    return value.value
out = {"start": sets()}
for _ in range(5):  # as libraries do before every launch
    ok("cuFuncSetAttribute", fn, MAX_DYN_SMEM, 65536)
    ok("cuFuncSetAttribute", fn, CARVEOUT, 50)
    ok("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, None, None, None)
out["same"] = sets()
out["got"] = get(MAX_DYN_SMEM)
ok("cuFuncSetAttribute", fn, MAX_DYN_SMEM, 32768)
out["other"] = sets()
out["got_other"] = get(MAX_DYN_SMEM)
ok("cuFuncSetAttribute", fn, MAX_DYN_SMEM, 65536)
out["back"] = sets()
out["got_back"] = get(MAX_DYN_SMEM)
out["too_big"] = cuda.cuFuncSetAttribute(fn, MAX_DYN_SMEM, 1 << 30)
out["after_error"] = sets()
def gets():
    return link_model.read_counts()["ops"].get("func_get_attribute", {}).get("frames", 0)
before = gets()
out["unknown_attr"] = [cuda.cuFuncGetAttribute(ctypes.byref(value), 16, fn) for _ in range(4)]
out["unknown_gets"] = gets() - before
ok("cuCtxSynchronize")
print(json.dumps(out))
'''


def test_repeated_attribute_sets_need_no_round_trip(gpupool_server):
    """A set of the value an attribute already has (libraries set the same one before every
    launch) is answered by the shim: one round trip per attribute, not one per launch; a new
    value still goes to the server, and reads show what was set. A read of an attribute the
    driver does not have is refused without asking again."""
    env = gpupool_server.client_env({"GPUPOOL_CALL_COUNTS": "1"})
    proc = run_client([sys.executable, "-c", ATTRIBUTE_SETS, str(REPO / "bench")], env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"] - out["start"] == 2  # 10 sets of two attributes: each sent once
    assert out["got"] == 65536
    assert out["other"] - out["same"] == 1 and out["got_other"] == 32768
    assert out["back"] - out["other"] == 1 and out["got_back"] == 65536
    assert out["too_big"] != 0  # refused by the server: not taken for the attribute's value
    assert out["after_error"] - out["back"] == 1
    # An attribute number the driver does not have (cuDNN asks for CU_FUNC_ATTRIBUTE_MAX, 16):
    # refused each time, asked of the server once.
    assert out["unknown_attr"] == [1] * 4 and out["unknown_gets"] == 1  # CUDA_ERROR_INVALID_VALUE
