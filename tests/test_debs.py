"""The Debian packages: scripts/build-debs.sh builds gpupoold and gpupool-client from this
checkout; their files land where the systemd units expect them; installed into a scratch root
(`dpkg --root ROOT --force-script-chrootless`, so the maintainer scripts really run, with
$DPKG_ROOT=ROOT) they create the gpupoold user and state directory, the installed commands run
from the installed tree, the daemon starts with the shipped default config; an upgrade keeps the
edited conffile and the state, a purge removes both; lintian reports no errors.

Needs dpkg-deb, dpkg-shlibdeps (dpkg-dev), make, gcc, lintian and root (the postinst chowns the
state directory); scripts/bootstrap.sh installs the Debian tools. See docs/packaging.md.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, require, run_client
from test_e2e_leases import hold_gpu  # noqa: F401 (fixture)

from gpupoold import __version__ as DAEMON_VERSION
from gpupoold.config.file import load_settings
from gpupoold.config.settings import Settings, settings_info

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


@pytest.fixture(scope="module")
def debs(tmp_path_factory: pytest.TempPathFactory) -> Debs:
    """Both packages, built once by scripts/build-debs.sh."""
    for tool, package in (("dpkg-deb", "dpkg"), ("dpkg-shlibdeps", "dpkg-dev"), ("make", "make"),
                          ("gcc", "gcc")):
        require(shutil.which(tool), f"{tool} not found (Debian package {package}; "
                                    "scripts/bootstrap.sh installs it)")
    out = tmp_path_factory.mktemp("deb")
    started = time.monotonic()
    proc = run_client([REPO / "scripts" / "build-debs.sh", out],
                      env=dict(os.environ, PYTHON=sys.executable), timeout=600)
    assert proc.returncode == 0, f"build-debs.sh failed:\n{proc.stdout}\n{proc.stderr}"
    print(f"build-debs.sh took {time.monotonic() - started:.0f} s")
    daemon = out / f"gpupoold_{DAEMON_VERSION}-1_amd64.deb"
    client = out / f"gpupool-client_{CLIENT_VERSION}-1_amd64.deb"
    assert daemon.is_file() and client.is_file(), f"{out} holds {sorted(os.listdir(out))}"
    return Debs(daemon, client, proc.stdout)


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
    assert (f"ExecStart=/usr/bin/gpupoold serve --config {CONFIG} --state-dir {STATE}"
            in service)
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
    text = _extract_file(debs.daemon, CONFIG).decode()
    assert tomllib.loads(text) == {}, "every setting is commented out"
    lines = dict(re.findall(r"^# (\w+) = (.+)$", text, re.M))
    defaults = Settings()
    for info in settings_info():
        assert info.name in lines, f"setting {info.name} is missing from packaging/debian/gpupoold.toml"
        if info.default is not None:
            value = tomllib.loads(f"v = {lines[info.name]}")["v"]
            want = getattr(defaults, info.name)
            assert (Path(value) if isinstance(want, Path) else value) == want, \
                f"{info.name}: the config shows {lines[info.name]}, the default is {info.default_text()}"
        comment = text.split(f"\n# {info.name} = ")[0].rsplit("\n", 1)[-1]
        assert comment.startswith("# ") and len(comment) > 10, f"{info.name} has no explanation line"
    # with every line uncommented the file is still valid (the examples too)
    uncommented = tmp_path / "all.toml"
    uncommented.write_text("\n".join(f"{k} = {v}" for k, v in lines.items()) + "\n")
    load_settings(uncommented)


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

    def dpkg(self, *args: str | Path) -> subprocess.CompletedProcess[str]:
        # --force-depends: python3 and libc6 live on the host, not in this root's database
        cmd = ["dpkg", f"--root={self.path}", f"--log={self.path / 'dpkg.log'}",
               "--force-script-chrootless", "--force-depends", "--force-confold", *map(str, args)]
        proc = run_client(cmd, timeout=180)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
        return proc

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
    assert "systemctl enable --now" in out, "the postinst says how to start the service"
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
    assert "systemctl enable --now" not in out, "an upgrade does not repeat the first-install note"
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
        self.http = self._address("http", start)
        self.admin = (state / "local-admin.token").read_text().strip()

    def _address(self, what: str, start: int) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = re.search(rf"^gpupoold: {what} on (\S+)$", self.log.read_text(errors="replace")[start:],
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
           "GPUPOOL_CONFIG": "none", "LD_LIBRARY_PATH": str(hold_gpu.parent.parent / "client")}
    env.pop("LD_PRELOAD", None)
    jobs = []
    for args in ((1 << 30, 12_000, 51, -1), (16 << 20, 12_000, 52, 0)):
        job = subprocess.Popen([str(hold_gpu), *map(str, args)], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert job.stdout is not None and "holding" in job.stdout.readline()
        jobs.append(job)
    leases = {le["id"] for le in old.get("/api/v1/leases?state=active")["leases"]}
    assert len(leases) == 2

    assert old.stop() == 0
    newer = _newer(debs.daemon, tmp_path, daemon_version=f"{DAEMON_VERSION}+upgraded")
    root.dpkg("-i", newer)
    assert root.status("gpupoold") == f"install ok installed {DAEMON_VERSION}-2"
    new = Installed(root, state, log)
    try:
        assert new.get("/api/v1/status")["version"] == f"{DAEMON_VERSION}+upgraded"
        deadline = time.monotonic() + 20
        while {le["id"] for le in new.get("/api/v1/leases?state=active")["leases"]} != leases:
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


def _dependency_files(deb: Path) -> dict[str, bytes]:
    """The bundled third-party files of the daemon's package (not gpupool's own), by path."""
    data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True,
                          check=True).stdout
    ours = ("gpupoold", "gpupool_protocol")
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar.getmembers():
            path = "/" + m.name.removeprefix("./")
            rel = path.removeprefix(f"{TREE}/")
            if rel == path or not m.isfile() or rel.split("/")[0].split("-")[0] in ours:
                continue
            f = tar.extractfile(m)
            assert f is not None
            out[rel] = f.read()
    return out


def test_two_builds_bundle_the_same_dependency_bytes(debs: Debs, tmp_path: Path) -> None:
    proc = run_client([REPO / "scripts" / "build-debs.sh", tmp_path],
                      env=dict(os.environ, PYTHON=sys.executable), timeout=600)
    assert proc.returncode == 0, f"build-debs.sh failed:\n{proc.stdout}\n{proc.stderr}"
    first = _dependency_files(debs.daemon)
    second = _dependency_files(tmp_path / debs.daemon.name)
    assert len(first) > 100 and any(p.startswith("aiohttp/") for p in first), sorted(first)[:5]
    assert first.keys() == second.keys()
    assert [p for p in first if first[p] != second[p]] == []
