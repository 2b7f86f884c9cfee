"""`gpupool install --system` / `uninstall --system`: register the shims for every program of the
machine through the dynamic loader's cache (no LD_LIBRARY_PATH needed).

Install copies the package's libcuda.so.1 and libnvidia-ml.so.1 (and the unversioned names) to
<root>/usr/local/lib/gpupool/, writes <root>/etc/ld.so.conf.d/gpupool.conf naming that folder,
and runs ldconfig (`ldconfig -r ROOT` for another root). It refuses when the loader already knows
a real NVIDIA driver's libcuda.so.1 (one that does not export gpupool_shim_version): every program
of that machine would then use the remote GPUs instead of its own, which is rarely what anyone
wants; --force does it anyway.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from gpupool.elf import NotElf, exported_symbols
from gpupool.shim import NVML_NAME, SHIM_NAME, ShimNotFound, shim_dir

LIB_DIR = "usr/local/lib/gpupool"
CONF = "etc/ld.so.conf.d/gpupool.conf"
MARK = "gpupool_shim_version"
# The versioned files are copied; the unversioned names (for programs linked with -lcuda /
# -lnvidia-ml, e.g. Triton) are symbolic links to them, as distributions do.
LIBS = {SHIM_NAME: "libcuda.so", NVML_NAME: "libnvidia-ml.so"}


def _err(msg: str) -> int:
    print(f"gpupool: error: {msg}", file=sys.stderr)
    return 1


def _ldconfig() -> str | None:
    found = shutil.which("ldconfig")
    if found:
        return found
    for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig"):
        if os.access(p, os.X_OK):
            return p
    return None


def _in_root(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def _trusted_dirs() -> list[str]:
    arch = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu",
            "ppc64le": "powerpc64le-linux-gnu"}.get(platform.machine(), "")
    dirs = ["lib", "usr/lib", "lib64", "usr/lib64"]
    if arch:
        dirs += [f"lib/{arch}", f"usr/lib/{arch}"]
    return dirs


def known_to_loader(root: Path, soname: str) -> list[Path]:
    """Files named `soname` that the loader of `root` finds without LD_LIBRARY_PATH: its cache
    (ldconfig -p) and the trusted folders; ours (LIB_DIR) left out."""
    found: list[Path] = []
    tool = _ldconfig()
    if tool is not None:
        cmd = [tool, "-p"] if root == Path("/") else [tool, "-r", str(root), "-p"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            for m in re.finditer(rf"^\s*{re.escape(soname)} \(.*\) => (\S+)$", proc.stdout,
                                 re.M):
                found.append(_in_root(root, m.group(1)))
    for d in _trusted_dirs():
        candidate = root / d / soname
        if candidate.exists():
            found.append(candidate)
    ours = (root / LIB_DIR).resolve()
    out: list[Path] = []
    for path in found:
        real = path.resolve()
        if real.parent == ours or real in {p.resolve() for p in out}:
            continue
        out.append(path)
    return out


def foreign(path: Path) -> str | None:
    """Why `path` is not one of our shims (None when it is)."""
    try:
        symbols = exported_symbols(path)
    except NotElf as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot read it ({exc.strerror})"
    return None if MARK in symbols else f"it does not export {MARK}"


def _run_ldconfig(root: Path) -> str | None:
    tool = _ldconfig()
    if tool is None:
        return "ldconfig not found (it comes with the C library: package libc-bin)"
    cmd = [tool] if root == Path("/") else [tool, "-r", str(root)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}"
    return None


def _check_root(root: Path, verb: str) -> str | None:
    if not root.is_dir():
        return f"--root {root}: no such folder"
    if root == Path("/") and os.geteuid() != 0:
        return (f"{verb} --system changes /usr/local/lib and /etc for every user: run it as "
                f"root (sudo gpupool {verb} --system)")
    return None


def _includes_conf_d(root: Path) -> bool:
    try:
        text = (root / "etc/ld.so.conf").read_text()
    except OSError:
        return False
    return bool(re.search(r"^\s*include\s+/etc/ld\.so\.conf\.d/", text, re.M))


def _install_file(src: Path, target: Path) -> None:
    """Copy src to target atomically. The temporary file is created exclusively and never
    through a symlink (a root-run install into a tree someone else can write to must not be
    redirected), then renamed over the target."""
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o755)
    try:
        with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
            shutil.copyfileobj(inp, out)
            os.fchmod(out.fileno(), 0o755)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def cmd_install(root_arg: str | None, force: bool, env: Mapping[str, str]) -> int:
    root = Path(root_arg or "/").resolve()
    problem = _check_root(root, "install")
    if problem:
        return _err(problem)
    try:
        src = shim_dir(env)
    except ShimNotFound as exc:
        return _err(str(exc))
    missing = [name for name in LIBS if not (src / name).is_file()]
    if missing:
        return _err(f"{', '.join(missing)} not in {src}: reinstall the gpupool package "
                    "(pip install ./client builds both shims)")
    strangers = [f"{src / name} ({why})" for name in LIBS if (why := foreign(src / name))]
    if strangers:  # what we would install for every program must be ours
        return _err(f"{'; '.join(strangers)}: not gpupool's libraries; check GPUPOOL_SHIM_DIR "
                    "or reinstall the gpupool package")
    drivers = [(p, why) for p in known_to_loader(root, SHIM_NAME)
               if (why := foreign(p)) is not None]
    if drivers and not force:
        listed = "; ".join(f"{p} ({why})" for p, why in drivers)
        return _err(f"this machine has a real NVIDIA driver: the loader already knows {listed}. "
                    "Installing gpupool's libcuda.so.1 for every program would make them all use "
                    "the remote GPUs instead of the local ones. Use `gpupool run -- CMD` for "
                    "the programs that should use gpupool, or pass --force to install anyway")
    dest = root / LIB_DIR
    dest.mkdir(mode=0o755, parents=True, exist_ok=True)
    for name, link in LIBS.items():
        _install_file(src / name, dest / name)
        # The link too is made aside and renamed over: the name never goes missing.
        tmp_link = dest / f".{link}.tmp{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            tmp_link.unlink()
        tmp_link.symlink_to(name)
        os.replace(tmp_link, dest / link)
    conf = root / CONF
    conf.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    conf.write_text("# gpupool's libcuda.so.1 and libnvidia-ml.so.1 for every program of this "
                    "machine\n# (written by `gpupool install --system`; `gpupool uninstall "
                    f"--system` removes it)\n/{LIB_DIR}\n")
    os.chmod(conf, 0o644)
    problem = _run_ldconfig(root)
    if problem:
        return _err(f"{problem}; the files are in {dest} and {conf}: fix ldconfig and run it, "
                    "or `gpupool uninstall --system` to undo")
    where = "" if root == Path("/") else f" under {root}"
    for p, why in drivers:
        print(f"gpupool: warning: --force: {p} ({why}) is shadowed now", file=sys.stderr)
    if not _includes_conf_d(root):
        print(f"gpupool: warning: {root / 'etc/ld.so.conf'} does not include "
              "/etc/ld.so.conf.d/*.conf, so the loader does not read gpupool.conf: add the line "
              "`include /etc/ld.so.conf.d/*.conf` and run ldconfig", file=sys.stderr)
    print(f"gpupool: installed {SHIM_NAME} and {NVML_NAME} in /{LIB_DIR}{where} and registered "
          f"them with the loader (/{CONF}); every program of this machine now uses gpupool's "
          "servers (/etc/gpupool/config.toml, or each user's ~/.config/gpupool/config.toml: "
          "gpupool login). Undo with `gpupool uninstall --system`")
    return 0


def cmd_uninstall(root_arg: str | None, env: Mapping[str, str]) -> int:
    root = Path(root_arg or "/").resolve()
    problem = _check_root(root, "uninstall")
    if problem:
        return _err(problem)
    dest = root / LIB_DIR
    conf = root / CONF
    removed = []
    for name in (*LIBS, *LIBS.values()):
        p = dest / name
        if p.is_symlink() or p.exists():
            p.unlink()
            removed.append(p)
    if dest.is_dir():
        try:
            dest.rmdir()
        except OSError as exc:
            print(f"gpupool: warning: {dest} left in place: {exc.strerror} (it holds other "
                  "files)", file=sys.stderr)
    if conf.exists():
        conf.unlink()
        removed.append(conf)
    if not removed:
        where = "" if root == Path("/") else f" under {root}"
        print(f"gpupool: nothing to uninstall: no /{LIB_DIR} or /{CONF}{where}")
        return 0
    problem = _run_ldconfig(root)
    if problem:
        return _err(f"{problem}; the files are removed: run ldconfig to update the cache")
    print(f"gpupool: uninstalled: removed {len(removed)} files and updated the loader's cache")
    return 0
