"""Simulated GPUs' device memory lives in sparse files in /dev/shm (gpupoold/gpu/sim.py), in RAM
until reboot: a clean stop removes them (not those of a GPU whose lease goes on without
gpupoold), and a start removes this user's folders whose state directory is gone, never another
user's, never a link."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import require
from test_e2e_leases import MIB, gpu_states, hold_gpu, start_client, wait_until  # noqa: F401

from gpupoold.gpu.sim import (
    SHM,
    STATE_DIR_NOTE,
    remove_sim_memory,
    remove_stale_sim_memory,
    sim_memory_dir,
)


def shm_folder(tag: str, owner: Path) -> Path:
    folder = SHM / f"gpupool-sim-{os.getuid()}-{tag}"
    folder.mkdir()
    (folder / STATE_DIR_NOTE).write_text(f"{owner}\n")
    (folder / "gpu0.mem").write_bytes(b"tenant data")
    return folder


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    require(SHM.is_dir() and os.access(SHM, os.W_OK), "/dev/shm is not writable here")
    return tmp_path


def test_a_start_removes_only_this_users_stale_folders(shm: Path) -> None:
    tag = f"test{os.getpid()}"
    gone = shm_folder(f"{tag}a", shm / "deleted-state-dir")
    alive_dir = shm / "live-state-dir"
    alive_dir.mkdir()
    alive = shm_folder(f"{tag}b", alive_dir)
    foreign = shm_folder(f"{tag}c", shm / "deleted-too")
    link = SHM / f"gpupool-sim-{os.getuid()}-{tag}d"
    link.symlink_to(foreign)
    try:
        if os.geteuid() == 0:  # a folder named as ours but owned by someone else: not ours
            os.chown(foreign, 65534, 65534)
        removed = remove_stale_sim_memory(shm / "my-state-dir")
        assert gone in removed and not gone.exists()
        assert alive.exists() and (alive / "gpu0.mem").exists()
        assert link.is_symlink() and link not in removed
        if os.geteuid() == 0:
            assert foreign.exists() and foreign not in removed
    finally:
        link.unlink(missing_ok=True)
        for f in (gone, alive, foreign):
            subprocess.run(["rm", "-rf", str(f)], check=False)


def test_a_clean_stop_removes_the_files_except_a_kept_gpus(shm: Path) -> None:
    state = shm / "state"
    state.mkdir()
    folder = sim_memory_dir(state)
    folder.mkdir(parents=True)
    (folder / STATE_DIR_NOTE).write_text(f"{state.resolve()}\n")
    for i in range(3):
        (folder / f"gpu{i}.mem").write_bytes(b"x")
    try:
        removed = remove_sim_memory(state, 3, frozenset({1}))
        assert sorted(p.name for p in removed) == ["gpu0.mem", "gpu2.mem"]
        assert (folder / "gpu1.mem").exists()  # its lease goes on: its memory too
        assert remove_sim_memory(state, 3) == [folder / "gpu1.mem"]
        assert not folder.exists() or folder.parent != SHM
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=False)


def test_a_daemon_cleans_up_at_a_clean_stop_and_keeps_a_continuing_leases_memory(
        start_daemon: Any, native_build: Path, hold_gpu: Path,  # noqa: F811
        clients: list[Any]) -> None:
    server = start_daemon("--simulated", "2", build_dir=native_build, simulated=None)
    wait_until("both GPUs free", lambda: gpu_states(server) == ["free", "free"])
    folder = sim_memory_dir(server.state_dir)
    holder = start_client(server, hold_gpu, MIB, 5_000, seed=51)
    clients.append(holder)
    assert holder.stdout is not None and "holding" in holder.stdout.readline()
    assert sorted(p.name for p in folder.glob("gpu*.mem"))  # the lease wrote its memory
    gpu = server.get_json("/api/v1/leases?state=active")["leases"][0]["gpu_index"]
    assert server.stop() == 0
    assert "lease(s) continue without gpupoold" in server.log_text()
    assert (folder / f"gpu{gpu}.mem").exists()  # the worker still uses it
    assert not (folder / f"gpu{1 - gpu}.mem").exists()
    holder.communicate(timeout=60)
    # The next start (no lease left to take over) and its clean stop remove the rest.
    again = start_daemon("--simulated", "2", build_dir=native_build, simulated=None,
                         state_dir=server.state_dir)
    wait_until("both GPUs free", lambda: gpu_states(again) == ["free", "free"], timeout=30)
    assert again.stop() == 0
    assert "removed the simulated GPUs' memory" in again.log_text()
    assert not list(folder.glob("gpu*.mem"))
    if folder.parent == SHM:
        assert not folder.exists()
