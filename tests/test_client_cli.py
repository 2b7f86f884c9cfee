"""The `gpupool` command without a server: `gpupool env` (shell and notebook forms), `gpupool run`
and usage errors. The commands that talk to servers are tested in test_login.py,
test_status_smi.py, test_doctor.py, test_install_system.py and test_client_install.py."""

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


def test_env_for_notebooks(shim_dir: Path) -> None:
    (shim_dir / "libnvidia-ml.so.1").write_bytes(b"\x7fELF not really either")
    env = {**os.environ, "GPUPOOL_SHIM_DIR": str(shim_dir), "LD_LIBRARY_PATH": "/opt/x"}
    proc = gpupool("env", "--format", "python", env=env)
    assert proc.returncode == 0, proc.stderr
    code = proc.stdout
    # Runnable Python that sets the variable for child processes and loads both shims here
    # (checked without loading the fake files: ctypes.CDLL is replaced).
    loaded: list[tuple[str, int]] = []
    fake_ctypes = type("ctypes", (), {"RTLD_GLOBAL": 256,
                                      "CDLL": staticmethod(lambda p, mode: loaded.append((p, mode)))})
    fake_os = type("os", (), {"environ": {"LD_LIBRARY_PATH": "/kernel/lib"}})
    exec(code.replace("import ctypes, os", ""), {"ctypes": fake_ctypes, "os": fake_os})
    assert fake_os.environ["LD_LIBRARY_PATH"] == f"{shim_dir}:/kernel/lib"
    assert loaded == [(str(shim_dir / "libcuda.so.1"), 256),
                      (str(shim_dir / "libnvidia-ml.so.1"), 256)]
    proc = gpupool("env", "--format", "ipython", env=env)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.strip().splitlines()
    assert first == f"%env LD_LIBRARY_PATH={shim_dir}:/opt/x"
    assert second.startswith("import ctypes; ctypes.CDLL(") and "libnvidia-ml.so.1" in second
    proc = gpupool("env", "--help", env=env)
    assert "first cell of a Jupyter notebook" in proc.stdout


def test_usage_errors_exit_2() -> None:
    for args in (("frobnicate",), ("status", "--bogus"), ()):
        proc = gpupool(*args, env=dict(os.environ))
        assert proc.returncode == 2, (args, proc.stderr)
