"""The minimal client package (client/gpupool): `gpupool env` and `gpupool run`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

CLIENT = REPO / "client"


def gpupool(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = dict(env)
    full["PYTHONPATH"] = str(CLIENT)
    return subprocess.run([sys.executable, "-m", "gpupool", *args], capture_output=True,
                          text=True, env=full, timeout=60)


@pytest.fixture
def shim_dir(tmp_path: Path) -> Path:
    (tmp_path / "libcuda.so.1").write_bytes(b"\x7fELF not really")
    return tmp_path


def test_env_prints_the_library_path(shim_dir: Path) -> None:
    env = {**os.environ, "GPUPOOL_SHIM_DIR": str(shim_dir), "LD_LIBRARY_PATH": "/opt/x"}
    proc = gpupool("env", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"export LD_LIBRARY_PATH={shim_dir}:/opt/x"


def test_run_puts_the_shim_first_and_sets_the_server(shim_dir: Path) -> None:
    env = {**os.environ, "GPUPOOL_SHIM_DIR": str(shim_dir)}
    env.pop("LD_LIBRARY_PATH", None)
    proc = gpupool("run", "--server", "10.9.8.7:7070", "--", "sh", "-c",
                   'echo "$LD_LIBRARY_PATH|$GPUPOOL_SERVER"; exit 7', env=env)
    assert proc.returncode == 7  # the program's own exit status
    assert proc.stdout.strip() == f"{shim_dir}|10.9.8.7:7070"


def test_missing_shim_is_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "GPUPOOL_SHIM_DIR": str(tmp_path)}
    proc = gpupool("run", "--", "true", env=env)
    assert proc.returncode == 1
    assert "libcuda.so.1 not found" in proc.stderr and str(tmp_path) in proc.stderr


def test_run_needs_a_command(shim_dir: Path) -> None:
    proc = gpupool("run", env={**os.environ, "GPUPOOL_SHIM_DIR": str(shim_dir)})
    assert proc.returncode == 2 and "nothing to run" in proc.stderr


def test_unknown_program(shim_dir: Path) -> None:
    proc = gpupool("run", "--", "/nonexistent/prog",
                   env={**os.environ, "GPUPOOL_SHIM_DIR": str(shim_dir)})
    assert proc.returncode == 127 and "cannot run /nonexistent/prog" in proc.stderr
