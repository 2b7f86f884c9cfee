"""The client installed as a user would: in a fresh virtual environment, `pip install ./client`,
`gpupool login`, then `gpupool run -- python -c "import torch; print(torch.cuda.is_available())"`
prints True, and a program built with nvcc runs through `gpupool run` — against gpupoold on a
simulated GPU, with nothing but the config file that login wrote telling the shim where to go.

PyTorch is not installed into the fresh environment (its CUDA wheels are about 5 GB, which would
make the test take many minutes and the disk fill up): a .pth file in the fresh environment
appends the site-packages folder of the torch the test runner can import (the development
.venv's). A .pth line is appended to sys.path after the fresh environment's own site-packages, and
the .pth files of the appended folder are not processed, so the fresh environment's own gpupool
package (not the .venv's editable one) is the one imported; the test checks that too.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, GpupoolServer, require, run_client
from test_e2e_cuda import nvcc_path

ARCH = os.environ.get("GPUPOOL_TEST_ARCH", "sm_90")
SHIPPED = ("libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so")


def torch_site() -> Path | None:
    """The site-packages folder holding the torch this interpreter would import."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def plain_env(home: Path, venv: Path) -> dict[str, str]:
    """A user of the fresh environment: its bin/ first on PATH, a home of its own, none of the
    test runner's gpupool or Python settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GPUPOOL_", "PYTHON", "VIRTUAL_ENV", "LD_"))}
    env.update(HOME=str(home), PATH=f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
               VIRTUAL_ENV=str(venv), PYTHONDONTWRITEBYTECODE="1")
    env.pop("XDG_CONFIG_HOME", None)
    return env


@pytest.fixture(scope="module")
def fresh_venv(native_build: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    python = shutil.which("python3.11")
    require(python, "python3.11 is needed to make the fresh virtual environment")
    assert python is not None
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    proc = run_client([python, "-m", "venv", str(venv)], timeout=300)
    assert proc.returncode == 0, proc.stderr
    env = plain_env(venv.parent, venv)
    # make reuses the test run's native build instead of building the shims again.
    env["GPUPOOL_BUILD_DIR"] = str(native_build)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    proc = run_client([venv / "bin" / "python", "-m", "pip", "install", "--quiet",
                       str(REPO / "protocol" / "python"), str(REPO / "client")], env=env, timeout=900)
    assert proc.returncode == 0, f"pip install ./client failed:\n{proc.stdout}\n{proc.stderr}"
    return venv


def site_packages(venv: Path) -> Path:
    (found,) = venv.glob("lib/python3*/site-packages")
    return found


def test_pip_install_login_then_torch_and_an_nvcc_program(
        fresh_venv: Path, gpupool_server: GpupoolServer, tmp_path: Path) -> None:
    venv = fresh_venv
    home = tmp_path / "home"
    home.mkdir()
    env = plain_env(home, venv)
    site = site_packages(venv)

    # The package: the command, and both shims with their unversioned names.
    for name in SHIPPED:
        assert (site / "gpupool" / "lib" / name).is_file(), name
    assert (venv / "bin" / "gpupool").is_file()

    # Log in: the config file is the only thing that names the server, its identity (the
    # fingerprint confirmed on the command line, as a script does) and the token.
    assert gpupool_server.fingerprint is not None
    proc = run_client([venv / "bin" / "gpupool", "login", gpupool_server.address,
                       "--fingerprint", gpupool_server.fingerprint, "--token",
                       gpupool_server.token], env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    config = home / ".config" / "gpupool" / "config.toml"
    assert config.is_file() and config.stat().st_mode & 0o777 == 0o600
    assert gpupool_server.fingerprint in config.read_text(), config.read_text()

    # A program built with nvcc (dynamic cudart, which dlopens libcuda.so.1).
    nvcc = nvcc_path()
    require(nvcc, "nvcc (CUDA toolkit) not found: the CUDA test program cannot be built")
    assert nvcc is not None
    exe = tmp_path / "kernels"
    build = subprocess.run([nvcc, f"-arch={ARCH}", "-O2", "-cudart", "shared", "-o", str(exe),
                            str(REPO / "tests" / "cuda" / "kernels.cu")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    proc = run_client([venv / "bin" / "gpupool", "run", "--", exe, "100"], env=env,
                      timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith("PASS kernels"), (
        f"{proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}\n"
        f"{gpupool_server.log_text()[-4000:]}")

    # PyTorch: the .venv's, through a .pth file (see the module's docstring).
    torch_dir = torch_site()
    require(torch_dir is not None, "torch is not importable by the test runner (scripts/"
            "bootstrap.sh installs it unless GPUPOOL_NO_TORCH=1)")
    assert torch_dir is not None
    (site / "zz-gpupool-test-torch.pth").write_text(f"{torch_dir}\n")
    proc = run_client([venv / "bin" / "python", "-c",
                       "import gpupool, torch; print(gpupool.__file__); print(torch.__file__)"],
                      env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    gp_file, torch_file = proc.stdout.split()
    assert Path(gp_file).is_relative_to(site), f"the fresh venv's gpupool must win: {gp_file}"
    assert Path(torch_file).is_relative_to(torch_dir)
    proc = run_client([venv / "bin" / "gpupool", "run", "--", "python", "-c",
                       "import torch; print(torch.cuda.is_available())"], env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1:] == ["True"], (
        f"{proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")

    # And the doctor agrees, now with a CUDA runtime to compare with the server's driver.
    proc = run_client([venv / "bin" / "gpupool", "doctor"], env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok    CUDA runtime vs the server's driver" in proc.stdout or \
        "warn  CUDA runtime vs the server's driver" in proc.stdout, proc.stdout
    assert f"shim: libcuda.so.1 under gpupool run: {site / 'gpupool' / 'lib'}" in proc.stdout
