"""The Python distributions: scripts/build-dists.sh builds the daemon's and the client's
wheels and sdists; their metadata, entry points, platform tag and native files are right; in a
fresh virtual environment the client wheel installs and runs with no compiler on the PATH, and the
daemon wheel (its dependencies from the package index) starts `gpupoold serve` on a simulated GPU
that answers /healthz. Each sdist, unpacked where no checkout is around it, builds a wheel on its
own (offline) that works the same way.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO, require, run_client

PYTHON = "python3.11"
COMPILERS = ("gcc", "cc", "c++", "g++", "clang", "make", "ld")


def load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_dists", REPO / "scripts" / "check_dists.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_dists"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheels and sdists, built once by scripts/build-dists.sh (which also checks them)."""
    require(shutil.which("make") and shutil.which("gcc"), "building the wheels needs make and gcc")
    out = tmp_path_factory.mktemp("dist")
    proc = run_client([REPO / "scripts" / "build-dists.sh", out], env=dict(os.environ, PYTHON=sys.executable),
                      timeout=300)
    assert proc.returncode == 0, f"build-dists.sh failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def wheel(dists: Path, name: str) -> Path:
    found = list(dists.glob(f"{name}-*.whl"))
    assert len(found) == 1, f"{name} wheels in {dists}: {found}"
    return found[0]


@pytest.fixture(scope="module")
def sdist_wheels(dists: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each sdist unpacked in a temporary folder with no gpupool checkout around it, and built there
    into a wheel with `pip wheel --no-deps --no-build-isolation` (offline: this Python has
    setuptools); {distribution name: wheel}."""
    work = tmp_path_factory.mktemp("sdist-build").resolve()
    assert not work.is_relative_to(REPO.resolve()), f"{work} is inside the checkout"
    around = [d for d in work.parents if (d / "Makefile").exists() or (d / "client" / "shim").exists()]
    assert not around, f"a Makefile or client/shim/ around {work}: {around}"
    out = work / "wheels"
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1")
    for var in ("GPUPOOL_BUILD_DIR", "PYTHONPATH", "GPUPOOL_SKIP_NATIVE"):
        env.pop(var, None)
    built: dict[str, Path] = {}
    for dist in ("gpupool", "gpupoold", "gpupool-protocol"):
        sdists = list(dists.glob(f"{dist.replace('-', '_')}-[0-9]*.tar.gz"))
        assert len(sdists) == 1, sdists
        with tarfile.open(sdists[0]) as tf:
            tf.extractall(work, filter="data")
        src = work / sdists[0].name.removesuffix(".tar.gz")
        proc = run_client([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-cache-dir", "--wheel-dir", out, "."], env=env, cwd=src, timeout=300)
        assert proc.returncode == 0, f"building a wheel from {sdists[0].name} failed:\n{proc.stdout}\n{proc.stderr}"
        built[dist] = wheel(out, dist.replace("-", "_"))
    return built


def fresh_venv(where: Path) -> Path:
    python = shutil.which(PYTHON)
    require(python, f"{PYTHON} not found (the fresh virtual environments use it)")
    proc = run_client([str(python), "-m", "venv", where], timeout=120)
    assert proc.returncode == 0, proc.stderr
    return where / "bin"


def test_dists_metadata_and_contents(dists: Path) -> None:
    checker = load_checker()
    assert checker.check(dists) == []
    daemon, client = wheel(dists, "gpupoold"), wheel(dists, "gpupool")
    for whl in (daemon, client):
        assert re.fullmatch(r"gpupoold?-[0-9][^-]*-py3-none-linux_x86_64\.whl", whl.name), whl.name
    with zipfile.ZipFile(daemon) as zf:
        names = set(zf.namelist())
        assert {"gpupoold/bin/gpupool-worker", "gpupoold/bin/gpupool-scrub",
                "gpupoold/bin/gpupool-checkpoint", "gpupoold/bin/libgpupool-sim.so",
                "gpupoold/dashboard/templates/base.html", "gpupoold/dashboard/static/dashboard.js"} <= names
        assert zf.getinfo("gpupoold/bin/gpupool-worker").external_attr >> 16 & 0o111, "worker not executable"
        assert zf.read("gpupoold/bin/libgpupool-sim.so")[:4] == b"\x7fELF"
    with zipfile.ZipFile(client) as zf:
        for lib in ("libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so"):
            assert zf.read(f"gpupool/lib/{lib}")[:4] == b"\x7fELF", lib
    assert list(dists.glob("gpupoold-*.tar.gz")) and list(dists.glob("gpupool-*.tar.gz"))
    # The protocol module both depend on is its own pure-Python distribution, in neither of them.
    protocol = wheel(dists, "gpupool_protocol")
    assert protocol.name.endswith("-py3-none-any.whl"), protocol.name
    for whl in (daemon, client):
        with zipfile.ZipFile(whl) as zf:
            assert not [n for n in zf.namelist() if "_generated" in n or n.startswith("gpupool_protocol/")], whl
    with zipfile.ZipFile(protocol) as zf:
        assert "gpupool_protocol/_generated.py" in zf.namelist()


def test_checker_catches_a_missing_library(dists: Path, tmp_path: Path) -> None:
    """The check is real: a client wheel without libcuda.so.1 is reported."""
    checker = load_checker()
    broken = tmp_path / wheel(dists, "gpupool").name
    with zipfile.ZipFile(wheel(dists, "gpupool")) as src, zipfile.ZipFile(broken, "w") as dst:
        for item in src.infolist():
            if item.filename != "gpupool/lib/libcuda.so.1":
                dst.writestr(item, src.read(item))
    errors = checker.check_wheel("gpupool", broken)
    assert any("gpupool/lib/libcuda.so.1 missing" in e for e in errors), errors


def test_client_wheel_installs_without_a_compiler(dists: Path, tmp_path: Path) -> None:
    venv_bin = fresh_venv(tmp_path / "venv")
    tools = tmp_path / "tools"  # the few programs the client may start; no compiler, no make
    tools.mkdir()
    for tool in ("sh", "env", "uname", "ldconfig"):
        found = shutil.which(tool) or (f"/sbin/{tool}" if Path(f"/sbin/{tool}").exists() else None)
        if found:
            (tools / tool).symlink_to(found)
    path = f"{venv_bin}:{tools}"
    for compiler in COMPILERS:
        assert shutil.which(compiler, path=path) is None, f"{compiler} on the stripped PATH"
    env = {"PATH": path, "HOME": str(tmp_path / "home"), "LANG": "C.UTF-8", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    # its one dependency, gpupool-protocol, from the same folder of wheels
    proc = run_client([venv_bin / "python", "-m", "pip", "install", "--no-index", "--find-links", dists,
                       wheel(dists, "gpupool")], env=env, timeout=120)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    proc = run_client([venv_bin / "gpupool", "--version"], env=env)
    assert proc.returncode == 0 and "0.1.0" in proc.stdout + proc.stderr, proc
    proc = run_client([venv_bin / "gpupool", "env"], env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lib = (tmp_path / "venv").resolve()
    found = re.search(r"export LD_LIBRARY_PATH='?([^:'\n]+)", proc.stdout)
    assert found, proc.stdout
    shim_dir = Path(found.group(1))
    assert shim_dir.resolve().is_relative_to(lib), f"{shim_dir} is not the fresh venv's gpupool/lib"
    assert (shim_dir / "libcuda.so.1").is_file() and (shim_dir / "libnvidia-ml.so.1").is_file()


def test_checker_catches_an_sdist_without_its_sources(dists: Path, tmp_path: Path) -> None:
    """The sdist check is real: a client sdist without native/Makefile and a daemon sdist without
    the worker's fragment are reported, by name."""
    checker = load_checker()
    for dist, dropped in (("gpupool", "native/Makefile"), ("gpupoold", "worker/worker.mk")):
        (src,) = dists.glob(f"{dist}-[0-9]*.tar.gz")
        broken = tmp_path / src.name
        with tarfile.open(src) as tin, tarfile.open(broken, "w:gz") as tout:
            for member in tin.getmembers():
                if member.name.split("/", 1)[-1] != dropped:
                    tout.addfile(member, tin.extractfile(member) if member.isfile() else None)
        errors = checker.check_sdist(dist, broken)
        assert len(errors) == 1 and "missing from the sdist" in errors[0] and dropped in errors[0], errors


def test_client_sdist_without_native_sources_says_what_to_do(dists: Path, tmp_path: Path) -> None:
    """An unpacked client sdist that lost its native/ folder fails with a message that says what
    is missing and what to do, not with a make error."""
    (src,) = dists.glob("gpupool-[0-9]*.tar.gz")
    with tarfile.open(src) as tf:
        tf.extractall(tmp_path, filter="data")
    tree = tmp_path / src.name.removesuffix(".tar.gz")
    shutil.rmtree(tree / "native")
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1")
    for var in ("GPUPOOL_BUILD_DIR", "PYTHONPATH", "GPUPOOL_SKIP_NATIVE"):
        env.pop(var, None)
    proc = run_client([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
                       "--wheel-dir", tmp_path / "out", "."], env=env, cwd=tree, timeout=120)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "no C sources for the shims" in output and "GPUPOOL_SKIP_NATIVE=1" in output, output


def test_sdists_build_wheels_alone(sdist_wheels: dict[str, Path]) -> None:
    """The wheels built from the sdists alone pass the same check as build-dists.sh's."""
    checker = load_checker()
    for dist, whl in sdist_wheels.items():
        assert checker.check_wheel(dist, whl) == [], whl


def test_client_sdist_wheel_runs(sdist_wheels: dict[str, Path], tmp_path: Path) -> None:
    """The client wheel built from its sdist installs in a fresh venv (no system packages), its
    command runs, and gpupool/lib holds our libcuda.so.1 (an ELF shared object exporting cuInit)
    and libnvidia-ml.so.1 (exporting nvmlInit_v2)."""
    nm = shutil.which("nm")
    require(nm, "nm (binutils) is needed to read the shims' exported symbols")
    venv_bin = fresh_venv(tmp_path / "venv")
    env = {"PATH": f"{venv_bin}:/usr/bin:/bin", "HOME": str(tmp_path / "home"), "LANG": "C.UTF-8",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = run_client([venv_bin / "python", "-m", "pip", "install", "--no-index", "--find-links",
                       sdist_wheels["gpupool-protocol"].parent, sdist_wheels["gpupool"]], env=env, timeout=120)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    proc = run_client([venv_bin / "gpupool", "--version"], env=env, cwd=tmp_path)
    assert proc.returncode == 0 and "0.1.0" in proc.stdout + proc.stderr, proc
    proc = run_client([venv_bin / "python", "-c", "import gpupool, pathlib; "
                       "print(pathlib.Path(gpupool.__file__).parent.resolve())"], env=env, cwd=tmp_path)
    lib = Path(proc.stdout.strip()) / "lib"
    assert lib.is_relative_to((tmp_path / "venv").resolve()), proc
    for name, symbol in (("libcuda.so.1", "cuInit"), ("libnvidia-ml.so.1", "nvmlInit_v2")):
        head = (lib / name).read_bytes()[:18]
        # ELF magic, 64-bit, little-endian, e_type ET_DYN (3): a shared object
        assert head[:4] == b"\x7fELF" and head[4] == 2 and head[5] == 1, (name, head)
        assert int.from_bytes(head[16:18], "little") == 3, f"{name} is not a shared object"
        syms = run_client([str(nm), "-D", "--defined-only", lib / name])
        assert syms.returncode == 0, syms.stderr
        assert re.search(rf"^\S+ T {symbol}$", syms.stdout, re.M), f"{name} does not export {symbol}"


@pytest.fixture(params=["dist", "sdist"])
def daemon_venv(request: pytest.FixtureRequest, dists: Path, tmp_path: Path) -> Iterator[Path]:
    """A fresh venv with the daemon wheel (build-dists.sh's, or the one built from the sdist)."""
    if request.param == "dist":
        daemon_wheel = wheel(dists, "gpupoold")
    else:
        daemon_wheel = request.getfixturevalue("sdist_wheels")["gpupoold"]
    venv_bin = fresh_venv(tmp_path / "dvenv")
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    proc = run_client([venv_bin / "python", "-m", "pip", "install", "--quiet", "--find-links",
                       Path(daemon_wheel).parent, daemon_wheel], env=env, timeout=240)
    assert proc.returncode == 0, f"pip install of the daemon wheel failed:\n{proc.stdout}\n{proc.stderr}"
    # the fresh venv's own package, not the working tree's, with the worker the wheel carries
    proc = run_client([venv_bin / "python", "-c", "import gpupoold, pathlib; "
                       "print(pathlib.Path(gpupoold.__file__).parent.resolve())"], env=env, cwd=tmp_path)
    package = Path(proc.stdout.strip())
    assert package.is_relative_to((tmp_path / "dvenv").resolve()), proc
    assert os.access(package / "bin" / "gpupool-worker", os.X_OK)
    yield venv_bin


def test_daemon_wheel_serves_healthz(daemon_venv: Path, tmp_path: Path) -> None:
    env = {"PATH": f"{daemon_venv}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    state = tmp_path / "state"
    cmd = [str(daemon_venv / "gpupoold"), "serve", "--simulated", "1", "--state-dir", str(state),
           "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"]
    log = (tmp_path / "gpupoold.log").open("w+")
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True)
    try:
        address = None
        deadline = time.monotonic() + 30
        while address is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            found = re.search(r"gpupoold: http on (\S+)", Path(log.name).read_text())
            address = found.group(1) if found else None
        output = Path(log.name).read_text()
        assert address, f"no 'gpupoold: http on' line (exit {proc.poll()}):\n{output}"
        url = address if address.startswith("http") else f"http://{address}"
        with urllib.request.urlopen(f"{url}/healthz", timeout=10) as resp:
            assert resp.status == 200
            health = json.loads(resp.read())
        assert health["ok"] is True and health["gpus"] == 1, health
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, Path(log.name).read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
