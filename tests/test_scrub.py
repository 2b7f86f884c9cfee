"""gpupool-scrub (worker/scrub) and gpupoold/gpu/scrub.py: wiping a GPU's memory between tenants.

On the simulated device with a memory file, a tenant process writes a pattern and exits; the
pattern is still there for the next process (the precondition that makes these tests able to
fail); after the scrub a new tenant allocating the same memory reads only zeros. The failure paths
use a stand-in driver (tests/sim/scrub_fake_driver.c) that fails any stage on request, and small
scripts in place of the binary for run_scrub's own handling (timeout, crash, garbage).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
from conftest import BUILD_DIR
from test_sim_device import SIZES, allocated_bytes, memtool, sim_env

from gpupoold.gpu.inventory import Gpu
from gpupoold.gpu.scrub import ScrubResult, run_scrub
from gpupoold.gpu.sim import sim_memory_file, write_sim_config
from gpupoold.paths import SCRUB_NAME

MIB = 1 << 20
SIM_NAME = "Test GPU (gpupool simulated)"


def scrub(build: Path, *args: object, env: dict[str, str] | None = None) -> tuple[int, dict, str]:
    """Run gpupool-scrub; (exit code, the parsed JSON line, stderr)."""
    proc = subprocess.run([str(build / SCRUB_NAME), *map(str, args)], capture_output=True, text=True,
                          env=env if env is not None else sim_env(None), timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"expected one JSON line on stdout, got {proc.stdout!r}\n{proc.stderr}"
    return proc.returncode, json.loads(lines[0]), proc.stderr


def fake(build: Path, *args: object, **fake_env: object) -> tuple[int, dict, str]:
    """Run gpupool-scrub on the stand-in driver, configured by FAKE_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_")}
    env.update({f"FAKE_{k.upper()}": str(v) for k, v in fake_env.items()})
    return scrub(build, "--driver", build / "tests" / "libscrub_fake_driver.so", "--device", 0, *args,
                 env=env)


# ------------------------------------------------------------------- on the simulated device
@pytest.mark.san
def test_scrub_wipes_what_the_last_tenant_left(native_build, tmp_path):
    mem = tmp_path / "gpu0.mem"
    env = sim_env(mem, total="256MiB")
    memtool(native_build, env, "fill", 11, *SIZES)
    left = memtool(native_build, env, "check", 11, *SIZES)
    assert [a["pattern"] for a in left["allocations"]] == SIZES  # there is something to wipe

    code, result, stderr = scrub(native_build, "--driver", native_build / "libgpupool-sim.so",
                                 "--device", 0, "--simulated", env=env)
    assert code == 0, stderr
    assert result["ok"] is True
    assert set(result) == {"ok", "bytes", "allocations", "free_before", "total", "samples",
                           "duration_s", "init_s"}
    assert result["total"] == 256 * MIB
    assert result["free_before"] == 256 * MIB  # the last tenant's process is gone
    assert result["bytes"] == result["free_before"]
    assert result["allocations"] >= 1
    assert result["samples"] >= 256 + 2 * result["allocations"]
    assert 0 <= result["init_s"] <= result["duration_s"]
    assert "allocation 1:" in stderr  # progress

    after = memtool(native_build, env, "check", 11, *SIZES)
    assert [a["zero"] for a in after["allocations"]] == SIZES
    assert allocated_bytes(mem) < MIB  # holes, not written zeros


@pytest.mark.san
def test_scrub_reports_a_sim_configuration_error(native_build):
    env = sim_env(None, total="12 bananas")
    code, result, _ = scrub(native_build, "--driver", native_build / "libgpupool-sim.so", "--device", 0,
                            env=env)
    assert code == 1
    assert result["ok"] is False and result["stage"] == "init"
    assert "cuInit failed: CUDA_ERROR_INVALID_VALUE" in result["error"]
    assert "total_memory" in result["error"]  # the simulated device's detail


@pytest.mark.san
def test_scrub_driver_that_does_not_load(native_build, tmp_path):
    code, result, stderr = scrub(native_build, "--driver", tmp_path / "libcuda.so.1", "--device", 0)
    assert code == 1
    assert result == {"ok": False, "stage": "init", "error": result["error"]}
    assert "cannot load the driver" in result["error"] and str(tmp_path) in result["error"]
    assert "failed (init)" in stderr


@pytest.mark.san
@pytest.mark.parametrize("args, complaint", [
    ([], "--driver and --device are required"),
    (["--driver", "x.so"], "--driver and --device are required"),
    (["--driver", "x.so", "--device", "zero"], "expected a device ordinal"),
    (["--driver", "x.so", "--device", "0", "--min-chunk", "100"], "--min-chunk 100"),
    (["--driver", "x.so", "--device", "0", "--samples", "-1"], "--samples -1"),
    (["--driver", "x.so", "--device", "0", "--wipe-harder"], "unknown option --wipe-harder"),
    (["--driver", "x.so", "--device"], "--device needs a value"),
])
def test_scrub_command_line_errors(native_build, args, complaint):
    code, result, _ = scrub(native_build, *args)
    assert code == 1
    assert result["ok"] is False and result["stage"] == "init"
    assert complaint in result["error"]


# ------------------------------------------------------------------ on the stand-in driver
@pytest.mark.san
def test_scrub_shrinks_chunks_until_all_free_memory_is_taken(native_build):
    # 100 MiB free, nothing over 24 MiB in one piece: 100 -> 50 -> 25 (refused) -> 12.5 MiB x 8.
    code, result, stderr = fake(native_build, max_chunk=24 * MIB)
    assert code == 0, stderr
    assert result["bytes"] == result["free_before"] == 100 * MIB
    assert result["allocations"] == 8
    assert stderr.count("gpupool-scrub: allocation ") == 8


@pytest.mark.san
def test_scrub_samples_first_last_and_random_pieces(native_build):
    code, result, _ = fake(native_build, "--samples", 10, max_chunk=24 * MIB)
    assert code == 0
    assert result["samples"] == 10 + 2 * 8
    code, result, _ = fake(native_build, "--samples", 0)
    assert result["samples"] == 2 and result["allocations"] == 1


@pytest.mark.san
def test_scrub_stops_at_min_chunk(native_build):
    # 101 MiB free in pieces of at most 24 MiB: the first chunk is 100 MiB (rounded down to 2 MiB),
    # which halves to 12.5 MiB pieces; the MiB left over is below --min-chunk (2 MiB).
    code, result, _ = fake(native_build, free=101 * MIB, max_chunk=24 * MIB)
    assert code == 0
    assert result["free_before"] == 101 * MIB
    assert result["bytes"] == 100 * MIB  # 8 x 12.5 MiB; the last MiB: 1.56 MiB chunks are too small
    code, small, _ = fake(native_build, "--min-chunk", "32MiB", free=101 * MIB, max_chunk=24 * MIB)
    assert code == 1 and small["stage"] == "alloc"
    assert "no allocation of 33554432 bytes or more succeeded" in small["error"]


@pytest.mark.san
def test_scrub_of_a_driver_that_never_runs_out(native_build):
    code, result, _ = fake(native_build, never_oom=1)
    assert code == 0
    assert result["bytes"] <= result["total"]


@pytest.mark.san
@pytest.mark.parametrize("stage, fail, expected", [
    ("init", "init", "cuInit failed: CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)"),
    ("alloc", "alloc", "cuMemAlloc_v2(104857600 bytes) failed"),
    ("memset", "memset", "CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)"),
    ("sync", "sync", "cuCtxSynchronize after zeroing failed: CUDA_ERROR_ILLEGAL_ADDRESS"),
    ("verify", "copy", "cuMemcpyDtoH_v2 of 4096 bytes"),
    ("verify", "dirty", "1 of 4096 bytes read back"),
    ("free", "free", "cuMemFree_v2(0x7e0000000000) failed: CUDA_ERROR_INVALID_VALUE"),
])
def test_scrub_failure_names_stage_and_cause(native_build, stage, fail, expected):
    code, result, stderr = fake(native_build, fail=fail)
    assert code == 1
    assert result["ok"] is False and result["stage"] == stage
    assert expected in result["error"]
    assert f"failed ({stage})" in stderr
    if stage != "init":
        assert "quarantined" in result["error"]  # what to do


@pytest.mark.san
def test_scrub_refuses_a_real_driver_said_to_be_simulated(native_build):
    code, result, _ = fake(native_build, "--simulated")
    assert code == 1 and result["stage"] == "init"
    assert "is not the simulated device" in result["error"]


# ---------------------------------------------------------------------- gpupoold/gpu/scrub.py
def sim_gpu(tmp_path: Path, build: Path, memory_gib: int = 1) -> Gpu:
    conf = write_sim_config(tmp_path, "test-server", 0, SIM_NAME, memory_gib)
    return Gpu(index=0, name=SIM_NAME, uuid="GPU-test", simulated=True,
               driver=str(build / "libgpupool-sim.so"), ordinal=0, env={"GPUPOOL_SIM_CONFIG": str(conf)})


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "fake-scrub"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_daemon_sim_config_names_a_memory_file(tmp_path):
    conf = write_sim_config(tmp_path, "test-server", 3, SIM_NAME, 2)
    mem = sim_memory_file(tmp_path, 3)
    assert f"memory_file = {mem}\n" in conf.read_text()
    assert mem.parent.is_dir() and mem.is_absolute()
    # One folder per state dir: another daemon's simulated memory is elsewhere.
    assert sim_memory_file(tmp_path / "other", 3).parent != mem.parent


@pytest.mark.san
async def test_run_scrub_on_a_simulated_gpu(native_build, tmp_path):
    gpu = sim_gpu(tmp_path, native_build)
    mem = sim_memory_file(tmp_path, 0)
    env = {**sim_env(None), **gpu.env}
    del env["GPUPOOL_SIM_TOTAL_MEMORY"]  # the config file's 1 GiB
    memtool(native_build, env, "fill", 5, *SIZES)
    assert mem.stat().st_size == 1 << 30
    result = await run_scrub(native_build / SCRUB_NAME, gpu, timeout=120)
    assert result.ok, result.error
    assert result.error == ""
    assert result.bytes == 1 << 30 == result.detail["bytes"]
    assert result.duration_s == result.detail["duration_s"]
    after = memtool(native_build, env, "check", 5, *SIZES)
    assert [a["zero"] for a in after["allocations"]] == SIZES


@pytest.mark.san
async def test_run_scrub_reports_the_stage(native_build, tmp_path, caplog):
    gpu = Gpu(index=2, name="x", uuid="", simulated=False, driver=str(tmp_path / "missing.so"), ordinal=0)
    with caplog.at_level(logging.INFO, logger="gpupoold.scrub"):
        result = await run_scrub(native_build / SCRUB_NAME, gpu, timeout=60)
    assert not result.ok and result.bytes == 0
    assert result.error.startswith("stage init: cannot load the driver")
    assert result.detail["stage"] == "init"
    # Logged as an error, with what failed and what to do.
    failed = [r for r in caplog.records if "scrub of GPU 2 failed" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.ERROR]
    assert "cannot load the driver" in failed[0].getMessage()
    assert "`gpupoold gpu clear 2`" in failed[0].getMessage()


async def test_run_scrub_passes_the_contract_arguments_and_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/nonexistent/libshim.so")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    seen = tmp_path / "seen"
    line = json.dumps({"ok": True, "bytes": 4096, "allocations": 1, "free_before": 4096, "total": 8192,
                       "samples": 1, "duration_s": 0.5, "init_s": 0.1})
    binary = script(tmp_path, f'''
echo "$@" > {seen}
echo "order=$CUDA_DEVICE_ORDER preload=${{LD_PRELOAD-unset}} mine=$GPU_OWN" >> {seen}
echo progress >&2
echo '{line}'
''')
    gpu = Gpu(index=1, name="x", uuid="", simulated=True, driver="/drv.so", ordinal=3, env={"GPU_OWN": "yes"})
    result = await run_scrub(binary, gpu, timeout=30)
    assert result == ScrubResult(True, 4096, 0.5, "", result.detail)
    assert result.detail["total"] == 8192
    assert seen.read_text().splitlines() == ["--driver /drv.so --device 3 --simulated",
                                             "order=PCI_BUS_ID preload=unset mine=yes"]


async def test_run_scrub_kills_a_scrub_that_hangs(tmp_path):
    pidfile = tmp_path / "pid"
    binary = script(tmp_path, f"echo $$ > {pidfile}\necho started >&2\nexec sleep 600\n")
    gpu = Gpu(index=0, name="x", uuid="", simulated=True, driver="/drv.so", ordinal=0)
    result = await run_scrub(binary, gpu, timeout=1.0)
    assert not result.ok
    assert "did not finish within 1 s and was killed" in result.error
    assert "last output: started" in result.error
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(int(pidfile.read_text()), 0)


@pytest.mark.parametrize("body, expected", [
    ("echo hello\n", "exited with code 0 without a result (last output: no output)"),
    ("echo dying >&2\nkill -SEGV $$\n", "was killed by SIGSEGV without a result (last output: dying)"),
    ('echo \'{"ok":true}\'\n', "with an inconsistent result"),
    ('echo \'{"ok":false,"stage":"polish","error":"x"}\'\nexit 1\n', "unexpected result"),
    ('echo \'{"ok":true,"bytes":1,"duration_s":1}\'\nexit 3\n', "exited with code 3 with an inconsistent"),
])
async def test_run_scrub_bad_output(tmp_path, body, expected):
    gpu = Gpu(index=0, name="x", uuid="", simulated=False, driver="/drv.so", ordinal=0)
    result = await run_scrub(script(tmp_path, body), gpu, timeout=30)
    assert not result.ok
    assert expected in result.error


async def test_run_scrub_missing_binary_or_driver(tmp_path):
    gpu = Gpu(index=0, name="x", uuid="", simulated=False, driver="/drv.so", ordinal=0)
    result = await run_scrub(tmp_path / "no-such-scrub", gpu, timeout=30)
    assert not result.ok and "cannot start the scrub binary" in result.error
    no_driver = Gpu(index=4, name="x", uuid="", simulated=True, driver="", ordinal=0)
    result = await run_scrub(BUILD_DIR / SCRUB_NAME, no_driver, timeout=30)
    assert not result.ok and "GPU 4 has no driver library" in result.error


def test_simulated_memory_falls_back_to_the_state_dir_without_a_big_dev_shm(tmp_path, monkeypatch):
    import gpupoold.gpu.sim as sim

    monkeypatch.setattr(sim, "SHM_MIN_FREE", 1 << 62)  # no /dev/shm is that big
    assert sim.sim_memory_file(tmp_path, 1) == tmp_path.resolve() / "sim" / "gpu1.mem"
    monkeypatch.setattr(sim, "SHM", tmp_path / "no-such-dir")
    monkeypatch.setattr(sim, "SHM_MIN_FREE", 0)
    assert sim.sim_memory_dir(tmp_path) == tmp_path.resolve() / "sim"
