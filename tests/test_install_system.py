"""`gpupool install --system` / `uninstall --system`, always into a --root folder made here (the
machine's own /etc and /usr/local are never touched): the shims are copied, registered with the
loader (ld.so.conf.d + ldconfig -r), refused over a real driver's libcuda.so.1 unless --force,
and removed again."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, require, run_client
from gpupool.elf import exported_symbols

FAKE_DRIVER = "int cuInit(unsigned flags) { (void)flags; return 0; }\n"
LIB_DIR = "usr/local/lib/gpupool"


def ldconfig() -> str:
    found = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.access(p, os.X_OK)), None)
    require(found, "ldconfig not found")
    assert found is not None
    return found


def cache(root: Path) -> dict[str, list[str]]:
    """soname -> paths, as the loader of `root` knows them (ldconfig -r ROOT -p)."""
    out = subprocess.run([ldconfig(), "-r", str(root), "-p"], capture_output=True, text=True,
                         check=True).stdout
    found: dict[str, list[str]] = {}
    for m in re.finditer(r"^\s*(\S+) \(.*\) => (\S+)$", out, re.M):
        found.setdefault(m.group(1), []).append(m.group(2))
    return found


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    (r / "etc").mkdir(parents=True)
    (r / "etc" / "ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    return r


def gpupool(shims: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env.update(GPUPOOL_SHIM_DIR=str(shims), PYTHONPATH=str(REPO / "client"))
    return run_client([sys.executable, "-m", "gpupool", *args], env=env, timeout=60)


def test_install_registers_both_shims_and_uninstall_removes_them(native_build: Path,
                                                                 root: Path) -> None:
    ldconfig()
    shims = native_build / "client"
    proc = gpupool(shims, "install", "--system", "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert f"in /{LIB_DIR} under {root}" in proc.stdout
    dest = root / LIB_DIR
    for name, link in (("libcuda.so.1", "libcuda.so"), ("libnvidia-ml.so.1", "libnvidia-ml.so")):
        assert (dest / name).read_bytes() == (shims / name).read_bytes()
        assert not (dest / name).is_symlink() and os.access(dest / name, os.X_OK)
        assert os.readlink(dest / link) == name
    assert "gpupool_shim_version" in exported_symbols(dest / "libcuda.so.1")
    conf = root / "etc" / "ld.so.conf.d" / "gpupool.conf"
    assert f"\n/{LIB_DIR}\n" in conf.read_text()
    known = cache(root)
    assert known["libcuda.so.1"] == [f"/{LIB_DIR}/libcuda.so.1"]
    assert known["libnvidia-ml.so.1"] == [f"/{LIB_DIR}/libnvidia-ml.so.1"]
    # Installing again over our own shims is fine (they are not a driver).
    proc = gpupool(shims, "install", "--system", "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    proc = gpupool(shims, "uninstall", "--system", "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert "uninstalled: removed 5 files" in proc.stdout
    assert not dest.exists() and not conf.exists()
    assert "libcuda.so.1" not in cache(root)
    proc = gpupool(shims, "uninstall", "--system", "--root", str(root))
    assert proc.returncode == 0 and "nothing to uninstall" in proc.stdout


def test_refuses_to_shadow_a_real_driver_unless_forced(native_build: Path, root: Path,
                                                       tmp_path: Path) -> None:
    require(shutil.which("gcc"), "gcc is needed to build the fake driver library")
    libdir = root / "usr" / "lib" / "x86_64-linux-gnu"
    libdir.mkdir(parents=True)
    src = tmp_path / "driver.c"
    src.write_text(FAKE_DRIVER)
    driver = libdir / "libcuda.so.580.65.06"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(driver),
                    str(src)], check=True)
    subprocess.run([ldconfig(), "-r", str(root)], check=True)  # makes the libcuda.so.1 link
    assert (libdir / "libcuda.so.1").is_symlink()
    shims = native_build / "client"
    proc = gpupool(shims, "install", "--system", "--root", str(root))
    assert proc.returncode == 1
    assert "this machine has a real NVIDIA driver: the loader already knows " in proc.stderr
    assert f"{libdir}/libcuda.so.1 (it does not export gpupool_shim_version)" in proc.stderr
    assert "pass --force to install anyway" in proc.stderr
    assert not (root / LIB_DIR).exists()
    assert not (root / "etc" / "ld.so.conf.d").exists()
    proc = gpupool(shims, "install", "--system", "--force", "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert f"--force: {libdir}/libcuda.so.1 (it does not export gpupool_shim_version) is " \
           "shadowed now" in proc.stderr
    known = cache(root)["libcuda.so.1"]
    assert f"/{LIB_DIR}/libcuda.so.1" in known and "/usr/lib/x86_64-linux-gnu/libcuda.so.1" in known
    proc = gpupool(shims, "uninstall", "--system", "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert cache(root)["libcuda.so.1"] == ["/usr/lib/x86_64-linux-gnu/libcuda.so.1"]


def test_install_warns_when_the_loader_would_not_read_the_conf_file(native_build: Path,
                                                                     tmp_path: Path) -> None:
    ldconfig()
    root = tmp_path / "bare"
    root.mkdir()
    proc = gpupool(native_build / "client", "install", "--system", "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert "does not include /etc/ld.so.conf.d/*.conf" in proc.stderr
    proc = gpupool(native_build / "client", "uninstall", "--system", "--root", str(root))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(("args", "code", "what"), [
    (("install",), 2, "the following arguments are required: --system"),
    (("uninstall",), 2, "the following arguments are required: --system"),
    (("install", "--system", "--root", "/nonexistent/root"), 1,
     "--root /nonexistent/root: no such folder"),
])
def test_usage(tmp_path: Path, args: tuple[str, ...], code: int, what: str) -> None:
    proc = gpupool(tmp_path, *args)
    assert proc.returncode == code and what in proc.stderr, proc.stderr


def test_missing_shims_are_reported(root: Path, tmp_path: Path) -> None:
    (tmp_path / "libcuda.so.1").write_bytes(b"")
    proc = gpupool(tmp_path, "install", "--system", "--root", str(root))
    assert proc.returncode == 1
    assert f"libnvidia-ml.so.1 not in {tmp_path}: reinstall the gpupool package" in proc.stderr
    assert not (root / LIB_DIR).exists()


def test_install_refuses_libraries_that_are_not_gpupool_s(tmp_path: Path, root: Path) -> None:
    """What is installed for every program must be ours: a GPUPOOL_SHIM_DIR holding other
    libraries under our names is refused, and nothing is written."""
    require(shutil.which("gcc"), "needs gcc")
    shims = tmp_path / "shims"
    shims.mkdir()
    src = tmp_path / "fake.c"
    src.write_text(FAKE_DRIVER)
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(shims / name), str(src)], check=True)
    proc = gpupool(shims, "install", "--system", "--root", str(root))
    assert proc.returncode == 1
    assert "not gpupool's libraries" in proc.stderr and str(shims / "libcuda.so.1") in proc.stderr
    assert not (root / LIB_DIR).exists() and not (root / "etc" / "ld.so.conf.d").exists()
