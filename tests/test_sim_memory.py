"""Simulated GPUs' device memory lives in sparse files in /dev/shm (gpupoold/gpu/sim.py), in RAM
until reboot: a clean stop removes them (not those of a GPU whose lease goes on without
gpupoold), and a start removes this user's folders whose state directory is gone, never another
user's, never a link."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import daemon_env, require
from test_e2e_leases import MIB, gpu_states, hold_gpu, start_client, wait_until  # noqa: F401

from gpupoold.gpu.sim import (
    SHM,
    STATE_DIR_NOTE,
    private_memory_folder,
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


# ---------------------------------------------------------- a folder made in advance (issue 29)
OTHER_UID = 65534  # nobody


def serve_simulated(state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpupoold", "serve", "--simulated", "1", "--state-dir", str(state),
         "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"],
        capture_output=True, text=True, env=daemon_env(), timeout=60)


@pytest.mark.parametrize("made", ["another user's folder", "a link to one"])
def test_a_memory_folder_someone_made_in_advance_stops_the_start_and_is_left_alone(
        shm: Path, made: str) -> None:
    """/dev/shm is writable by every user and the folder's name is predictable: a folder there
    that is not gpupoold's own (another user's, or a link to one) would let its maker read every
    tenant's device memory. gpupoold refuses to start the simulated GPUs, says why, and writes
    nothing there."""
    require(os.geteuid() == 0, "making another user's folder needs root")
    state = shm / "state"
    state.mkdir()
    folder = sim_memory_dir(state)
    # Theirs: in /dev/shm beside ours (for the link) or at our folder's name (made first).
    theirs = SHM / f"{folder.name}-theirs" if made == "a link to one" else folder
    theirs.mkdir()
    (theirs / "planted").write_text("x")
    os.chown(theirs, OTHER_UID, OTHER_UID)
    try:
        if made == "a link to one":
            folder.symlink_to(theirs)
        before = sorted(p.name for p in folder.iterdir())
        proc = serve_simulated(state)
        assert proc.returncode != 0, proc.stderr
        why = "is a symbolic link" if made == "a link to one" else \
            f"belongs to uid {OTHER_UID}, not to gpupoold's user"
        assert f"the simulated GPUs' memory folder {folder} {why}" in proc.stderr, proc.stderr
        assert f"rm -r {folder}" in proc.stderr
        assert sorted(p.name for p in folder.iterdir()) == before == ["planted"]
    finally:
        if folder.is_symlink():
            folder.unlink()
        for p in theirs.iterdir():
            p.unlink()
        theirs.rmdir()


def test_our_own_folder_open_to_others_is_closed(shm: Path) -> None:
    folder = shm / "ours"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    private_memory_folder(folder)
    assert folder.stat().st_mode & 0o777 == 0o700


def test_the_simulated_device_opens_no_memory_file_through_a_link(
        native_build: Path, tmp_path: Path) -> None:
    """The worker's simulated device refuses a memory file that is a link (O_NOFOLLOW) or that
    belongs to another user, and leaves the file the link points to alone."""
    lib = native_build / "libgpupool-sim.so"
    require(lib.is_file(), f"{lib} is built by make")
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    link = tmp_path / "gpu0.mem"
    link.symlink_to(target)
    conf = tmp_path / "sim.conf"
    conf.write_text(f"name = test simulated\ntotal_memory = {64 << 20}\nmemory_file = {link}\n")
    probe = (f"import ctypes; lib = ctypes.CDLL({str(lib)!r}); rc = lib.cuInit(0); "
             "lib.gpupoolSimLastErrorDetail.restype = ctypes.c_char_p; "
             "print(rc, lib.gpupoolSimLastErrorDetail().decode())")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**os.environ, "GPUPOOL_SIM_CONFIG": str(conf)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rc, _, detail = proc.stdout.strip().partition(" ")
    assert rc != "0" and f"cannot open the memory file {link}" in detail, proc.stdout
    assert target.stat().st_size == 0  # not grown through the link
