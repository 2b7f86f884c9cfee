"""systemd socket activation of gpupoold's listeners (gpupoold/sdlisten.py, systemd/*.socket).

The parser and the socket checks run in this process; the end-to-end tests start `gpupoold serve`
as systemd would: listening sockets at fds 3 and 4 and LISTEN_PID/LISTEN_FDS/LISTEN_FDNAMES set
for the daemon's own pid (a tiny wrapper that execs gpupoold, or systemd-socket-activate).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import REPO, STARTUP_TIMEOUT, daemon_env, have, native_paths, require, run_client
from test_info import ask, document, info_request
from test_remoting_tls import Pki, pki  # noqa: F401  (pki is a fixture)
from test_systemd import notify_socket, receive  # noqa: F401  (notify_socket is a fixture)

from gpupoold.sdlisten import SdListenError, check_socket, parse

PID = 4242


def env(names: str | None, count: int | str | None = None, pid: int = PID) -> dict[str, str]:
    out = {"LISTEN_PID": str(pid)}
    if count is None and names is not None:
        count = len(names.split(":"))
    if count is not None:
        out["LISTEN_FDS"] = str(count)
    if names is not None:
        out["LISTEN_FDNAMES"] = names
    return out


# ------------------------------------------------------------------------------------ parse
def test_parse_maps_names_to_descriptors_from_3() -> None:
    assert parse(env("remoting:http"), PID) == {"remoting": 3, "http": 4}
    assert parse(env("http:remoting"), PID) == {"http": 3, "remoting": 4}
    assert parse(env("http"), PID) == {"http": 3}
    assert parse(env("remoting"), PID) == {"remoting": 3}


def test_parse_without_activation_is_empty() -> None:
    assert parse({}, PID) == {}
    assert parse({"PATH": "/usr/bin"}, PID) == {}
    # Passed to another process (inherited from a parent that was activated): not ours.
    assert parse(env("remoting:http", pid=PID + 1), PID) == {}
    assert parse({"LISTEN_FDS": "2", "LISTEN_FDNAMES": "remoting:http"}, PID) == {}
    assert parse(env(None, count=0), PID) == {}


@pytest.mark.parametrize(("variables", "message"), [
    (env("gpupoold.socket"), r"fd 3 is named 'gpupoold.socket', but gpupoold takes only "
                             r"'remoting' and 'http'.*FileDescriptorName=remoting"),
    (env("remoting:metrics"), r"fd 4 is named 'metrics'"),
    (env("remoting:remoting"), r"more than one socket named 'remoting' \(fds 3 and 4\).*"
                               r"single ListenStream="),
    (env(None, count=2), r"2 socket\(s\) passed without names \(LISTEN_FDNAMES is not set\).*"
                         r"FileDescriptorName=http"),
    (env("remoting:http", count=1), r"LISTEN_FDS=1 but LISTEN_FDNAMES has 2 name\(s\)"),
    (env("remoting", count="two"), r"LISTEN_FDS='two' is not a number"),
    (env("remoting", count="-1"), r"LISTEN_FDS='-1' is not a number"),
    (env("remoting", count=""), r"LISTEN_FDS='' is not a number"),
])
def test_parse_errors_say_what_to_change(variables: dict[str, str], message: str) -> None:
    with pytest.raises(SdListenError, match=message):
        parse(variables, PID)


# ------------------------------------------------------------------------------ check_socket
@pytest.fixture
def closing() -> Iterator[Callable[[socket.socket], socket.socket]]:
    made: list[socket.socket] = []

    def keep(sock: socket.socket) -> socket.socket:
        made.append(sock)
        return sock

    yield keep
    for sock in made:
        sock.close()


def tcp_listener(host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.bind((host, 0))
    sock.listen(16)
    return sock


def test_check_socket_takes_a_listening_tcp_socket(
        closing: Callable[[socket.socket], socket.socket]) -> None:
    for host in ("127.0.0.1", "::1"):
        original = closing(tcp_listener(host))
        sock = check_socket(original.fileno(), "remoting")
        assert sock.fileno() == original.fileno()
        assert sock.getsockname() == original.getsockname()
        sock.detach()  # `original` owns the descriptor here


def test_check_socket_refuses_what_is_not_a_listening_tcp_socket(
        closing: Callable[[socket.socket], socket.socket], tmp_path: Path) -> None:
    udp = closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    udp.bind(("127.0.0.1", 0))
    unix = closing(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    unix.bind(str(tmp_path / "s"))
    unix.listen(1)
    unbound = closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    read_end, write_end = os.pipe()
    closed = os.dup(read_end)
    os.close(closed)
    cases = [
        (udp.fileno(), r"is a datagram socket, not a stream socket; use ListenStream="),
        (unix.fileno(), r"is not a TCP socket \(AF_UNIX\).*ListenStream=PORT"),
        (unbound.fileno(), r"is not a listening socket.*set Accept=no"),
        (read_end, r"is not a socket; use ListenStream="),
        (closed, r"is not an open file descriptor"),
    ]
    try:
        for fd, message in cases:
            with pytest.raises(SdListenError, match=rf"fd {fd} \(FileDescriptorName=http\) "
                                                    + message):
                check_socket(fd, "http")
        # A refused descriptor is left open, as it was.
        for sock in (udp, unix, unbound):
            assert sock.fileno() >= 0 and sock.getsockname() is not None
        os.fstat(read_end)
    finally:
        os.close(read_end)
        os.close(write_end)


# -------------------------------------------------------------------------------------- take
TAKE_SCRIPT = """
import fcntl, json, os, socket, sys
from gpupoold import sdlisten
made = [socket.socket(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)]
for s in made:
    s.bind(("127.0.0.1", 0))
made[0].listen(4)
high = [fcntl.fcntl(s.fileno(), fcntl.F_DUPFD, 100) for s in made]
for s in made:
    s.close()
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i)  # inheritable, as systemd passes them
    os.close(fd)
env = dict(json.loads(sys.argv[1]), LISTEN_PID=str(os.getpid()), OTHER="kept")
try:
    got = sdlisten.take(env)
    out = {n: [s.fileno(), s.getsockname()[1] > 0, os.get_inheritable(s.fileno())]
           for n, s in got.items()}
except sdlisten.SdListenError as exc:
    out = {"error": str(exc)}
print(json.dumps({"result": out, "env": env}))
"""


def run_take(variables: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", TAKE_SCRIPT, json.dumps(variables)], cwd=REPO,
                          env=daemon_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_take_returns_the_sockets_close_on_exec_and_clears_the_environment() -> None:
    got = run_take({"LISTEN_FDS": "1", "LISTEN_FDNAMES": "http"})
    assert got["result"] == {"http": [3, True, False]}  # fd 3, bound, no longer inheritable
    assert got["env"] == {"OTHER": "kept"}
    # An unusable socket is an error, and the variables are gone all the same.
    got = run_take({"LISTEN_FDS": "2", "LISTEN_FDNAMES": "remoting:http"})
    assert re.match(r"systemd socket activation: fd 4 \(FileDescriptorName=http\) is a "
                    r"datagram socket", got["result"]["error"]), got
    assert got["env"] == {"OTHER": "kept"}


# ------------------------------------------------------------------------------ end to end
WRAPPER = """
import fcntl, os, sys
# As systemd does: the passed sockets at fds 3, 4, ... and LISTEN_* for this very pid, which
# execv keeps for gpupoold.
fds, names, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
high = [fcntl.fcntl(int(fd), fcntl.F_DUPFD, 100) for fd in fds.split(",")]
for fd in fds.split(","):
    os.close(int(fd))
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i)
    os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(len(high)), LISTEN_FDNAMES=names)
os.execv(sys.executable, [sys.executable, "-m", "gpupoold", *argv])
"""


class Activated:
    """`gpupoold serve` started with `sockets` passed as fds 3, 4, ... named `names`."""

    def __init__(self, tmp_path: Path, build_dir: Path, sockets: list[socket.socket],
                 names: str, *args: str, extra_env: dict[str, str] | None = None) -> None:
        self.state_dir = tmp_path / "state"
        self.log_path = tmp_path / "gpupoold.log"
        self._log = self.log_path.open("wb")
        fds = [s.fileno() for s in sockets]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRAPPER, ",".join(map(str, fds)), names, "serve",
             "--state-dir", str(self.state_dir), "--simulated", "1", "--auth", "none",
             *native_paths(build_dir), *args],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
            env=daemon_env(extra_env), pass_fds=fds, start_new_session=True)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def announced(self, what: str) -> str:
        rx = re.compile(rf"^gpupoold: {what} on (\S+)$", re.M)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            m = rx.search(self.log_text())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise AssertionError(f"gpupoold exited with {self.proc.returncode}:\n"
                                     f"{self.log_text()}")
            time.sleep(0.05)
        raise AssertionError(f"gpupoold did not announce {what}:\n{self.log_text()}")

    def identity(self) -> str | None:
        """The identity the daemon printed (`gpupoold: identity SHA256:...`: what a client pins),
        None for `identity none` (tls = "off")."""
        return identity_of(self.wait_for(r"^gpupoold: identity \S+.*$").group(0))

    def wait_for(self, pattern: str, timeout: float = 20) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while not (m := re.search(pattern, self.log_text(), re.M)):
            assert time.monotonic() < deadline, f"{pattern!r} not logged:\n{self.log_text()}"
            time.sleep(0.05)
        return m

    def wait(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"gpupoold still running after {timeout} s:\n"
                                 f"{self.log_text()}") from None

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.wait()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        else:
            try:  # workers of a daemon that died
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._log.close()


@pytest.fixture
def activate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Activated]]:
    started: list[Activated] = []

    def start(*args: Any, **kwargs: Any) -> Activated:
        daemon = Activated(tmp_path_factory.mktemp("activated"), *args, **kwargs)
        started.append(daemon)
        return daemon

    yield start
    problems = []
    for daemon in started:
        daemon.close()
        if "Traceback (most recent call last)" in daemon.log_text():
            problems.append(daemon.log_text())
    assert not problems, "\n".join(problems)


def healthz(address: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address}/healthz", timeout=30) as resp:
        body: dict[str, Any] = json.loads(resp.read())
    return body


def identity_of(log: str) -> str | None:
    """The fingerprint in a daemon's `gpupoold: identity SHA256:...` line (None: `identity none`,
    a daemon with tls = "off"); AssertionError when the log has no such line."""
    m = re.search(r"^gpupoold: identity (\S+)", log, re.M)
    assert m, f"no identity line:\n{log}"
    return m.group(1) if m.group(1).startswith("SHA256:") else None


def at(address: str, fingerprint: str | None = None) -> Any:
    """What test_info's `ask` needs of a server: host and port, and the identity a client pins
    (`fingerprint`; None: plain TCP, or a CA given to `ask`)."""
    host, _, port = address.rpartition(":")
    return SimpleNamespace(host=host, port=int(port), fingerprint=fingerprint)


def address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


# Configured addresses that cannot be bound (TEST-NET-1 is not this machine's): a daemon that
# starts at all did not bind them.
UNBINDABLE = ("--listen", "192.0.2.1:7070", "--http", "192.0.2.1:7071")


def test_daemon_serves_on_the_sockets_systemd_passed(
        activate: Callable[..., Activated], native_build: Path,
        notify_socket: tuple[str, socket.socket],  # noqa: F811
        closing: Callable[[socket.socket], socket.socket]) -> None:
    remoting, http = closing(tcp_listener()), closing(tcp_listener())
    name, notified = notify_socket
    daemon = activate(native_build, [remoting, http], "remoting:http", *UNBINDABLE,
                      extra_env={"NOTIFY_SOCKET": name})
    assert daemon.announced("remoting") == address(remoting)
    assert daemon.announced("http") == address(http)
    # The HTTP API answers on the passed socket, and knows its remoting address.
    body = healthz(address(http))
    body.pop("version")
    assert body == {"ok": True, "remoting": address(remoting), "gpus": 1, "leases": 0, "queue": 0,
                    "simulated": 1}
    # An info probe through the passed remoting socket (TLS, the default: pinned).
    doc = document(ask(at(address(remoting), daemon.identity()), info_request("")))
    assert doc["you"] == {"name": "anonymous", "role": "admin"} and len(doc["gpus"]) == 1
    # Logs and the sd_notify status line say where the sockets came from.
    log = daemon.log_text()
    assert re.search(rf"remoting listener on {address(remoting)}: socket from systemd \(fd 3, "
                     r"FileDescriptorName=remoting\); setting 'listen' \(192.0.2.1:7070\) is not "
                     r"used", log), log
    assert re.search(rf"HTTP listener on {address(http)}: socket from systemd \(fd 4, "
                     r"FileDescriptorName=http\)", log), log
    ready = next(m for m in receive(notified, lambda g: any("READY" in m for m in g))
                 if "READY" in m)
    assert ready["STATUS"] == (f"serving: remoting on {address(remoting)} (socket from systemd), "
                               f"http on {address(http)} (socket from systemd)")
    # The descriptors are close-on-exec, and the workers inherit neither them nor LISTEN_*.
    for fd in (3, 4):
        flags = int(re.search(r"^flags:\s+(\d+)", Path(f"/proc/{daemon.proc.pid}/fdinfo/{fd}")
                              .read_text(), re.M).group(1), 8)  # type: ignore[union-attr]
        assert flags & os.O_CLOEXEC, f"fd {fd} flags {flags:o}"
    worker = int(daemon.wait_for(r"worker pid (\d+) ready").group(1))  # the GPU's pre-started
    environ = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
    assert not [v for v in environ if v.startswith(b"LISTEN_")], environ
    listening = {os.readlink(f"/proc/{daemon.proc.pid}/fd/{fd}") for fd in (3, 4)}
    assert not listening & socket_inodes(worker)
    assert daemon.stop() == 0
    # gpupoold closed its copies only: systemd's (ours here) still listen, for the next start.
    with socket.create_connection(remoting.getsockname(), timeout=5):
        pass


def test_one_passed_socket_and_one_configured_address(
        native_build: Path, tmp_path: Path) -> None:
    """With systemd's own tool: the HTTP socket is passed, remoting binds its setting; the
    first connection to the HTTP port starts gpupoold (socket activation proper)."""
    tool = "systemd-socket-activate"
    require(have(tool), f"{tool} is not installed (Debian package systemd)")
    probe = tcp_listener()
    port = probe.getsockname()[1]  # a free port: the tool does not take port 0
    probe.close()
    log_path = tmp_path / "gpupoold.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [tool, "-l", f"127.0.0.1:{port}", "--fdname=http", sys.executable, "-m", "gpupoold",
             "serve", "--state-dir", str(tmp_path / "state"), "--simulated", "1", "--auth",
             "none", "--listen", "127.0.0.1:0", "--http", "192.0.2.1:7071",
             *native_paths(native_build)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
            env=daemon_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while f"127.0.0.1:{port}" not in log_path.read_text():  # the tool is listening
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        body = healthz(f"127.0.0.1:{port}")  # starts gpupoold; answered on this connection
        remoting = body["remoting"]
        assert body["ok"] is True and remoting.startswith("127.0.0.1:")
        assert not remoting.endswith(":0")
        text = log_path.read_text()
        assert f"gpupoold: http on 127.0.0.1:{port}" in text
        assert f"gpupoold: remoting on {remoting}" in text
        assert "socket from systemd (fd 3, FileDescriptorName=http)" in text
        assert "remoting listener on" not in text  # not passed: no "socket from systemd" line
        # TLS, the default: pinned to the identity the daemon printed.
        doc = document(ask(at(remoting, identity_of(text)), info_request("")))
        assert doc["server"]["auth"] == "none"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log_path.read_text()
        assert "Traceback" not in log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_remoting_tls_on_a_passed_socket(
        activate: Callable[..., Activated], native_build: Path, pki: Pki,  # noqa: F811
        tmp_path: Path, closing: Callable[[socket.socket], socket.socket]) -> None:
    config = tmp_path / "gpupoold.toml"
    config.write_text(f'tls_cert = "{pki.cert}"\ntls_key = "{pki.key}"\n')
    remoting = closing(tcp_listener())
    daemon = activate(native_build, [remoting], "remoting", "--config", str(config),
                      "--http", "127.0.0.1:0")
    assert daemon.announced("remoting") == address(remoting)
    daemon.announced("http")
    reply = ask(at(address(remoting)), info_request(""), tls_ca=pki.ca)
    assert (reply.result, reply.gpus) == (0, 1)
    assert "the remoting listener speaks TLS" in daemon.log_text()
    assert daemon.stop() == 0


@pytest.mark.parametrize(("names", "kind", "message"), [
    ("gpupoold.socket", socket.SOCK_STREAM,
     r"fd 3 is named 'gpupoold.socket', but gpupoold takes only 'remoting' and 'http'"),
    ("http", socket.SOCK_DGRAM,
     r"fd 3 \(FileDescriptorName=http\) is a datagram socket, not a stream socket"),
])
def test_unusable_sockets_stop_the_start_with_a_clear_error(
        activate: Callable[..., Activated], names: str, kind: int, message: str,
        closing: Callable[[socket.socket], socket.socket]) -> None:
    sock = closing(socket.socket(socket.AF_INET, kind))
    sock.bind(("127.0.0.1", 0))
    if kind == socket.SOCK_STREAM:
        sock.listen(1)
    daemon = activate(Path("/nonexistent"), [sock], names, *UNBINDABLE)
    assert daemon.wait() == 78  # EX_CONFIG: the socket unit is wrong, a restart cannot help
    assert re.search(r"^gpupoold: error: systemd socket activation: " + message,
                     daemon.log_text(), re.M), daemon.log_text()


def test_listen_variables_for_another_process_are_ignored_and_removed() -> None:
    """LISTEN_* meant for another process (inherited from an activated parent) are not used,
    and not passed on either."""
    proc = run_client([sys.executable, "-c", "import os, sys; from gpupoold import sdlisten; "
                       "e = dict(os.environ); print(sdlisten.take(e), sorted(e))"],
                      env=daemon_env({"LISTEN_PID": "1", "LISTEN_FDS": "2",
                                      "LISTEN_FDNAMES": "remoting:http"}), cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    got, names = proc.stdout.split(" ", 1)
    assert got == "{}" and "LISTEN_PID" not in names and "LISTEN_FDS" not in names
