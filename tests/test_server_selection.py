"""End to end: server selection in the client shim (client/shim/connect.c;
docs/architecture.md, "Server selection") with two real gpupoold on simulated GPUs, each knowing
only its own token, and a configuration file with both as [[servers]] entries (per-server
tokens) and pins (tls_fingerprint: the daemons speak TLS, gpupoold's default): a busy first
server sends the program to the second; a server that is down is skipped with one warning line;
with both free the first in list order wins; a server that refuses the token is skipped. The
stand-ins below (FakeServer: a trickling or oversized answer, a protocol 1.0 relay) speak the
plaintext protocol, and their entries say so with `tls = false`. Also the shim's exports for the
NVML shim and `gpupool doctor` (gpupool_shim_version, gpupool_shim_lease).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import gpupool_protocol as gp
import pytest
from conftest import REPO, GpupoolServer, run_client
from gpupool.wire.frames import read_exactly
from test_e2e_leases import ended_leases, facts, hold_gpu, start_client, wait_until  # noqa: F401  (hold_gpu is a fixture)
from test_remoting_tls import Pki, pki, tls_daemon  # noqa: F401  (pki is a fixture)

MIB = 1 << 20
HEADER = struct.Struct("<IHHQ")  # len, op, flags, req (docs/protocol.md)


def two_daemons(start_daemon: Any, native_build: Path, tls: bool = True,
                ) -> tuple[GpupoolServer, GpupoolServer]:
    """Two daemons on one simulated GPU each, each with a token only it knows (.sel_token);
    tls=False: `--tls off` daemons (for a plaintext relay in front of them)."""
    servers = []
    for name in ("a", "b"):
        server = start_daemon(build_dir=native_build, tls=tls)
        server.sel_token = server.create_token(f"selection-{name}")  # type: ignore[attr-defined]
        servers.append(server)
    return servers[0], servers[1]


def write_config(path: Path, entries: list[tuple[str, str, str | None]], top: str = "") -> Path:
    """A configuration file of [[servers]] entries (address, token, pin): the pin is the
    server's identity (tls_fingerprint, what `gpupool login` writes), None an entry with
    `tls = false` (plain TCP, for a stand-in that speaks the plaintext protocol or a
    `--tls off` daemon); `top`: top-level keys written before the entries."""
    text = top + "# servers, each with its own token\n"
    for address, token, pin in entries:
        trust = f'tls_fingerprint = "{pin}"' if pin is not None else "tls = false"
        text += f'[[servers]]\naddress = "{address}"\ntoken = "{token}"\n{trust}\n\n'
    path.write_text(text)
    path.chmod(0o600)
    return path


def pinned(server: GpupoolServer, token: str | None = None) -> tuple[str, str, str | None]:
    """server's entry: its address, `token` (default its .sel_token) and its identity (None for
    a `--tls off` daemon: `tls = false`)."""
    return (server.address, token if token is not None else server.sel_token,  # type: ignore[attr-defined]
            server.fingerprint)


def selection_env(server: GpupoolServer, config: Path,
                  extra: dict[str, str] | None = None) -> dict[str, str]:
    """A client environment (our libcuda.so.1, the sanitizer runtime when needed) whose servers,
    tokens and pins come from the configuration file only (and from `extra`)."""
    env = server.client_env()
    for key in [k for k in env if k.startswith("GPUPOOL_")]:
        env.pop(key)
    env["GPUPOOL_CONFIG"] = str(config)
    env.update(extra or {})
    return env


def token_names(server: GpupoolServer) -> list[str]:
    return [lease["token_name"] for lease in ended_leases(server)]


def expect_leases(server: GpupoolServer, names: list[str]) -> None:
    """The ended leases of server are by these token names (their records may come a moment
    after the client exits)."""
    try:
        wait_until(f"ended leases {names}", lambda: token_names(server) == names, timeout=10)
    except AssertionError:
        assert token_names(server) == names


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin(server: GpupoolServer) -> dict[str, str]:
    """GPUPOOL_TLS_FINGERPRINT: server's identity as the pin of every server without one of its
    own (the short form `servers = [...]` has no per-server keys)."""
    assert server.fingerprint is not None
    return {"GPUPOOL_TLS_FINGERPRINT": server.fingerprint}


def gpupool_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("gpupool: ")]


def test_busy_first_server_sends_the_program_to_the_second(
        start_daemon: Any, native_build: Path, hold_gpu: Path, tmp_path: Path) -> None:  # noqa: F811
    a, b = two_daemons(start_daemon, native_build)
    config = write_config(tmp_path / "config.toml", [pinned(a), pinned(b)])
    holder = start_client(a, hold_gpu, MIB, 60_000, seed=1)  # a's own test token
    try:
        wait_until("a's GPU is taken",
                   lambda: a.get_json("/api/v1/leases?state=active")["leases"])
        proc = run_client([hold_gpu, MIB, 0, 2], env=selection_env(a, config,
                                                                    {"GPUPOOL_LOG": "debug"}))
        assert proc.returncode == 0, proc.stderr
        assert facts(proc.stdout)["exact"] == "1", proc.stdout
        # It ran on b, with b's token; a saw only its probe.
        expect_leases(b, ["selection-b"])
        assert len(a.get_json("/api/v1/leases?state=active")["leases"]) == 1
        log = proc.stderr
        assert re.search(rf"probe {re.escape(a.address)} .*: 1 GPUs, 1 matching .*, 0 free, "
                         r"queue 0", log), log
        assert re.search(rf"probe {re.escape(b.address)} .*: 1 GPUs, 1 matching .*, 1 free", log), log
        assert f"chose server {b.address} (a matching GPU is free" in log, log
        assert "skipped" not in log, log
    finally:
        holder.kill()
        holder.communicate()
    assert "selection-a" not in token_names(a)


def test_both_free_the_first_in_list_order_wins(start_daemon: Any, native_build: Path,
                                                hold_gpu: Path, tmp_path: Path) -> None:  # noqa: F811
    a, b = two_daemons(start_daemon, native_build)
    config = write_config(tmp_path / "ab.toml", [pinned(a), pinned(b)])
    proc = run_client([hold_gpu, MIB, 0, 3], env=selection_env(a, config))
    assert proc.returncode == 0, proc.stderr
    assert gpupool_lines(proc.stderr) == [], proc.stderr  # a good choice says nothing
    expect_leases(a, ["selection-a"])
    expect_leases(b, [])

    config = write_config(tmp_path / "ba.toml", [pinned(b), pinned(a)])
    proc = run_client([hold_gpu, MIB, 0, 4], env=selection_env(a, config))
    assert proc.returncode == 0, proc.stderr
    expect_leases(b, ["selection-b"])
    expect_leases(a, ["selection-a"])


def test_server_down_is_skipped_with_one_warning(start_daemon: Any, native_build: Path,
                                                 hold_gpu: Path, tmp_path: Path) -> None:  # noqa: F811
    a, b = two_daemons(start_daemon, native_build)
    down = f"127.0.0.1:{free_port()}"
    # Pinned (as after a login) but down: nothing listens there.
    config = write_config(tmp_path / "config.toml",
                          [(down, a.sel_token, a.fingerprint), pinned(b)])  # type: ignore[attr-defined]
    proc = run_client([hold_gpu, MIB, 0, 5], env=selection_env(b, config))
    assert proc.returncode == 0, proc.stderr
    assert gpupool_lines(proc.stderr) == [f"gpupool: server {down} skipped: connection refused"]
    expect_leases(b, ["selection-b"])

    # A real daemon that stopped: the same.
    a.stop()
    config = write_config(tmp_path / "stopped.toml", [pinned(a), pinned(b)])
    proc = run_client([hold_gpu, MIB, 0, 6], env=selection_env(b, config))
    assert proc.returncode == 0, proc.stderr
    assert gpupool_lines(proc.stderr) == [f"gpupool: server {a.address} skipped: "
                                          "connection refused"]
    expect_leases(b, ["selection-b"] * 2)

    # Both down: one error line naming each server and why; cuInit fails.
    b.stop()
    proc = run_client([hold_gpu, MIB, 0, 7], env=selection_env(b, config))
    assert proc.returncode != 0
    errors = [x for x in gpupool_lines(proc.stderr) if not x.startswith("gpupool: server ")]
    assert len(errors) == 1, proc.stderr
    assert (f"cannot use any gpupool server ({a.address}: connection refused; {b.address}: "
            "connection refused)") in errors[0], proc.stderr


def test_tokens_are_per_server(start_daemon: Any, native_build: Path, hold_gpu: Path,  # noqa: F811
                               tmp_path: Path) -> None:
    """Each daemon knows only its own token: the file's per-server tokens reach the right one,
    and a server that refuses its token is skipped with the reason."""
    a, b = two_daemons(start_daemon, native_build)
    # b's token for a: a refuses it in the probe.
    config = write_config(tmp_path / "config.toml",
                          [pinned(a, b.sel_token), pinned(b)])  # type: ignore[attr-defined]
    proc = run_client([hold_gpu, MIB, 0, 8], env=selection_env(a, config))
    assert proc.returncode == 0, proc.stderr
    lines = gpupool_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"gpupool: server {a.address} skipped: "), \
        proc.stderr
    assert "token" in lines[0], lines[0]
    expect_leases(b, ["selection-b"])
    expect_leases(a, [])

    # GPUPOOL_TOKEN overrides every server's token: a's token is then wrong for b.
    config = write_config(tmp_path / "config2.toml", [pinned(b), pinned(a)])
    proc = run_client([hold_gpu, MIB, 0, 9],
                      env=selection_env(a, config, {"GPUPOOL_TOKEN": a.sel_token}))  # type: ignore[attr-defined]
    assert proc.returncode == 0, proc.stderr
    expect_leases(a, ["selection-a"])
    expect_leases(b, ["selection-b"])
    assert [x for x in gpupool_lines(proc.stderr) if f"server {b.address} skipped" in x], \
        proc.stderr

    # GPUPOOL_SERVER picks one entry of the file: it keeps that entry's token (and pin).
    proc = run_client([hold_gpu, MIB, 0, 10],
                      env=selection_env(a, config, {"GPUPOOL_SERVER": b.address}))
    assert proc.returncode == 0, proc.stderr
    assert gpupool_lines(proc.stderr) == [], proc.stderr
    expect_leases(b, ["selection-b"] * 2)


LEASE_PROBE = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
lib.gpupool_shim_version.restype = ctypes.c_char_p
lib.gpupool_shim_lease.argtypes = [ctypes.c_char_p, ctypes.c_size_t] * 3 + [ctypes.c_void_p] * 2
def lease(cap=300):
    server, uuid, name = (ctypes.create_string_buffer(cap) for _ in range(3))
    session, simulated = ctypes.c_ulonglong(7), ctypes.c_int(7)
    if lib.gpupool_shim_lease(server, cap, uuid, cap, name, cap, ctypes.byref(session),
                              ctypes.byref(simulated)) != 1:
        assert (session.value, simulated.value, server.value) == (7, 7, b"")  # nothing written
        return {"connected": False}
    return {"connected": True, "server": server.value.decode(), "uuid": uuid.value.decode(),
            "name": name.value.decode(), "session_id": session.value,
            "simulated": simulated.value == 1}
before = lease()
rc = lib.cuInit(0)
after = lease()
small = lease(8)  # like snprintf: cut to fit, NUL-terminated
assert small["uuid"] == after["uuid"][:7] and small["server"] == after["server"][:7], small
print(json.dumps({"version": lib.gpupool_shim_version().decode(), "before": before,
                  "cuInit": rc, "after": after}))
"""


def test_shim_exports_version_and_lease(start_daemon: Any, native_build: Path,
                                        tmp_path: Path) -> None:
    a, b = two_daemons(start_daemon, native_build)
    config = write_config(tmp_path / "config.toml", [pinned(a), pinned(b)])
    shim = native_build / "client" / "libcuda.so.1"
    proc = run_client([sys.executable, "-c", LEASE_PROBE, shim], env=selection_env(a, config))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    version = re.search(r'__version__ = "(.*)"',
                        (REPO / "client" / "gpupool" / "__init__.py").read_text())
    assert version and out["version"] == version.group(1)
    assert out["before"] == {"connected": False}
    assert out["cuInit"] == 0
    (lease,) = wait_until("a's lease", lambda: ended_leases(a) or a.get_json(
        "/api/v1/leases?state=active")["leases"])
    (gpu,) = a.get_json("/api/v1/gpus")["gpus"]
    assert out["after"] == {"connected": True, "server": a.address, "uuid": gpu["uuid"],
                            "name": gpu["name"], "session_id": lease["id"], "simulated": True}


def test_no_server_configured_says_how_to_configure(native_build: Path, hold_gpu: Path,  # noqa: F811
                                                    tmp_path: Path,
                                                    gpupool_server: GpupoolServer) -> None:
    config = tmp_path / "config.toml"
    config.write_text('token = "gpt_x"\n')
    config.chmod(0o600)
    proc = run_client([hold_gpu, MIB, 0, 1], env=selection_env(gpupool_server, config))
    assert proc.returncode != 0
    lines = gpupool_lines(proc.stderr)
    assert len(lines) == 1 and f"GPUPOOL_SERVER is not set and {config} names no server" \
        in lines[0], proc.stderr

    config.write_text('token = "gpt_x"\n[servers]\n')
    proc = run_client([hold_gpu, MIB, 0, 1], env=selection_env(gpupool_server, config))
    assert proc.returncode != 0
    assert gpupool_lines(proc.stderr) == [
        f"gpupool: {config}:2: [servers] is not supported: write [[servers]] before each "
        "server's address = \"...\" (or servers = [\"a:7070\", \"b:7070\"] at the top)"], \
        proc.stderr


@pytest.mark.parametrize("short_form", [False, True])
def test_environment_server_list_still_works(gpupool_server: GpupoolServer, hold_gpu: Path,  # noqa: F811
                                             tmp_path: Path, short_form: bool) -> None:
    """GPUPOOL_SERVER + GPUPOOL_TOKEN (as `gpupool run` and the tests set them) replace the
    file's list and token; with the short form the file's list is used. The short form has no
    per-server keys: the pin comes from GPUPOOL_TLS_FINGERPRINT either way."""
    server = gpupool_server
    config = tmp_path / "config.toml"
    if short_form:
        config.write_text(f'servers = ["{server.address}"]\ntoken = "{server.token}"\n')
        env = selection_env(server, config, pin(server))
    else:
        config.write_text('servers = ["127.0.0.1:1"]\ntoken = "wrong"\n')
        env = selection_env(server, config, {"GPUPOOL_SERVER": server.address,
                                             "GPUPOOL_TOKEN": server.token, **pin(server)})
    config.chmod(0o600)
    proc = run_client([hold_gpu, MIB, 0, 1], env=env)
    assert proc.returncode == 0, proc.stderr
    assert gpupool_lines(proc.stderr) == [], proc.stderr


# What a client says of a server that accepts the connection and then never answers: in plain
# TCP its probe gets no answer; over TLS (a pinned entry) its handshake does not.
SILENT = {False: "timed out after {} s",
          True: "TLS handshake: no answer (does the server speak TLS on this port?)"}


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_probe_of_a_silent_server_times_out(start_daemon: Any, native_build: Path,
                                            hold_gpu: Path, tmp_path: Path,  # noqa: F811
                                            tls: bool) -> None:
    """A server that accepts but never answers costs probe_timeout, then it is skipped: its
    entry in plain TCP (`tls = false`) or pinned (TLS, the default)."""
    b = start_daemon(build_dir=native_build)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = "127.0.0.1:%d" % silent.getsockname()[1]
        config = write_config(tmp_path / "config.toml",
                              [(address, b.token, b.fingerprint if tls else None),
                               pinned(b, b.token)], top="probe_timeout = 0.5\n")
        started = time.monotonic()
        proc = run_client([hold_gpu, MIB, 0, 1], env=selection_env(b, config), timeout=30)
        elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    assert gpupool_lines(proc.stderr) == [f"gpupool: server {address} skipped: "
                                          + SILENT[tls].format("0.5")], proc.stderr
    assert 0.5 <= elapsed < 15, elapsed


def test_bad_requirement_from_the_file_refuses_before_connecting(
        gpupool_server: GpupoolServer, hold_gpu: Path, tmp_path: Path) -> None:  # noqa: F811
    config = tmp_path / "config.toml"
    config.write_text(f'servers = ["{gpupool_server.address}"]\n[requirements]\n'
                      'min_memory = "lots"\n')
    proc = run_client([hold_gpu, MIB, 0, 1], env=selection_env(gpupool_server, config))
    assert proc.returncode != 0
    assert gpupool_lines(proc.stderr) == [
        f'gpupool: {config}:3: min_memory = "lots" is not a size: write bytes or a number with '
        "a unit, e.g. 40G or 40GB (40*10^9 bytes), 40GiB (40*2^30), 512M, 17179869184"], \
        proc.stderr
    assert ended_leases(gpupool_server) == []


def test_tls_settings_are_per_server(start_daemon: Any, native_build: Path, hold_gpu: Path,  # noqa: F811
                                     pki: Pki, tmp_path: Path) -> None:  # noqa: F811
    """A mutual-TLS daemon and a plain one in one file: the TLS files of the first entry
    (relative to the file's folder) are used for its probe and its session, and not for the
    second; without its client certificate the first is skipped with the TLS reason."""
    secure = tls_daemon(start_daemon, native_build, pki, tmp_path, client_ca=True)
    secure_token = secure.create_token("selection-tls")
    # The plain one says so on both ends: `--tls off`, and `tls = false` in its entry.
    plain = start_daemon(build_dir=native_build, tls=False)
    plain_token = plain.create_token("selection-plain")
    folder = tmp_path / "client"
    (folder / "pki").mkdir(parents=True)
    for f in (pki.ca, pki.client_cert, pki.client_key):
        shutil.copy(f, folder / "pki" / f.name)

    def config(with_cert: bool) -> Path:
        cert = ('tls_cert = "pki/client.pem"\ntls_key = "pki/client.key"\n' if with_cert
                else "")
        path = folder / "config.toml"
        path.write_text(f'[[servers]]\naddress = "tls://localhost:{secure.port}"\n'
                        f'token = "{secure_token}"\ntls_ca = "pki/ca.pem"\n{cert}\n'
                        f'[[servers]]\naddress = "{plain.address}"\ntoken = "{plain_token}"\n'
                        'tls = false\n')
        path.chmod(0o600)
        return path

    proc = run_client([hold_gpu, MIB, 0, 11], env=selection_env(plain, config(True)))
    assert proc.returncode == 0 and facts(proc.stdout)["exact"] == "1", proc.stderr
    assert gpupool_lines(proc.stderr) == [], proc.stderr
    expect_leases(secure, ["selection-tls"])
    expect_leases(plain, [])

    proc = run_client([hold_gpu, MIB, 0, 12], env=selection_env(plain, config(False)))
    assert proc.returncode == 0, proc.stderr
    lines = gpupool_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"gpupool: server localhost:{secure.port} skipped: TLS"), lines
    assert "client certificate" in lines[0], lines
    expect_leases(plain, ["selection-plain"])


# ------------------------------------------------------------------ probe limits, old servers
class FakeServer:
    """A TCP server on 127.0.0.1 whose connections `handle(conn)` serves, each in a thread;
    `firsts` holds the op of each connection's first frame. It speaks the plaintext protocol (no
    TLS): its entries in a client's file say `tls = false`."""

    def __init__(self, handle: Any) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.handle = handle
        self.firsts: list[int] = []
        self.stopping = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self.handle(self, conn)
            except OSError:
                pass

    def close(self) -> None:
        self.stopping.set()
        self.sock.close()


def first_frame(server: FakeServer, conn: socket.socket) -> tuple[bytes, int, int]:
    header = read_exactly(conn, 16)
    length, op, _, _ = HEADER.unpack(header)
    server.firsts.append(op)
    return header, length, op


def old_front(backend: GpupoolServer) -> Any:
    """A gpupoold of protocol 1.0 (plain TCP, older than TLS by default) in front of a real
    `--tls off` daemon: a first frame other than hello gets 1.0's notice ("the first frame must
    be hello") and the connection closes; a hello and all that follows are relayed to the
    daemon."""
    host, port = backend.address.rsplit(":", 1)

    def handle(server: FakeServer, conn: socket.socket) -> None:
        header, length, op = first_frame(server, conn)
        if op != gp.Hello.OP:
            read_exactly(conn, length)
            text = b"the first frame must be hello"
            body = struct.pack("<iHI", gp.GP_EPROTO, 0, len(text)) + text
            conn.sendall(HEADER.pack(len(body), gp.Notice.OP, 0, 0) + body)
            return
        with socket.create_connection((host, int(port))) as up:
            up.sendall(header)

            def pump(src: socket.socket, dst: socket.socket) -> None:
                try:
                    while data := src.recv(65536):
                        dst.sendall(data)
                except OSError:
                    pass
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

            back = threading.Thread(target=pump, args=(up, conn), daemon=True)
            back.start()
            pump(conn, up)
            back.join(30)

    return handle


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_probe_timeout_zero_means_two_seconds(start_daemon: Any, native_build: Path,
                                              hold_gpu: Path, tmp_path: Path,  # noqa: F811
                                              tls: bool) -> None:
    """probe_timeout = 0 is the probes' default (2 s), never "wait forever" (the silent server's
    entry in plain TCP, `tls = false`, or pinned)."""
    b = start_daemon(build_dir=native_build)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = "127.0.0.1:%d" % silent.getsockname()[1]
        config = write_config(tmp_path / "config.toml",
                              [(address, b.token, b.fingerprint if tls else None),
                               pinned(b, b.token)], top="probe_timeout = 0\n")
        started = time.monotonic()
        proc = run_client([hold_gpu, MIB, 0, 1], env=selection_env(b, config), timeout=30)
        elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    assert gpupool_lines(proc.stderr) == [f"gpupool: server {address} skipped: "
                                          + SILENT[tls].format("2")], proc.stderr
    assert 2 <= elapsed < 15, elapsed


def test_probe_timeout_is_a_hard_limit(start_daemon: Any, native_build: Path,
                                       hold_gpu: Path, tmp_path: Path) -> None:  # noqa: F811
    """A server that answers one byte at a time (each well within the timeout) still costs no
    more than probe_timeout in all."""
    b = start_daemon(build_dir=native_build)

    def trickle(server: FakeServer, conn: socket.socket) -> None:
        first_frame(server, conn)
        body = b"\0" * 200
        frame = HEADER.pack(len(body), gp.Info.OP, gp.FLAG_REPLY, 1) + body
        for byte in frame:
            if server.stopping.wait(0.1):
                return
            conn.sendall(bytes([byte]))

    slow = FakeServer(trickle)
    try:
        config = write_config(tmp_path / "config.toml",
                              [(slow.address, b.token, None), pinned(b, b.token)],
                              top="probe_timeout = 0.5\n")
        started = time.monotonic()
        proc = run_client([hold_gpu, MIB, 0, 1], env=selection_env(b, config), timeout=60)
        elapsed = time.monotonic() - started
    finally:
        slow.close()
    assert proc.returncode == 0, proc.stderr
    assert gpupool_lines(proc.stderr) == [f"gpupool: server {slow.address} skipped: timed out "
                                          "after 0.5 s"], proc.stderr
    assert slow.firsts == [gp.Info.OP]
    assert elapsed < 12, elapsed  # byte by byte the frame alone takes 21 s


def test_an_oversized_answer_is_refused_unread(start_daemon: Any, native_build: Path,
                                               hold_gpu: Path, tmp_path: Path) -> None:  # noqa: F811
    b = start_daemon(build_dir=native_build)

    def huge(server: FakeServer, conn: socket.socket) -> None:
        first_frame(server, conn)
        conn.sendall(HEADER.pack(gp.MAX_BODY, gp.Info.OP, gp.FLAG_REPLY, 1))
        server.stopping.wait(10)

    big = FakeServer(huge)
    try:
        config = write_config(tmp_path / "config.toml",
                              [(big.address, "x", None), pinned(b, b.token)])
        proc = run_client([hold_gpu, MIB, 0, 1], env=selection_env(b, config), timeout=60)
    finally:
        big.close()
    assert proc.returncode == 0, proc.stderr
    limit = 32 << 20  # client/common/info_client.c: above the largest reply the spec allows
    assert gpupool_lines(proc.stderr) == [
        f"gpupool: server {big.address} skipped: its answer to info is a reply of "
        f"{gp.MAX_BODY} bytes, more than the {limit} it can be: it does not answer like a "
        "gpupool server; is the port right?"], proc.stderr


def test_servers_of_protocol_1_0_still_work(start_daemon: Any, native_build: Path,
                                            hold_gpu: Path, tmp_path: Path) -> None:  # noqa: F811
    """Every probe fails because the servers speak 1.0 (no info): the client says hello to them
    in list order, as without selection, and says so at debug level only. The relays speak
    plain TCP, and so do the daemons behind them (`--tls off`)."""
    a, b = two_daemons(start_daemon, native_build, tls=False)
    old_a, old_b = FakeServer(old_front(a)), FakeServer(old_front(b))
    down = f"127.0.0.1:{free_port()}"
    try:
        config = write_config(tmp_path / "config.toml", [(old_a.address, a.sel_token, None),  # type: ignore[attr-defined]
                                                         (old_b.address, b.sel_token, None)])  # type: ignore[attr-defined]
        proc = run_client([hold_gpu, MIB, 0, 1], env=selection_env(a, config))
        assert proc.returncode == 0, proc.stderr
        assert gpupool_lines(proc.stderr) == [], proc.stderr
        expect_leases(a, ["selection-a"])
        assert old_a.firsts == [gp.Info.OP, gp.Hello.OP] and old_b.firsts == [gp.Info.OP]

        # The same at debug level: why, and the choice.
        proc = run_client([hold_gpu, MIB, 0, 2], env=selection_env(a, config,
                                                                    {"GPUPOOL_LOG": "debug"}))
        assert proc.returncode == 0, proc.stderr
        assert "no server answered info and 2 speak protocol 1.0: trying them with hello in " \
               "list order" in proc.stderr, proc.stderr
        assert f"chose server {old_a.address} (protocol 1.0, first in list order; 2 " \
               "candidates)" in proc.stderr, proc.stderr
        assert not [x for x in gpupool_lines(proc.stderr) if "skipped" in x], proc.stderr

        # A server that is down among them: skipped with its warning; the 1.0 one is used.
        config = write_config(tmp_path / "down.toml", [(down, a.sel_token, None),  # type: ignore[attr-defined]
                                                       (old_b.address, b.sel_token, None)])  # type: ignore[attr-defined]
        proc = run_client([hold_gpu, MIB, 0, 3], env=selection_env(b, config))
        assert proc.returncode == 0, proc.stderr
        assert gpupool_lines(proc.stderr) == [f"gpupool: server {down} skipped: connection "
                                              "refused"], proc.stderr
        expect_leases(b, ["selection-b"])

        # With a server of this protocol that answers, the 1.0 one is skipped (it cannot say
        # whether it has a free GPU).
        config = write_config(tmp_path / "mixed.toml", [(old_a.address, a.sel_token, None),  # type: ignore[attr-defined]
                                                        pinned(b)])
        proc = run_client([hold_gpu, MIB, 0, 4], env=selection_env(b, config))
        assert proc.returncode == 0, proc.stderr
        lines = gpupool_lines(proc.stderr)  # b's GPU may still be winding down: a queue line
        assert [x for x in lines if "waiting for a GPU" not in x] == [
            f"gpupool: server {old_a.address} skipped: server speaks protocol 1.0; this client "
            f"needs {gp.MAJOR}.{gp.MINOR} for info: upgrade gpupoold"], proc.stderr
        expect_leases(b, ["selection-b"] * 2)
    finally:
        old_a.close()
        old_b.close()


@pytest.mark.parametrize(("setting", "said_ms"), [("0.5", 500), ("0", 0)])
def test_the_hello_says_the_connect_timeout(native_build: Path, hold_gpu: Path,  # noqa: F811
                                            setting: str, said_ms: int) -> None:
    """The shim's hello carries its connect timeout (protocol 1.5), so that a fleet holds a GPU
    for its redirect no longer (pool/fleet.py); 0: no limit. The stand-in refuses the hello."""
    said: list[int] = []

    def refuse(server: FakeServer, conn: socket.socket) -> None:
        header, length, op = first_frame(server, conn)
        body = read_exactly(conn, length)
        if op != gp.Hello.OP:  # the probe: answered as a 1.0 server would (no info)
            text = b"the first frame must be hello"
            notice = struct.pack("<iHI", gp.GP_EPROTO, 0, len(text)) + text
            conn.sendall(HEADER.pack(len(notice), gp.Notice.OP, 0, 0) + notice)
            return
        said.append(gp.Hello.decode(body).connect_timeout_ms)
        reply = gp.HelloReply(result=gp.GP_EREFUSED, major=gp.MAJOR, minor=gp.MINOR,
                              message="seen by the test")
        conn.sendall(gp.encode_frame(reply, HEADER.unpack(header)[3]))

    front = FakeServer(refuse)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
        env.update(LD_LIBRARY_PATH=str(native_build / "client"), GPUPOOL_CONFIG="none",
                   GPUPOOL_SERVER=front.address, GPUPOOL_TOKEN="t", GPUPOOL_TLS="0",
                   GPUPOOL_CONNECT_TIMEOUT=setting)
        proc = run_client([hold_gpu, MIB, 0, 1], env=env, timeout=60)
    finally:
        front.close()
    assert proc.returncode != 0 and "seen by the test" in proc.stderr, proc.stderr
    assert said == [said_ms], proc.stderr
