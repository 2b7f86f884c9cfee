"""The workers' PTX JIT cache (issue 31, item 2; setting `jit_cache_mib`): the CUDA driver's
compiled PTX kept in `<cache_dir>/jit` for every worker of the server, so that a module (cuDNN's
runtime-compiled kernels, Triton's, NVRTC's) is compiled once per server, not once per load.
Tested here: what gpupoold gives its workers. tests/test_e2e_modules.py shows, through the
simulated device's stand-in cache (worker/sim/sim_jitcache.c), a sandboxed worker writing it and
a second lease finding the first one's entries; docs/validation.md says what a GPU shows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import GpupoolServer, wait_until
from test_e2e_leases import gpu_states, worker_pids

from gpupoold.config.file import ConfigError, load_settings
from gpupoold.gpu.environment import with_jit_cache
from gpupoold.gpu.inventory import Gpu
from gpupoold.workers.supervisor import WorkerSupervisor

GPU = Gpu(0, "g", "", True, "/lib/sim.so", 0)


def test_the_workers_share_a_jit_cache_under_the_cache_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CUDA_CACHE_PATH", "CUDA_CACHE_MAXSIZE", "CUDA_CACHE_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    env = WorkerSupervisor(tmp_path / "w", tmp_path / "cache", jit_cache_mib=512).environment(GPU)
    assert env["CUDA_CACHE_PATH"] == str(tmp_path / "cache" / "jit")
    assert env["CUDA_CACHE_MAXSIZE"] == str(512 << 20)
    assert "CUDA_CACHE_DISABLE" not in env
    # 0 turns it off (the driver's own default folder is unreachable anyway: no HOME).
    env = WorkerSupervisor(tmp_path / "w", tmp_path / "cache", jit_cache_mib=0).environment(GPU)
    assert env["CUDA_CACHE_DISABLE"] == "1" and "CUDA_CACHE_PATH" not in env


def test_an_operators_own_cuda_cache_settings_win(tmp_path: Path) -> None:
    mine = {"CUDA_CACHE_PATH": "/srv/jit", "CUDA_CACHE_MAXSIZE": "1000"}
    assert with_jit_cache(mine, tmp_path, 1024) == mine
    assert with_jit_cache({"CUDA_CACHE_MAXSIZE": "1000"}, tmp_path, 64)["CUDA_CACHE_MAXSIZE"] == "1000"
    assert with_jit_cache({"CUDA_CACHE_DISABLE": "1"}, tmp_path, 64) == {"CUDA_CACHE_DISABLE": "1"}


@pytest.mark.parametrize("bad", [-1, 4097])
def test_the_size_is_checked(tmp_path: Path, bad: int) -> None:
    path = tmp_path / "gpupoold.toml"
    path.write_text(f"jit_cache_mib = {bad}\n")
    with pytest.raises(ConfigError, match="setting 'jit_cache_mib': must be from 0 .off. to 4096"):
        load_settings(path)


def test_a_worker_gets_the_jit_cache_folder(
        start_daemon: Callable[..., GpupoolServer], native_build: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: gpupoold makes `<state_dir>/cache/jit` and its worker's environment names it,
    with the default size (1024 MiB); the sandboxed worker starts (the folder is beneath the
    cache folder it may write)."""
    for name in ("CUDA_CACHE_PATH", "CUDA_CACHE_MAXSIZE", "CUDA_CACHE_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    state = tmp_path / "state"
    server = start_daemon(build_dir=native_build, state_dir=state)
    wait_until("the GPU free", lambda: gpu_states(server) == ["free"])
    jit = state / "cache" / "jit"
    assert jit.is_dir()
    (pid,) = worker_pids(server)
    env = dict(item.split(b"=", 1) for item in
               Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item)
    assert env[b"CUDA_CACHE_PATH"] == str(jit).encode()
    assert env[b"CUDA_CACHE_MAXSIZE"] == str(1024 << 20).encode()
