"""The Debian packages: `make debs` (scripts/build-debs.sh) builds gpupoold and gpupool-client in
a fresh clone of this repository, with only what it installs itself (no .venv, no build/); their
files land where the systemd units expect them, and every document they link to is shipped;
installed into a scratch root (`dpkg --root ROOT --force-script-chrootless`, so the maintainer
scripts really run, with $DPKG_ROOT=ROOT) they create the gpupoold user and state directory, the
installed commands run from the installed tree, the daemon starts with the shipped default
config; an upgrade keeps the edited conffile and the state, a purge asks (debconf) before it
deletes the database, or keeps a copy; lintian reports no errors and no hardening tags,
hardening-check passes every program and library we build; a second build, in another
directory, makes the same bytes.

The clone is of HEAD plus the uncommitted changes to files git tracks (in CI, HEAD itself); a new
file must be added to git to be in it, as it must be committed to be in CI's checkout
(GPUPOOL_DEBS_UNTRACKED=1 copies the untracked ones too).

Needs git, dpkg-deb, dpkg-shlibdeps (dpkg-dev), make, gcc, lintian, hardening-check (devscripts)
and root (the postinst chowns the state directory); scripts/bootstrap.sh installs the Debian
tools. See docs/packaging.md.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from config_listing import check_lists_every_setting
from conftest import REPO, require, run_client
from test_e2e_leases import hold_gpu  # noqa: F401 (fixture)

from gpupoold import __version__ as DAEMON_VERSION

CLIENT_VERSION = re.search(r'^__version__ = "([^"]+)"',
                           (REPO / "client" / "gpupool" / "__init__.py").read_text(), re.M)[1]  # type: ignore[index]
UNITS = REPO / "systemd"
CONFIG = "/etc/gpupoold/gpupoold.toml"
STATE = "/var/lib/gpupoold"
TREE = "/usr/lib/gpupoold/python"


@dataclass
class Debs:
    daemon: Path
    client: Path
    build_log: str
    clone: Path  # the clean clone they were built in (dist/deb/ there holds them too)


def _members(deb: Path) -> dict[str, tarfile.TarInfo]:
    """The data archive's entries by absolute path ("/usr/bin/gpupoold")."""
    data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True,
                          check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {"/" + m.name.removeprefix("./").rstrip("/"): m for m in tar.getmembers()}


def _field(deb: Path, name: str) -> str:
    return subprocess.run(["dpkg-deb", "--field", str(deb), name], capture_output=True,
                          text=True, check=True).stdout.strip()


def _control_file(deb: Path, name: str) -> str:
    return subprocess.run(["dpkg-deb", "--info", str(deb), name], capture_output=True,
                          text=True, check=True).stdout


def _extract_file(deb: Path, path: str) -> bytes:
    data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True,
                          check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        f = tar.extractfile("." + path)
        assert f is not None, f"{path} is not a regular file in {deb.name}"
        return f.read()


def _fresh_clone(where: Path) -> Path:
    """A clone of this repository's HEAD with the working tree's changes to tracked files (the
    index's file list: a file `git add`ed is in, an untracked one is not); nothing ignored (no
    .venv, no build/)."""
    clone = where / "gpupool"
    proc = run_client(["git", "clone", "--quiet", "--no-hardlinks", REPO, clone], timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = subprocess.run(["git", "ls-files", "-z", "--cached"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    changed = []
    for name in filter(None, listed):
        ours, theirs = REPO / name, clone / name
        if ours.is_symlink() or not ours.exists():
            if not ours.exists():
                theirs.unlink(missing_ok=True)
                changed.append(f"-{name}")
            continue
        if not theirs.is_file() or theirs.read_bytes() != ours.read_bytes() or \
                theirs.stat().st_mode != ours.stat().st_mode:
            theirs.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ours, theirs)
            changed.append(name)
    if changed:
        print(f"the clone has the working tree's changes to {len(changed)} tracked files")
    # Files git does not know are not in the clone, as they would not be in CI's checkout; a
    # build that needs one fails. GPUPOOL_DEBS_UNTRACKED=1 takes them too (before `git add`).
    untracked = [n for n in subprocess.run(
        ["git", "ls-files", "-z", "--others", "--exclude-standard"], cwd=REPO,
        capture_output=True, check=True).stdout.decode().split("\0") if n]
    if untracked and os.environ.get("GPUPOOL_DEBS_UNTRACKED") == "1":
        for name in untracked:
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
        print(f"GPUPOOL_DEBS_UNTRACKED=1: the clone has the untracked files {untracked}")
    elif untracked:
        print(f"not in the clone (untracked: `git add` them, or GPUPOOL_DEBS_UNTRACKED=1): "
              f"{untracked}")
    return clone


def _build_env() -> dict[str, str]:
    """The environment of a person who cloned the repository: no venv active, no PYTHON."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "GPUPOOL_")) and k != "VIRTUAL_ENV"}
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and p != venv_bin)
    return env


def _make_debs(clone: Path) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    proc = run_client(["make", "debs"], env=_build_env(), cwd=clone, timeout=900)
    assert proc.returncode == 0, f"make debs failed in {clone}:\n{proc.stdout}\n{proc.stderr}"
    print(f"make debs in {clone} took {time.monotonic() - started:.0f} s")
    return proc


@pytest.fixture(scope="module")
def debs(tmp_path_factory: pytest.TempPathFactory) -> Debs:
    """Both packages, built once by `make debs` in a fresh clone (kept in a folder of their own:
    the reproducibility test builds in the clone again)."""
    for tool, package in (("git", "git"), ("dpkg-deb", "dpkg"), ("dpkg-shlibdeps", "dpkg-dev"),
                          ("make", "make"), ("gcc", "gcc")):
        require(shutil.which(tool), f"{tool} not found (Debian package {package}; "
                                    "scripts/bootstrap.sh installs it)")
    require((REPO / ".git").exists(), f"{REPO} is not a git checkout: nothing to clone")
    clone = _fresh_clone(tmp_path_factory.mktemp("clone"))
    proc = _make_debs(clone)
    out = tmp_path_factory.mktemp("deb")
    daemon = f"gpupoold_{DAEMON_VERSION}-1_amd64.deb"
    client = f"gpupool-client_{CLIENT_VERSION}-1_amd64.deb"
    built = clone / "dist" / "deb"
    assert (built / daemon).is_file() and (built / client).is_file(), sorted(os.listdir(built))
    for name in (daemon, client):
        shutil.copy2(built / name, out / name)
    return Debs(out / daemon, out / client, proc.stdout, clone)


@pytest.fixture(scope="module")
def daemon_files(debs: Debs) -> dict[str, tarfile.TarInfo]:
    return _members(debs.daemon)


@pytest.fixture(scope="module")
def client_files(debs: Debs) -> dict[str, tarfile.TarInfo]:
    return _members(debs.client)


# ------------------------------------------------------------------------------ the .deb files
def test_build_prints_progress(debs: Debs) -> None:
    steps = re.findall(r"^build-debs: \[(\d)/6\]", debs.build_log, re.M)
    assert steps == [str(i) for i in range(1, 7)], debs.build_log


def test_control_fields(debs: Debs) -> None:
    for deb, name, version in ((debs.daemon, "gpupoold", DAEMON_VERSION),
                               (debs.client, "gpupool-client", CLIENT_VERSION)):
        assert _field(deb, "Package") == name
        assert _field(deb, "Version") == f"{version}-1"
        assert _field(deb, "Architecture") == "amd64"
        assert re.fullmatch(r".+ <[^@ ]+@[^@ ]+>", _field(deb, "Maintainer"))
        assert int(_field(deb, "Installed-Size")) > 0
    daemon_deps = [d.strip() for d in _field(debs.daemon, "Depends").split(",")]
    # The bundle holds compiled extensions for the building Python's minor version: that one
    # only (the tests build with this interpreter).
    minor = sys.version_info[:2]
    assert f"python3 (>= {minor[0]}.{minor[1]})" in daemon_deps, daemon_deps
    assert f"python3 (<< {minor[0]}.{minor[1] + 1})" in daemon_deps, daemon_deps
    bundled = [n for n in _members(debs.daemon) if n.endswith(".so") and "cpython-" in n]
    assert bundled and all(f"cpython-{minor[0]}{minor[1]}-" in n for n in bundled), bundled[:5]
    assert any(d.startswith("libc6 (>= ") for d in daemon_deps), daemon_deps
    assert any(d.startswith("libssl3") for d in daemon_deps), "gpupool-worker links OpenSSL"
    # the Python dependencies are bundled, not taken from Debian
    assert not [d for d in daemon_deps if d.startswith("python3-")], daemon_deps
    client_deps = [d.strip() for d in _field(debs.client, "Depends").split(",")]
    assert "python3 (>= 3.9)" in client_deps
    assert any(d.startswith("libc6 (>= ") for d in client_deps), client_deps
    # liblz4 and libzstd are loaded at run time (dlopen), so dpkg-shlibdeps cannot see them
    daemon_recommends = [d.strip() for d in _field(debs.daemon, "Recommends").split(",")]
    assert {"liblz4-1", "libzstd1"} <= set(daemon_recommends), daemon_recommends
    assert "liblz4-1" in _field(debs.client, "Recommends").split(", ")


def _exec_paths(unit: Path) -> list[str]:
    """The programs of a unit's Exec*= lines (prefixes such as - @ + ! stripped)."""
    out = []
    for line in unit.read_text().splitlines():
        m = re.match(r"\s*Exec\w+=\s*[-@:+!]*(\S+)", line)
        if m:
            out.append(m[1])
    return out


def test_files_land_where_the_units_expect_them(daemon_files: dict[str, tarfile.TarInfo]) -> None:
    units = sorted(p for p in UNITS.iterdir() if p.suffix in (".service", ".socket", ".timer"))
    assert {"gpupoold.service", "gpupool-reset-helper.service",
            "gpupool-reset-helper.socket"} <= {u.name for u in units}
    for unit in units:
        packaged = daemon_files.get(f"/usr/lib/systemd/system/{unit.name}")
        assert packaged is not None and packaged.isfile(), f"{unit.name} not packaged"
        assert packaged.mode == 0o644 and packaged.uid == 0
        for program in _exec_paths(unit):
            entry = daemon_files.get(program)
            assert entry is not None and entry.isfile(), f"{unit.name} runs {program}: not in the package"
            assert entry.mode & 0o111 and entry.uid == 0, f"{program} is not an executable of root"
        for doc in re.findall(r"^Documentation=file://(\S+)", unit.read_text(), re.M):
            assert doc in daemon_files, f"{unit.name}'s Documentation= {doc} is not in the package"
    service = (UNITS / "gpupoold.service").read_text()
    # the configuration alone decides the state directory (the admin commands read it too)
    assert f"ExecStart=/usr/bin/gpupoold serve --config {CONFIG}\n" in service
    assert "User=gpupoold" in service
    sysusers = daemon_files["/usr/lib/sysusers.d/gpupoold.conf"]
    assert sysusers.isfile() and sysusers.mode == 0o644
    assert CONFIG in daemon_files and daemon_files[CONFIG].mode == 0o644
    for native in ("gpupool-worker", "gpupool-scrub", "gpupool-checkpoint"):
        assert daemon_files[f"{TREE}/gpupoold/bin/{native}"].mode == 0o755
    assert f"{TREE}/gpupoold/bin/libgpupool-sim.so" in daemon_files
    for doc in ("README.md", "copyright", "changelog.Debian.gz"):
        assert f"/usr/share/doc/gpupoold/{doc}" in daemon_files
    # The Grafana dashboard where the provisioning example points.
    assert daemon_files["/usr/share/gpupoold/grafana/gpupool.json"].mode == 0o644
    assert "/usr/share/doc/gpupoold/examples/grafana-provisioning.yaml" in daemon_files
    for page in ("man8/gpupoold.8.gz", "man8/gpupool-reset-helper.8.gz"):
        assert f"/usr/share/man/{page}" in daemon_files, page
    assert not [p for p in daemon_files if "__pycache__" in p or p.endswith(".pyc")]
    assert not [p for p in daemon_files if p.startswith((STATE, "/run"))], \
        "state and runtime directories are made by the postinst and systemd, not shipped"


def test_conffile(debs: Debs, daemon_files: dict[str, tarfile.TarInfo]) -> None:
    conffiles = _control_file(debs.daemon, "conffiles").split()
    assert conffiles == [CONFIG]
    assert not [p for p in daemon_files if p.startswith("/etc/") and daemon_files[p].isfile()
                and p not in conffiles], "every file in /etc is a conffile"


def test_client_files(client_files: dict[str, tarfile.TarInfo]) -> None:
    assert client_files["/usr/bin/gpupool"].mode == 0o755
    lib = "/usr/lib/gpupool-client/python/gpupool/lib"
    for name in ("libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so"):
        assert client_files[f"{lib}/{name}"].isfile(), name
    for doc in ("README.md", "copyright", "changelog.Debian.gz"):
        assert f"/usr/share/doc/gpupool-client/{doc}" in client_files
    assert not [p for p in client_files if "__pycache__" in p or p.endswith(".pyc")]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_dependencies_are_bundled(debs: Debs, daemon_files: dict[str, tarfile.TarInfo]) -> None:
    bundled = {_norm(m[1]) for p in daemon_files
               if (m := re.fullmatch(rf"{TREE}/([^/]+)-[^-/]+\.dist-info", p))}
    wanted = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in wanted:
        name = _norm(re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0])
        assert name in bundled, f"dependency {name} is not bundled in {TREE} ({sorted(bundled)})"
    # every bundled distribution has a paragraph in the copyright file
    copyright_text = _extract_file(debs.daemon, "/usr/share/doc/gpupoold/copyright").decode()
    named = {_norm(n) for n in re.findall(r"^Comment: Distribution ([\w-]+)", copyright_text, re.M)}
    missing = bundled - named - {"gpupoold", "gpupool-protocol"}  # ours: the Files: * paragraph
    assert not missing, f"add these to packaging/debian/gpupoold.copyright: {sorted(missing)}"


def test_default_config_lists_every_setting(debs: Debs, tmp_path: Path) -> None:
    check_lists_every_setting(_extract_file(debs.daemon, CONFIG).decode(), tmp_path)


# --------------------------------------------------------------------------- the scratch root
class Root:
    """A scratch root with its own dpkg database; packages go in with
    `dpkg --root` + --force-script-chrootless, so their maintainer scripts run with DPKG_ROOT."""

    def __init__(self, path: Path) -> None:
        self.path = path
        admin = path / "var" / "lib" / "dpkg"
        for sub in ("info", "updates", "triggers"):
            (admin / sub).mkdir(parents=True, exist_ok=True)
        for name in ("status", "available"):
            (admin / name).touch()

    def dpkg(self, *args: str | Path, frontend: str = "noninteractive",
             answer: str | None = None) -> subprocess.CompletedProcess[str]:
        """dpkg on this root; `frontend` is debconf's (DEBIAN_FRONTEND), `answer` what a person
        would type at its prompts (stdin)."""
        # --force-depends: python3 and libc6 live on the host, not in this root's database
        cmd = ["dpkg", f"--root={self.path}", f"--log={self.path / 'dpkg.log'}",
               "--force-script-chrootless", "--force-depends", "--force-confold", *map(str, args)]
        env = {**os.environ, "DEBIAN_FRONTEND": frontend}
        env.pop("DEBCONF_SYSTEMRC", None)
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180,
                                  input=answer if answer is not None else "")
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{' '.join(cmd)} still running after 180 s: {exc.stdout!r} "
                        f"{exc.stderr!r}", pytrace=False)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
        return proc

    def with_debconf(self) -> None:
        """debconf's configuration in this root, as an installed debconf has it: the maintainer
        scripts then use debconf (its database in ROOT/var/cache/debconf, never the host's)."""
        (self / "/var/cache/debconf").mkdir(parents=True, exist_ok=True)
        (self / "/etc").mkdir(exist_ok=True)
        (self / "/etc/debconf.conf").write_text(
            "Config: configdb\nTemplates: templatedb\n\n"
            "Name: configdb\nDriver: File\nFilename: /var/cache/debconf/config.dat\n\n"
            "Name: templatedb\nDriver: File\nFilename: /var/cache/debconf/templates.dat\n")

    def status(self, package: str) -> str:
        proc = subprocess.run(["dpkg-query", f"--admindir={self.path}/var/lib/dpkg", "-W",
                               "-f", "${Status} ${Version}", package], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else "not known"

    def __truediv__(self, path: str) -> Path:
        return self.path / path.lstrip("/")

    def account(self, database: str) -> list[str]:
        lines = [line for line in (self / f"/etc/{database}").read_text().splitlines()
                 if line.startswith("gpupoold:")]
        assert len(lines) == 1, f"{database}: {lines}"
        return lines[0].split(":")


@pytest.fixture
def root(tmp_path: Path) -> Root:
    require(shutil.which("dpkg"), "dpkg not found")
    require(os.geteuid() == 0, "installing into a scratch root needs root (the postinst chowns "
                               "the state directory to the gpupoold user)")
    return Root(tmp_path / "root")


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH: the installed commands must find their own tree."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}


def test_install_runs_the_maintainer_scripts(debs: Debs, root: Root) -> None:
    out = root.dpkg("-i", debs.daemon, debs.client).stdout
    assert root.status("gpupoold") == f"install ok installed {DAEMON_VERSION}-1"
    assert root.status("gpupool-client") == f"install ok installed {CLIENT_VERSION}-1"
    # into another root: how to enable the units there (the postinst says how to start it)
    assert (f"gpupoold: installed into {root.path}, not started. To start it when that system "
            f"boots: systemctl --root={root.path} enable gpupool-reset-helper.socket gpupoold"
            in out), out
    user = root.account("passwd")
    group = root.account("group")
    assert user[3] == group[2] and int(user[2]) < 1000, f"not a system user: {user}"
    assert user[5:] == [STATE, "/usr/sbin/nologin"]
    state = (root / STATE).stat()
    assert oct(state.st_mode & 0o7777) == oct(0o750)
    assert (state.st_uid, state.st_gid) == (int(user[2]), int(group[2]))
    # the postinst byte-compiled the trees; nothing started: no /run/gpupoold
    assert list((root / TREE / "gpupoold").glob("__pycache__/*.pyc"))
    assert not (root / "/run/gpupoold").exists()


def test_postinst_without_systemd_sysusers(debs: Debs, tmp_path: Path) -> None:
    """Where there is no systemd-sysusers (containers, other init systems) the postinst creates
    the user with groupadd/useradd --prefix: run it with a PATH that has no systemd-sysusers."""
    tools = {t: shutil.which(t) for t in ("awk", "groupadd", "useradd", "mkdir", "chown", "chmod")}
    require(all(tools.values()), f"tools of the fallback missing: {tools}")
    require(os.geteuid() == 0, "the postinst chowns the state directory: needs root")
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(debs.daemon), str(root)], check=True)
    subprocess.run(["dpkg-deb", "-e", str(debs.daemon), str(tmp_path / "DEBIAN")], check=True)
    for name, line in (("passwd", "root:x:0:0:root:/root:/bin/sh"), ("group", "root:x:0:"),
                       ("shadow", "root:*:19000:0:99999:7:::"), ("gshadow", "root:*::")):
        (root / "etc" / name).write_text(line + "\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, path in tools.items():
        (bin_dir / tool).symlink_to(path)  # type: ignore[arg-type]
    proc = run_client(["/bin/sh", tmp_path / "DEBIAN" / "postinst", "configure", ""],
                      env={"PATH": str(bin_dir), "DPKG_ROOT": str(root)})
    assert proc.returncode == 0, proc
    passwd = [line.split(":") for line in (root / "etc" / "passwd").read_text().splitlines()]
    user = next(u for u in passwd if u[0] == "gpupoold")
    assert int(user[2]) < 1000 and user[5:] == [STATE, "/usr/sbin/nologin"], user
    assert re.search(rf"^gpupoold:x:{user[3]}:$", (root / "etc" / "group").read_text(), re.M)
    assert (root / STATE.lstrip("/")).stat().st_uid == int(user[2])


@pytest.mark.parametrize("systemd_runs", [True, False], ids=["systemd", "no-systemd"])
def test_postinst_advice_fits_whether_systemd_runs(debs: Debs, tmp_path: Path,
                                                   systemd_runs: bool) -> None:
    """A first install on the running system (no $DPKG_ROOT): `systemctl enable --now` where
    systemd runs, how to start the daemon by hand where it does not (a container). The postinst
    runs with stand-ins for every command it would use on this machine (user lookup, mkdir,
    chown, systemctl), and its test of /run/systemd/system pointed at a folder made here."""
    subprocess.run(["dpkg-deb", "-e", str(debs.daemon), str(tmp_path / "DEBIAN")], check=True)
    script = (tmp_path / "DEBIAN" / "postinst").read_text()
    marker = tmp_path / "run-systemd-system"
    if systemd_runs:
        marker.mkdir()
    assert "SYSTEMD_RUNNING=/run/systemd/system\n" in script
    postinst = tmp_path / "postinst"
    # (and no debconf: the confmodule's path made one that does not exist)
    postinst.write_text(script.replace("SYSTEMD_RUNNING=/run/systemd/system\n",
                                       f"SYSTEMD_RUNNING={marker}\n")
                        .replace("/usr/share/debconf/confmodule", str(tmp_path / "no-debconf")))
    stubs = tmp_path / "bin"
    stubs.mkdir()
    calls = tmp_path / "calls"
    for name, body in (("getent", 'echo "gpupoold:x:999:999::/var/lib/gpupoold:/usr/sbin/nologin"'),
                       ("mkdir", "true"), ("chown", "true"), ("chmod", "true"),
                       ("systemctl", f'echo "systemctl $*" >> {calls}')):
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    for tool in ("cut", "grep"):
        found = shutil.which(tool)
        assert found, tool
        (stubs / tool).symlink_to(found)
    proc = run_client(["/bin/sh", postinst, "configure", ""], env={"PATH": str(stubs)})
    assert proc.returncode == 0, proc
    if systemd_runs:
        assert ("then: sudo systemctl enable --now gpupool-reset-helper.socket gpupoold"
                in proc.stdout), proc.stdout
        assert calls.read_text() == "systemctl --system daemon-reload\n"
    else:
        assert "systemd does not run here" in proc.stdout, proc.stdout
        assert "runuser -u gpupoold -- gpupoold serve" in proc.stdout
        assert "systemctl" not in proc.stdout and not calls.exists()


def test_installed_commands_run(debs: Debs, root: Root, tmp_path: Path) -> None:
    root.dpkg("-i", debs.daemon, debs.client)
    for command, want in (("gpupoold", f"gpupoold {DAEMON_VERSION}"),
                          ("gpupool", f"gpupool {CLIENT_VERSION}")):
        proc = run_client([root / f"/usr/bin/{command}", "--version"], env=_clean_env(), cwd=tmp_path)
        assert proc.returncode == 0 and proc.stdout.strip() == want, proc
    assert not (root / "usr/bin/gpupool-reset-helper").exists()  # root-only: not on PATH
    proc = run_client([root / "/usr/libexec/gpupoold/gpupool-reset-helper", "--help"],
                      env=_clean_env(), cwd=tmp_path)
    assert proc.returncode == 0 and "usage" in proc.stdout.lower(), proc
    # through a symbolic link too (the wrapper resolves its real path)
    link = tmp_path / "gpupoold"
    link.symlink_to(root / "/usr/bin/gpupoold")
    proc = run_client([link, "--version"], env=_clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc


def _wait_for(pattern: str, log: Path, proc: subprocess.Popen[bytes], timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text(errors="replace"), re.M)
        if m:
            return m[1]
        if proc.poll() is not None:
            pytest.fail(f"installed gpupoold exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.1)
    pytest.fail(f"installed gpupoold: no {pattern!r} within {timeout} s:\n{log.read_text()}")


def test_daemon_starts_with_the_default_config(debs: Debs, root: Root, tmp_path: Path) -> None:
    """The unit's command line with the shipped config, on a simulated GPU and free ports; the
    workers it starts are the package's."""
    root.dpkg("-i", debs.daemon)
    log = tmp_path / "gpupoold.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(root / "/usr/bin/gpupoold"), "serve", "--config", str(root / CONFIG),
             "--state-dir", str(tmp_path / "state"), "--simulated", "1",
             "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_clean_env(),
            cwd=tmp_path, start_new_session=True)
    try:
        http = _wait_for(r"^gpupoold: http on (\S+)$", log, proc)
        with urllib.request.urlopen(f"http://{http}/healthz", timeout=10) as reply:
            health = reply.read().decode()
        assert '"ok": true' in health and '"gpus": 1' in health, health
        worker = int(_wait_for(r"worker pid (\d+) ready", log, proc))
        exe = Path(os.readlink(f"/proc/{worker}/exe"))
        assert exe == root / TREE / "gpupoold" / "bin" / "gpupool-worker", exe
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    text = log.read_text(errors="replace")
    assert code == 0, f"gpupoold exited with {code} on SIGTERM:\n{text}"
    assert "Traceback" not in text, text


def _newer(deb: Path, where: Path, daemon_version: str | None = None) -> Path:
    """The same package with Debian revision 2: an upgrade, not a reinstall (with
    `daemon_version`, a build whose gpupoold says it is that version)."""
    tree = where / "tree"
    subprocess.run(["dpkg-deb", "-R", str(deb), str(tree)], check=True)
    control = tree / "DEBIAN" / "control"
    control.write_text(re.sub(r"^Version: (.*)-1$", r"Version: \1-2", control.read_text(), flags=re.M))
    if daemon_version is not None:
        init = tree / TREE.lstrip("/") / "gpupoold" / "__init__.py"
        init.write_text(init.read_text().replace(f'"{DAEMON_VERSION}"', f'"{daemon_version}"'))
    out = where / deb.name.replace("-1_", "-2_")
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-z1", "-b", str(tree), str(out)],
                   check=True, capture_output=True)
    return out


def test_upgrade_keeps_config_and_state_purge_removes_them(debs: Debs, root: Root,
                                                           tmp_path: Path) -> None:
    root.dpkg("-i", debs.daemon)
    config = root / CONFIG
    config.write_text(config.read_text() + 'log_level = "debug"  # local edit\n')
    (root / STATE / "gpupoold.db").write_text("state")
    uid = root.account("passwd")[2]

    newer = _newer(debs.daemon, tmp_path)
    out = root.dpkg("-i", newer).stdout
    assert root.status("gpupoold") == f"install ok installed {DAEMON_VERSION}-2"
    assert "not started" not in out, "an upgrade does not repeat the first-install note"
    assert config.read_text().endswith('log_level = "debug"  # local edit\n'), "the edit was lost"
    assert (root / STATE / "gpupoold.db").read_text() == "state"
    assert root.account("passwd")[2] == uid

    root.dpkg("-r", "gpupoold")  # remove: config and state stay, the program and byte code go
    assert root.status("gpupoold").startswith("deinstall ok config-files")
    assert config.is_file() and (root / STATE / "gpupoold.db").is_file()
    assert not (root / "/usr/lib/gpupoold").exists(), "remove leaves files dpkg did not install"
    assert not (root / "/usr/bin/gpupoold").exists()

    (root / "/run/gpupoold").mkdir(parents=True)
    tls = (root / CONFIG).with_name("tls")
    tls.mkdir()
    (tls / "server.key").write_text("the operator's key")  # not the package's: it stays
    (root / CONFIG).with_name("gpupoold.toml.dpkg-old").write_text("dpkg's copy")
    wants = root / "/etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True)
    (wants / "gpupoold.service").symlink_to("/usr/lib/systemd/system/gpupoold.service")
    purge = root.dpkg("--purge", "gpupoold")
    assert root.status("gpupoold") == "not known" or root.status("gpupoold").startswith("unknown ok not-installed")
    for gone in (CONFIG, CONFIG + ".dpkg-old", STATE, "/run/gpupoold"):
        assert not (root / gone).exists(), f"purge left {gone}"
    # nobody could be asked (no debconf in this root): the database is kept as a dated copy
    (backup,) = (root / "/var/backups").glob("gpupoold-*.db")
    assert backup.read_text() == "state" and backup.stat().st_mode & 0o777 == 0o600
    assert re.fullmatch(r"gpupoold-\d{8}T\d{6}Z\.db", backup.name), backup.name
    assert (f"its database (tokens, lease history, audit log) is kept as /var/backups/"
            f"{backup.name}" in purge.stderr), purge.stderr
    assert (tls / "server.key").read_text() == "the operator's key"
    assert "kept /etc/gpupoold: it holds files this package did not install" in purge.stderr
    assert "  tls/server.key" in purge.stderr, purge.stderr
    assert not (wants / "gpupoold.service").is_symlink(), "purge left the enable link"
    assert root.account("passwd")[2] == uid, "the system user stays (Debian policy)"

    # With nothing of the operator's there, the folder goes too.
    root.dpkg("-i", debs.daemon)
    (tls / "server.key").unlink()
    tls.rmdir()
    purge = root.dpkg("--purge", "gpupoold")
    assert not (root / "/etc/gpupoold").exists() and "kept" not in purge.stderr


QUESTION = "gpupoold/purge_delete_state"


@pytest.mark.parametrize(("answer", "kept"), [("no", True), ("yes", False)])
def test_purge_asks_before_deleting_the_database(debs: Debs, root: Root, answer: str,
                                                 kept: bool) -> None:
    """With debconf (here in the scratch root, its database there too): the purge asks, at
    priority high, whether to delete the state; "no" (the default) keeps /var/lib/gpupoold as
    it is, "yes" deletes it, without a copy. The answer goes with the package (db_purge)."""
    require(shutil.which("debconf-communicate"), "debconf is needed (Debian package debconf)")
    root.with_debconf()
    root.dpkg("-i", debs.daemon)
    (root / STATE / "gpupoold.db").write_text("tokens")
    purge = root.dpkg("--purge", "gpupoold", frontend="teletype", answer=answer + "\n")
    assert "Delete the gpupoold database (tokens, lease history, audit log)? [yes/no]" in \
        purge.stdout + purge.stderr, purge
    assert (root / STATE / "gpupoold.db").exists() == kept
    assert not (root / "/var/backups").exists(), "an answered question makes no copy"
    if kept:
        assert f"gpupoold: kept {STATE} (tokens, lease history, audit log" in purge.stderr
    assert QUESTION not in (root / "/var/cache/debconf/config.dat").read_text()
    assert not (root / CONFIG).exists()


def test_purge_takes_a_preseeded_answer_and_copies_when_nobody_answers(debs: Debs,
                                                                      root: Root) -> None:
    require(shutil.which("debconf-set-selections"), "debconf is needed (Debian package debconf)")
    root.with_debconf()
    # an answer given beforehand (debconf-set-selections marks it seen): no question
    root.dpkg("-i", debs.daemon)
    (root / STATE / "gpupoold.db").write_text("tokens")
    subprocess.run(["debconf-set-selections"], input=f"gpupoold {QUESTION} boolean true\n",
                   text=True, check=True, env={**os.environ, "DPKG_ROOT": str(root.path)})
    purge = root.dpkg("--purge", "gpupoold")
    assert not (root / STATE).exists() and not (root / "/var/backups").exists(), purge
    # a non-interactive frontend: nobody answers, the state goes and a copy of the database stays
    root.dpkg("-i", debs.daemon)
    (root / STATE / "gpupoold.db").write_text("tokens")
    (root / STATE / "gpupoold.db-wal").write_text("log")
    purge = root.dpkg("--purge", "gpupoold")
    assert not (root / STATE).exists()
    (copy,) = (root / "/var/backups").glob("gpupoold-*.db")
    assert copy.read_text() == "tokens" and Path(f"{copy}-wal").read_text() == "log"
    assert f"is kept as /var/backups/{copy.name}" in purge.stderr, purge.stderr
    # no database at all (PostgreSQL, or never started): nothing to ask or copy
    root.dpkg("-i", debs.daemon)
    copy.unlink()
    Path(f"{copy}-wal").unlink()
    purge = root.dpkg("--purge", "gpupoold", frontend="teletype")
    assert not (root / STATE).exists() and not list((root / "/var/backups").iterdir())
    assert "Delete the gpupoold database" not in purge.stdout + purge.stderr


class Installed:
    """gpupoold as the unit runs it, from the scratch root, on 2 simulated GPUs and free ports."""

    def __init__(self, root: Root, state: Path, log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(root / "/usr/bin/gpupoold"), "serve", "--config", str(root / CONFIG),
                 "--state-dir", str(state), "--simulated", "2", "--listen", "127.0.0.1:0",
                 "--http", "127.0.0.1:0"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=_clean_env(), cwd=state.parent, start_new_session=True)
        start = len(log.read_text(errors="replace"))
        self.remoting = self._address("remoting", start)
        # `gpupoold: identity SHA256:...` (the key clients pin: TLS by default)
        self.fingerprint = self._address("identity", start, r"(\S+)")
        self.http = self._address("http", start)
        self.admin = (state / "local-admin.token").read_text().strip()

    def _address(self, what: str, start: int, value: str = r"on (\S+)") -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = re.search(rf"^gpupoold: {what} {value}$", self.log.read_text(errors="replace")[start:],
                          re.M)
            if m:
                return m[1]
            if self.proc.poll() is not None:
                pytest.fail(f"installed gpupoold exited with {self.proc.returncode}:\n"
                            f"{self.log.read_text()}")
            time.sleep(0.1)
        pytest.fail(f"installed gpupoold: no {what} address:\n{self.log.read_text()}")

    def get(self, path: str) -> Any:
        req = urllib.request.Request(f"http://{self.http}{path}",
                                     headers={"Authorization": f"Bearer {self.admin}"})
        with urllib.request.urlopen(req, timeout=10) as reply:
            return json.loads(reply.read())

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def test_an_upgrade_keeps_running_jobs(debs: Debs, root: Root, tmp_path: Path,
                                       hold_gpu: Path) -> None:  # noqa: F811
    """Install, start jobs, stop the daemon, install a newer build, start it: the jobs (one
    streaming 1 GiB copies, one idle) finish correctly under the new daemon, with one unbroken
    lease each. (On a real system the postinst's `systemctl try-restart` does the stop and start.)"""
    root.dpkg("-i", debs.daemon)
    state, log = tmp_path / "state", tmp_path / "gpupoold.log"
    old = Installed(root, state, log)
    token = run_client([root / "/usr/bin/gpupoold", "token", "create", "--name", "jobs",
                        "--state-dir", state], env=_clean_env()).stdout.strip().splitlines()[-1]
    env = {**os.environ, "GPUPOOL_SERVER": old.remoting, "GPUPOOL_TOKEN": token,
           "GPUPOOL_CONFIG": "none", "LD_LIBRARY_PATH": str(hold_gpu.parent.parent / "client"),
           "GPUPOOL_TLS_FINGERPRINT": old.fingerprint}
    for var in ("LD_PRELOAD", "GPUPOOL_TLS", "GPUPOOL_TLS_CA"):
        env.pop(var, None)
    jobs: list[subprocess.Popen[str]] = []
    try:
        # Held 30 s: long enough for the stop, the newer package's install and the start to
        # happen while both still run, also on a loaded machine (at 12 s, with the test files
        # run two at a time, the jobs sometimes finished first: nothing was left to take over).
        for args in ((1 << 30, 30_000, 51, -1), (16 << 20, 30_000, 52, 0)):
            job = subprocess.Popen([str(hold_gpu), *map(str, args)], env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            jobs.append(job)
            assert job.stdout is not None
            line = job.stdout.readline()
            if "holding" not in line:
                pytest.fail(f"hold_gpu got no lease: {line}{job.communicate()[1]}",
                            pytrace=False)
        leases = {le["id"] for le in old.get("/api/v1/leases?state=active")["leases"]}
        assert len(leases) == 2
    except BaseException:  # leave no daemon or job behind
        for job in jobs:
            job.kill()
            job.communicate()
        old.stop()
        raise

    assert old.stop() == 0
    newer = _newer(debs.daemon, tmp_path, daemon_version=f"{DAEMON_VERSION}+upgraded")
    root.dpkg("-i", newer)
    assert root.status("gpupoold") == f"install ok installed {DAEMON_VERSION}-2"
    new = Installed(root, state, log)
    try:
        assert new.get("/api/v1/status")["version"] == f"{DAEMON_VERSION}+upgraded"
        # The new daemon takes both leases over (still active, or already ended by a job that
        # finished while a loaded machine was restarting it); no lease is new or missing.
        deadline = time.monotonic() + 30
        while {le["id"] for le in new.get("/api/v1/leases?state=active")["leases"]} | {
                le["id"] for le in new.get("/api/v1/leases?state=ended")["leases"]} != leases:
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        for job in jobs:
            out, err = job.communicate(timeout=120)
            assert job.returncode == 0 and "exact=1" in out, (out, err)
        deadline = time.monotonic() + 20
        while True:
            ended = {r["id"]: r for r in new.get("/api/v1/leases?state=ended")["leases"]}
            if set(ended) == leases and all(r["scrub_ok"] is not None for r in ended.values()):
                break
            assert time.monotonic() < deadline, ended
            time.sleep(0.1)
        for rec in ended.values():
            assert rec["end_reason"] == "client exit" and rec["scrub_ok"] is True, rec
    finally:
        code = new.stop()
    text = log.read_text(errors="replace")
    assert code == 0 and "Traceback" not in text, text
    assert "taking over 2 lease(s) of the previous gpupoold" in text


def test_client_remove_leaves_nothing(debs: Debs, root: Root) -> None:
    root.dpkg("-i", debs.client)
    run_client([root / "/usr/bin/gpupool", "--help"], env=_clean_env())
    root.dpkg("--purge", "gpupool-client")
    assert not (root / "/usr/lib/gpupool-client").exists()
    assert not (root / "/usr/share/doc/gpupool-client").exists()


# ------------------------------------------------------------------------------------ lintian
def test_lintian_reports_no_errors(debs: Debs) -> None:
    require(shutil.which("lintian"), "lintian not found: apt-get install lintian "
                                     "(scripts/bootstrap.sh does)")
    proc = run_client(["lintian", "--no-cfg", "--fail-on", "error", debs.daemon, debs.client],
                      timeout=600)
    tags = [line for line in (proc.stdout + proc.stderr).splitlines() if re.match(r"[EWIPXO]: ", line)]
    print("lintian (warnings are for information):\n" + "\n".join(tags))
    errors = [t for t in tags if t.startswith("E: ")]
    assert not errors, "lintian errors:\n" + "\n".join(errors)
    # Our programs are built with Debian's hardening flags (the Makefile's HARDEN=1).
    assert not [t for t in tags if "hardening-" in t], tags
    # Every command on PATH has its man page (scripts/man_pages.py, from its argparse
    # definition), and the pages are well formed.
    assert not [t for t in tags if "manual-page" in t or "manpage" in t], tags
    assert proc.returncode == 0, f"lintian failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"


# ------------------------------------------------------------------- the bundled dependencies
def test_the_dependency_lock_matches_the_project() -> None:
    """packaging/debian/gpupoold-deps.lock (scripts/lock-deps.py) covers every runtime dependency
    of pyproject.toml, each with a hash."""
    proc = run_client([sys.executable, REPO / "scripts" / "lock-deps.py", "--check"])
    assert proc.returncode == 0, proc.stderr
    lock = (REPO / "packaging" / "debian" / "gpupoold-deps.lock").read_text()
    pins = re.findall(r"^([a-z0-9-]+)==\S+ \\\n    --hash=sha256:[0-9a-f]{64}$", lock, re.M)
    assert len(pins) == lock.count("==") and {"aiohttp", "jinja2", "prometheus-client"} <= set(
        pins), pins


def _elves(deb: Path, where: Path) -> list[Path]:
    """Our own native files of a package (not the bundled wheels'), extracted under `where`."""
    subprocess.run(["dpkg-deb", "-x", str(deb), str(where)], check=True)
    return sorted(p for pattern in ("usr/lib/gpupoold/python/gpupoold/bin/*",
                                    "usr/lib/gpupool-client/python/gpupool/lib/*")
                  for p in where.glob(pattern)
                  if p.is_file() and not p.is_symlink() and p.read_bytes()[:4] == b"\x7fELF")


def _cet_possible(tmp: Path) -> bool:
    """Whether this toolchain can produce a program that hardening-check calls control-flow
    protected at all: Debian 12's C runtime start files carry no CET property, so no program
    linked there can (its dpkg-buildflags do not ask for -fcf-protection either)."""
    src = tmp / "cet.c"
    src.write_text("#include <stdio.h>\nint main(int c, char **v) { char b[64]; "
                   "snprintf(b, sizeof b, \"%s\", v[c - 1]); return puts(b); }\n")
    exe = tmp / "cet"
    subprocess.run(["gcc", "-O2", "-fcf-protection", str(src), "-o", str(exe)], check=True)
    out = subprocess.run(["hardening-check", str(exe)], capture_output=True, text=True).stdout
    return "Control flow integrity: yes" in out


def test_hardening_check_passes_every_program_and_library_we_build(debs: Debs,
                                                                   tmp_path: Path) -> None:
    """PIE, stack protector, FORTIFY, RELRO and BIND_NOW (and control-flow protection where the
    toolchain can give it) in the worker, the scrubber, the checkpoint tool, the simulated device
    and the client's shims, as they are in the packages (stripped)."""
    require(shutil.which("hardening-check"), "hardening-check not found: apt-get install "
                                             "devscripts (scripts/bootstrap.sh does)")
    elves = _elves(debs.daemon, tmp_path / "d") + _elves(debs.client, tmp_path / "c")
    names = {p.name for p in elves}
    assert {"gpupool-worker", "gpupool-scrub", "gpupool-checkpoint", "libgpupool-sim.so",
            "libcuda.so.1", "libnvidia-ml.so.1"} <= names, names
    extra = [] if _cet_possible(tmp_path) else ["--nocfprotection"]
    proc = run_client(["hardening-check", *extra, *elves], timeout=300)
    assert proc.returncode == 0, f"hardening-check {' '.join(extra)}:\n{proc.stdout}{proc.stderr}"


def _deb_difference(a: Path, b: Path) -> list[str]:
    """What differs between two .deb files: control members and data files by name."""
    out = []
    for what in ("--ctrl-tarfile", "--fsys-tarfile"):
        tars = []
        for deb in (a, b):
            data = subprocess.run(["dpkg-deb", what, str(deb)], capture_output=True,
                                  check=True).stdout
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                tars.append({m.name: (m.mode, m.uid, m.gid, m.mtime, m.linkname,
                                      tar.extractfile(m).read() if m.isfile() else b"")  # type: ignore[union-attr]
                             for m in tar.getmembers()})
        first, second = tars
        out += [f"{what} {n}: only in one" for n in sorted(first.keys() ^ second.keys())]
        out += [f"{what} {n}" for n in sorted(first.keys() & second.keys())
                if first[n] != second[n]]
    return out or ["the .deb files differ, their contents do not (the ar or compression layer)"]


def test_a_second_build_in_another_directory_is_identical(debs: Debs, tmp_path: Path) -> None:
    """Reproducible packages: the clone moved to another path and `make debs` run there again
    (other temporary folders, another time, the native code built anew for the new path) makes
    the same bytes. An older package in the output folder stays."""
    moved = tmp_path / "elsewhere" / "gpupool-2"
    moved.parent.mkdir()
    debs.clone.rename(moved)
    out = moved / "dist" / "deb"
    older = out / "gpupoold_0.0.1-1_amd64.deb"
    older.write_bytes(b"the version one would roll back to")
    proc = _make_debs(moved)
    assert "[1/6]" in proc.stdout
    for deb in (debs.daemon, debs.client):
        again = out / deb.name
        if again.read_bytes() != deb.read_bytes():
            pytest.fail(f"{deb.name} differs between two builds:\n" +
                        "\n".join(_deb_difference(deb, again)[:40]), pytrace=False)
    assert older.read_bytes() == b"the version one would roll back to"


def test_shipped_documents_link_only_to_shipped_documents(
        daemon_files: dict[str, tarfile.TarInfo], client_files: dict[str, tarfile.TarInfo],
        debs: Debs) -> None:
    """Every link of every installed document leads to a file of its package (or, from the
    client's, of gpupoold's, by its installed path), the operator guide's included; the man pages
    name only installed documents."""
    checked = 0
    for deb, files in ((debs.daemon, daemon_files), (debs.client, client_files)):
        for path in sorted(p for p in files if p.startswith("/usr/share/doc/") and
                           p.endswith(".md")):
            text = _extract_file(deb, path).decode()
            for target in re.findall(r"\]\(([^)\s]+)\)", text):
                if target.startswith("#") or re.match(r"[a-z][a-z0-9+.-]*:", target):
                    continue
                name = target.split("#")[0]
                resolved = os.path.normpath(name if name.startswith("/") else
                                            os.path.join(os.path.dirname(path), name))
                assert resolved in files or resolved in daemon_files, \
                    f"{deb.name}: {path} links to {target}, which is not installed"
                checked += 1
    assert checked > 20, checked
    guide = _extract_file(debs.daemon, "/usr/share/doc/gpupoold/operator-guide.md").decode()
    for doc in ("dashboard.md", "user-guide.md", "protocol.md", "packaging.md", "systemd.md"):
        assert f"]({doc}" in guide and f"/usr/share/doc/gpupoold/{doc}" in daemon_files, doc
    assert "](../" not in guide
    for deb, files, page in ((debs.daemon, daemon_files, "/usr/share/man/man8/gpupoold.8.gz"),
                             (debs.client, client_files, "/usr/share/man/man1/gpupool.1.gz")):
        text = gzip.decompress(_extract_file(deb, page)).decode().replace("\\-", "-")
        for doc in re.findall(r"/usr/share/doc/[\w-]+/[\w.-]+\.md", text):
            assert doc in files or doc in daemon_files, f"{page} names {doc}, not installed"


def test_build_errors_name_the_cause(tmp_path: Path) -> None:
    """build-debs.sh refuses a bad input before it builds anything, saying what to do."""
    script = REPO / "scripts" / "build-debs.sh"
    proc = run_client([script, tmp_path], env={**_build_env(), "DEBIAN_REVISION": "two"})
    assert proc.returncode == 1
    assert "DEBIAN_REVISION=two is no Debian revision" in proc.stderr, proc.stderr
    # a missing tool: which, and the Debian package that has it
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("make", "gcc", "dpkg-deb", "python3", "dirname", "sed"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    proc = run_client(["/bin/bash", script, tmp_path], env={**_build_env(),
                                                           "PATH": str(bin_dir)})
    assert proc.returncode == 1
    assert ("dpkg-shlibdeps not found: install it with `apt-get install --no-install-recommends "
            "dpkg-dev`") in proc.stderr, proc.stderr


def test_admin_commands_as_another_user_say_to_use_sudo(debs: Debs) -> None:
    """The installed `gpupoold` (the package's wrapper, the system's python3) run by a user who
    is not root: `token list` on the package's state directory and `status` say in one line to
    use sudo; no traceback."""
    require(os.geteuid() == 0, "needs root (useradd, runuser)")
    require(shutil.which("useradd") and shutil.which("runuser"), "useradd and runuser needed")
    base = Path(tempfile.mkdtemp(prefix="gpupool-debs-"))  # reachable by every user
    base.chmod(0o755)
    user = f"gpt-deb-{os.getpid() % 100000:05d}"
    try:
        root = Root(base / "root")
        root.dpkg("-i", debs.daemon)
        state = root / STATE
        made = run_client([root / "/usr/bin/gpupoold", "token", "create", "--name", "alice",
                           "--state-dir", state], env=_clean_env())
        assert made.returncode == 0, made
        subprocess.run(["useradd", "--no-create-home", "--user-group", user], check=True)
        daemon = Installed(root, state, base / "gpupoold.log")
        try:
            for argv, command in ((["token", "list"], "gpupoold token list"),
                                  (["status", "--http", daemon.http], "gpupoold status")):
                proc = run_client(["runuser", "-u", user, "--", root / "/usr/bin/gpupoold",
                                   *argv, "--state-dir", state], env=_clean_env(), cwd=base)
                assert proc.returncode == 1 and proc.stdout == "", proc
                assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc
                assert f"permission denied for {user}" in proc.stderr, proc.stderr
                assert f"run it with sudo (`sudo {command}`)" in proc.stderr, proc.stderr
        finally:
            assert daemon.stop() == 0
    finally:
        subprocess.run(["userdel", user], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)

