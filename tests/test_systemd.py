"""The systemd units (systemd/) and gpupoold's sd_notify support (gpupoold/sdnotify.py)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpupoold import cli, sdlisten, tls_identity
from gpupoold.cli import build_parser
from gpupoold.config import file as config_file
from gpupoold.config.file import load_settings
from gpupoold.config.settings import Settings, iter_flags
from gpupoold.gpu import reset_helper
from gpupoold.sdnotify import Notifier, watchdog_interval

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "systemd"
UNIT_FILES = ("gpupoold.service", "gpupool-reset-helper.socket", "gpupool-reset-helper.service",
              "gpupoold.socket", "gpupoold-http.socket")
# Optional socket activation of gpupoold's two listeners (gpupoold/sdlisten.py): unit -> the
# FileDescriptorName gpupoold takes from it, and the setting whose default address it listens on.
ACTIVATION_SOCKETS = {"gpupoold.socket": (sdlisten.REMOTING, "listen"),
                      "gpupoold-http.socket": (sdlisten.HTTP, "http")}
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"


def directives(path: Path) -> dict[str, list[str]]:
    """`Section.Key` -> every value it is given (systemd units repeat keys), comments left out."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a Key=value line: {line!r}"
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def one(d: dict[str, list[str]], key: str) -> str:
    assert key in d, f"{key} missing"
    assert len(d[key]) == 1, f"{key} given {len(d[key])} times: {d[key]}"
    return d[key][0]


# ------------------------------------------------------------------------ systemd-analyze
def _verify(folder: Path, names: list[str]) -> subprocess.CompletedProcess[str]:
    if not os.path.exists(SYSTEMD_ANALYZE):
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is missing: install the systemd package")
        pytest.skip("systemd-analyze is not installed")
    return subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", *names], cwd=folder,
                          capture_output=True, text=True, timeout=60)


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that every ExecStart binary exists: point /usr/bin/ and /usr/libexec/gpupoold/
    # at stand-ins here.
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for unit in UNIT_FILES:
        text = (UNITS / unit).read_text()
        for exe in re.findall(r"^Exec\w+=[-@:+!]*(/usr/(?:bin|libexec/gpupoold)/\S+)", text,
                              re.M):
            stub = stubs / Path(exe).name
            stub.write_text("#!/bin/sh\nexit 0\n")
            stub.chmod(0o755)
        (tmp_path / unit).write_text(text.replace("/usr/bin/", f"{stubs}/").replace(
            "/usr/libexec/gpupoold/", f"{stubs}/"))
    assert (stubs / "gpupoold").exists() and (stubs / "gpupool-reset-helper").exists()
    proc = _verify(tmp_path, list(UNIT_FILES))
    # verify exits 0 on an unknown key or a bad value and only says so: no output at all is a pass.
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), \
        f"systemd-analyze verify (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"

    # ...and it does say so (the check above is not blind):
    bad = tmp_path / "bad.service"
    bad.write_text((tmp_path / "gpupoold.service").read_text()
                   .replace("ProtectSystem=strict", "ProtectSystem=strikt"))
    proc = _verify(tmp_path, ["bad.service"])
    assert re.search(r"bad\.service:\d+: Failed to parse protect system value", proc.stderr), \
        proc.stderr


# ------------------------------------------------------------------------ gpupoold.service
HARDENING = {
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "NoNewPrivileges": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "ProtectHostname": "yes",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "SystemCallFilter": "@system-service",
    "SystemCallArchitectures": "native",
    "CapabilityBoundingSet": "",
    "DevicePolicy": "closed",
}


def test_gpupoold_service_is_hardened() -> None:
    d = directives(UNITS / "gpupoold.service")
    for key, value in HARDENING.items():
        assert one(d, f"Service.{key}") == value, key
    assert set(one(d, "Service.RestrictAddressFamilies").split()) == {
        "AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    # GPU nodes through DeviceAllow, never by hiding /dev.
    assert "Service.PrivateDevices" not in d
    allowed = {v.split()[0]: v.split()[1] for v in d["Service.DeviceAllow"]}
    assert allowed.get("/dev/nvidiactl") == "rw"
    assert allowed.get("char-nvidia-uvm") == "rw"  # /dev/nvidia-uvm, /dev/nvidia-uvm-tools
    assert allowed.get("char-nvidia-frontend") == "rw"  # /dev/nvidia0..N
    # CUDA's JIT needs W+X memory: the unit must not set it, and must say why.
    assert "Service.MemoryDenyWriteExecute" not in d
    assert re.search(r"^#.*MemoryDenyWriteExecute.*\n#.*JIT", (UNITS / "gpupoold.service")
                     .read_text(), re.M)


def test_gpupoold_service_gives_the_daemon_enough_open_files() -> None:
    """The hard limit that gpupoold raises its soft one to at start (gpupoold/fdlimit.py)."""
    from gpupoold.fdlimit import LOW, WANTED

    d = directives(UNITS / "gpupoold.service")
    assert int(one(d, "Service.LimitNOFILE")) == WANTED >= LOW


def test_gpupoold_service_runs_the_daemon_unprivileged_with_notify() -> None:
    d = directives(UNITS / "gpupoold.service")
    assert one(d, "Service.Type") == "notify"
    assert one(d, "Service.WatchdogSec") == "30"
    assert one(d, "Service.Restart") == "on-failure"
    assert one(d, "Service.RestartPreventExitStatus") == "78"  # EX_CONFIG (gpupoold/config/file.py)
    assert one(d, "Service.User") == one(d, "Service.Group") == "gpupoold"
    for kind in ("State", "Runtime", "Configuration"):
        assert one(d, f"Service.{kind}Directory") == "gpupoold"
    assert "Service.LoadCredential" in {
        f"Service.{m}" for m in re.findall(r"^#(LoadCredential)=", (UNITS / "gpupoold.service")
                                           .read_text(), re.M)}
    # The runtime directory holds the reset helper's socket: it must survive a daemon restart.
    assert one(d, "Service.RuntimeDirectoryPreserve") == "yes"

    # ExecStart is a command line `gpupoold serve` accepts: the config file and nothing else
    # (one state directory: the config decides it for the daemon and the admin commands alike).
    argv = one(d, "Service.ExecStart").split()
    assert argv[:2] == ["/usr/bin/gpupoold", "serve"]
    args = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert args == {"--config": "/etc/gpupoold/gpupoold.toml"}
    help_text = subprocess.run([sys.executable, "-m", "gpupoold", "serve", "--help"], cwd=REPO,
                               capture_output=True, text=True, timeout=60, check=True).stdout
    for flag in args:
        assert flag in help_text
    # The directory systemd makes for it is the default state_dir.
    assert Path("/var/lib") / one(d, "Service.StateDirectory") == Settings().state_dir


def _unit_settings(config: Path) -> Settings:
    """The settings the unit's daemon runs with, the packaged config at `config`: its ExecStart
    parsed by `gpupoold serve`'s own parser, the flags applied over the file as `serve` does."""
    argv = one(directives(UNITS / "gpupoold.service"), "Service.ExecStart").split()[1:]
    argv = [str(config) if a == "/etc/gpupoold/gpupoold.toml" else a for a in argv]
    args = build_parser().parse_args(argv)
    return load_settings(args.config, {i.name: getattr(args, i.name) for i in iter_flags()})


@pytest.mark.parametrize("edit", ["", 'state_dir = "/srv/gpupool/state"\n'])
def test_the_daemon_and_the_admin_commands_use_one_state_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: str) -> None:
    """The packaged config as shipped, and with state_dir changed by the operator: the unit's
    daemon and `gpupoold token ...` / `gpupoold status` without options (they read the default
    config, /etc/gpupoold/gpupoold.toml) find the same state directory."""
    config = tmp_path / "gpupoold.toml"
    config.write_text((REPO / "packaging" / "debian" / "gpupoold.toml").read_text() + edit)
    monkeypatch.setattr(config_file, "DEFAULT_CONFIG", config)
    daemon = _unit_settings(config).state_dir
    assert daemon == (Path("/srv/gpupool/state") if edit else Settings().state_dir)
    seen: dict[str, Path] = {}

    def record_db(state_dir: Path, create: bool, command: str = "") -> None:
        seen["token"] = state_dir
        raise cli.CliError("stop here")

    def record_token(args: object, settings: Settings) -> None:
        seen["status"] = settings.state_dir
        raise cli.CliError("stop here")

    def record_identity(state_dir: Path) -> None:
        seen["fingerprint"] = state_dir
        raise cli.CliError("stop here")

    monkeypatch.setattr(cli, "open_db", record_db)
    monkeypatch.setattr(cli, "_admin_token", record_token)
    monkeypatch.setattr(tls_identity, "identity_paths", record_identity)
    for argv in (["token", "list"], ["status"], ["fingerprint"]):
        assert cli.main(argv) == 1
    assert seen == {"token": daemon, "status": daemon, "fingerprint": daemon}


def test_sysusers_creates_the_service_user() -> None:
    d = directives(UNITS / "gpupoold.service")
    lines = [ln.split() for ln in (UNITS / "gpupoold.sysusers").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert ["u", one(d, "Service.User")] in [ln[:2] for ln in lines]


def test_reset_helper_units_match_the_helper_and_the_daemon() -> None:
    sock = directives(UNITS / "gpupool-reset-helper.socket")
    svc = directives(UNITS / "gpupool-reset-helper.service")
    path = Path(one(sock, "Socket.ListenStream"))
    # Where gpupoold looks by default, and where the helper would bind on its own.
    assert path == Settings().reset_socket == reset_helper.DEFAULT_SOCKET
    assert one(sock, "Socket.SocketMode") == "0660"
    assert one(sock, "Socket.SocketGroup") == "gpupoold"
    # The helper accept()s on the listening socket systemd passes and runs one reset at a time.
    assert one(sock, "Socket.Accept") == "no"
    # Root-only, no command for people: not on PATH.
    assert one(svc, "Service.ExecStart").split()[0] == "/usr/libexec/gpupoold/gpupool-reset-helper"
    assert "gpupool-reset-helper" in (REPO / "pyproject.toml").read_text()
    assert "Service.PrivateDevices" not in svc


def test_activation_sockets_match_what_gpupoold_takes() -> None:
    assert set(ACTIVATION_SOCKETS) <= set(UNIT_FILES)  # verified by systemd-analyze above
    names = []
    for unit, (name, setting) in ACTIVATION_SOCKETS.items():
        d = directives(UNITS / unit)
        # systemd names every descriptor of a unit alike: one unit per listener.
        assert one(d, "Socket.FileDescriptorName") == name
        names.append(name)
        assert one(d, "Socket.ListenStream") == getattr(Settings(), setting), unit
        assert one(d, "Socket.Service") == "gpupoold.service"
        assert one(d, "Socket.Accept") == "no"  # gpupoold accept()s on the listening socket
        assert one(d, "Install.WantedBy") == "sockets.target"
        assert not any(k.startswith("Socket.ListenDatagram") for k in d)
        assert unit in (UNITS / "README.md").read_text()
    assert sorted(names) == sorted(sdlisten.NAMES)
    # Optional: the service neither needs nor pulls in the sockets; without them it binds.
    svc = directives(UNITS / "gpupoold.service")
    assert "Service.Sockets" not in svc
    for key in ("Unit.Requires", "Unit.Wants", "Unit.BindsTo"):
        assert not any(u in v for v in svc.get(key, []) for u in ACTIVATION_SOCKETS), key


# ----------------------------------------------------------------------------- sd_notify
@pytest.fixture
def notify_socket() -> Iterator[tuple[str, socket.socket]]:
    """A bound AF_UNIX datagram socket in the abstract namespace: ($NOTIFY_SOCKET, socket)."""
    name = f"@gpupool-test-notify-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name[1:].encode())
    with sock:
        yield name, sock


def receive(sock: socket.socket, until: Callable[[list[dict[str, str]]], bool],
            timeout: float = 15) -> list[dict[str, str]]:
    """Datagrams (as KEY -> value) until `until(all so far)` holds; AssertionError at timeout."""
    got: list[dict[str, str]] = []
    deadline = time.monotonic() + timeout
    while not until(got):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"after {timeout} s the notify socket got only {got}")
        sock.settimeout(left)
        try:
            data = sock.recv(4096)
        except TimeoutError:
            continue
        got.append(dict(f.split("=", 1) for f in data.decode().split("\n") if f))
    return got


def test_daemon_notifies_ready_watchdog_and_stopping(
        start_daemon: Callable[..., object], notify_socket: tuple[str, socket.socket]) -> None:
    name, sock = notify_socket
    server = start_daemon(env={"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "200000"})
    got = receive(sock, lambda g: any(m.get("READY") == "1" for m in g))
    ready = next(m for m in got if m.get("READY") == "1")
    assert ready["STATUS"].startswith("serving: remoting on ")
    assert server.address in ready["STATUS"]  # type: ignore[attr-defined]
    assert ready["MAINPID"] == str(server.proc.pid)  # type: ignore[attr-defined]
    # Every 0.1 s: ten in well under the 10 s allowed even on a loaded machine.
    got = receive(sock, lambda g: sum(m.get("WATCHDOG") == "1" for m in g) >= 10, timeout=10)
    assert all(m == {"WATCHDOG": "1"} for m in got)
    assert server.stop() == 0  # type: ignore[attr-defined]
    got = receive(sock, lambda g: any(m.get("STOPPING") == "1" for m in g), timeout=5)
    assert got[-1]["STATUS"].startswith("stopping")


def test_notifier_sends_to_a_socket_path() -> None:
    path = Path("/tmp") / f"gpupool-notify-{uuid.uuid4().hex[:12]}.sock"  # short: sun_path
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    try:
        notifier = Notifier({"NOTIFY_SOCKET": str(path)})
        assert notifier.enabled and notifier.watchdog is None
        assert notifier.send("STATUS=hello")
        sock.settimeout(5)
        assert sock.recv(100) == b"STATUS=hello"
    finally:
        sock.close()
        path.unlink()
    # The receiver went away: send says so once in the log and never raises.
    assert notifier.send("READY=1") is False
    notifier.close()


def test_notifier_without_notify_socket_does_nothing() -> None:
    notifier = Notifier({"WATCHDOG_USEC": "200000"})
    assert not notifier.enabled and notifier.watchdog is None
    assert notifier.send("READY=1") is False

    async def lifecycle() -> None:
        notifier.ready("serving")
        notifier.stopping()

    asyncio.run(lifecycle())
    assert Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled is False


def test_watchdog_interval() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}, pid=42) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "42"}, pid=42) == 0.1
    assert watchdog_interval({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "43"}, pid=42) is None
    assert watchdog_interval({}, pid=42) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}, pid=42) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}, pid=42) is None
