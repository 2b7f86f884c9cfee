"""A simulated GPU shared by several processes (worker/sim/sim_shared.c, key shared_dir).

The C tests (tests/sim/test_sim_shared.c, marked `san` like the other sim tests) run tenant
processes side by side on one simulated GPU: memory shared up to the GPU's size, leftovers of a
freed or dead tenant visible to the next (the precondition of issue 32's isolation test), a dead
tenant's memory taken back, kernels in turns, and the default mode unchanged. Here also the scrub
on a shared GPU (it takes back and clears what a dead tenant left), two gpupool-workers sharing
one simulated GPU as gpupoold will run a GPU's shares (under their sandbox), and the workers'
pacing by share weight (worker/pacing.c, through tests/sim/test_pacing.c).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from pathlib import Path

import gpupool_protocol as gp
import pytest
from test_scrub import scrub
from test_sim_device import SIZES, memtool
from test_worker_control import SIM, WORKER, Client, exited, start_session

from gpupoold.gpu.inventory import Gpu
from gpupoold.workers.supervisor import WorkerSupervisor

MIB = 1 << 20
CUDA_ERROR_OUT_OF_MEMORY = 2


@pytest.mark.san
def test_c_suite(native_build):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUPOOL_SIM_", "GP_SIM_TEST_"))}
    proc = subprocess.run(
        [str(native_build / "tests" / "test_sim_shared")], capture_output=True, text=True, env=env, timeout=300
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"test_sim_shared ({native_build.name}) failed:\n{output[-8000:]}"
    assert len(re.findall(r"^PASS ", proc.stdout, re.M)) == 9, output


def shared_env(shared: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_SIM_")}
    env.update(GPUPOOL_SIM_TOTAL_MEMORY="256MiB", GPUPOOL_SIM_SHARED_DIR=str(shared))
    return env


@pytest.mark.san
def test_scrub_takes_back_and_clears_a_dead_tenants_memory(native_build, tmp_path):
    env = shared_env(tmp_path)
    memtool(native_build, env, "fill", 7, *SIZES)  # exits holding its memory, as a crash would
    left = memtool(native_build, env, "check", 7, *SIZES)
    assert [a["pattern"] for a in left["allocations"]] == SIZES  # something to wipe
    # The memory file is in the shared directory (no memory_file given), one per GPU (UUID).
    assert len(list(tmp_path.glob("gpu-*.mem"))) == 1 and len(list(tmp_path.glob("gpu-*.state"))) == 1

    code, result, stderr = scrub(
        native_build, "--driver", native_build / "libgpupool-sim.so", "--device", 0, "--simulated", env=env
    )
    assert code == 0, stderr
    assert result["ok"] is True
    assert result["free_before"] == result["total"] == 256 * MIB  # the dead tenants' memory came back
    assert result["bytes"] == 256 * MIB

    after = memtool(native_build, env, "check", 7, *SIZES)
    assert [a["zero"] for a in after["allocations"]] == SIZES


def test_pacing_gives_each_share_its_weights_part(native_build):
    """worker/pacing.c (issue 32, item 4) with two busy shares on one shared simulated GPU, over
    3 s each: equal weights 40-60 % each, weights 3:1 65-85 % for the heavier (tests/sim/test_pacing.c
    counts the kernels each completed; without pacing the 3:1 case gets about half)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUPOOL_SIM_", "GPUPOOL_WORKER_"))}
    proc = subprocess.run(
        [str(native_build / "tests" / "test_pacing")], capture_output=True, text=True, env=env, timeout=120
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"test_pacing failed:\n{output[-8000:]}"
    assert len(re.findall(r"^PASS ", proc.stdout, re.M)) == 3, output  # and a share's move


async def test_two_workers_share_one_simulated_gpu(native_build, tmp_path):
    """Through gpupool-worker, as gpupoold's supervisor will run the shares of one GPU: the shared
    directory in the GPU's worker environment and among its sandbox's writable folders. The
    second worker's allocation past what the first left fails as on a full GPU, and its memory
    info counts the first's memory."""
    shared = tmp_path / "shared"
    shared.mkdir()
    gpu = Gpu(
        index=0,
        name="simulated",
        uuid="",
        simulated=True,
        driver=str(SIM),
        ordinal=0,
        env={"GPUPOOL_SIM_SHARED_DIR": str(shared), "GPUPOOL_SIM_TOTAL_MEMORY": "256MiB"},
        writable=(str(shared),),
    )
    sup = WorkerSupervisor(WORKER, tmp_path / "cache")
    clients = [Client(), Client()]
    try:
        workers = [await sup.spawn(gpu), await sup.spawn(gpu)]
        for i, (w, c) in enumerate(zip(workers, clients)):
            assert await start_session(w, 40 + i, c)
            assert (await asyncio.to_thread(c.hello_reply)).result == 0
        first, second = clients
        r, _ = await asyncio.to_thread(first.call, gp.MemAlloc(size=160 * MIB, stream=0, flags=0))
        assert r.result == 0
        held = r.mapped_size
        r, _ = await asyncio.to_thread(second.call, gp.MemGetInfo())
        assert (r.result, r.total) == (0, 256 * MIB)
        assert r.free <= 256 * MIB - held
        r, _ = await asyncio.to_thread(second.call, gp.MemAlloc(size=160 * MIB, stream=0, flags=0))
        assert r.result == CUDA_ERROR_OUT_OF_MEMORY
        r, _ = await asyncio.to_thread(second.call, gp.MemAlloc(size=64 * MIB, stream=0, flags=0))
        assert r.result == 0
        for w, c in zip(workers, clients):
            c.post(gp.Goodbye())
            assert (await exited(w)).reason == "client exit"
    finally:
        for c in clients:
            c.close()
        await sup.stop_all(grace=10)
    assert list(shared.glob("gpu-*.state"))  # the workers used the shared directory
