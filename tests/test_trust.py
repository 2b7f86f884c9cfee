"""What crosses the wire, seen by a raw packet capture on the loopback interface (root): a client
pinned to a daemon's identity (TLS, gpupoold's default) never shows its token or its data there;
an unpinned client and a client whose pin is wrong are refused before anything secret is sent;
a redirect to a listener the client never named gets no token unless the server the client
already trusts vouched for that listener's key. The same capture of a plain-TCP session (both
sides said so) shows the token and the data: the control that proves the capture could see them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gpupool_protocol as gp
import pytest
from conftest import REPO, GpupoolServer, daemon_env, require, run_client

from gpupoold.tls_identity import ensure_identity, fingerprint_of_pem

UPLOAD = REPO / "tests" / "clients" / "upload_pattern.py"
ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_STATISTICS = 6
SO_ATTACH_FILTER = 26
SO_RCVBUFFORCE = 33
WINDOW = 32  # bytes of the pattern looked for at every offset of the capture


def _attach_filter(sock: socket.socket, ports: set[int]) -> None:
    """A classic BPF program on `sock`: only IPv4 TCP segments (first fragments) from or to one
    of `ports` reach it."""
    code: list[tuple[int, int, int, int]] = [
        (0x28, 0, 0, 12),  # ldh [12]: the ethertype
        (0x15, 0, 0, 0x0800),  # jeq IPv4 (jf patched: drop)
        (0x30, 0, 0, 23),  # ldb [23]: the IP protocol
        (0x15, 0, 0, socket.IPPROTO_TCP),  # jeq TCP (jf: drop)
        (0x28, 0, 0, 20),  # ldh [20]: flags and fragment offset
        (0x45, 0, 0, 0x1FFF),  # jset: a later fragment (jt: drop)
        (0xB1, 0, 0, 14),  # ldxb 4*([14]&0xf): the IP header's length
    ]
    for port in sorted(ports):
        code += [(0x48, 0, 0, 14), (0x15, 0, 0, port),  # ldh [x+14]: source port; jeq (jt: keep)
                 (0x48, 0, 0, 16), (0x15, 0, 0, port)]  # ldh [x+16]: destination port
    drop, keep = len(code), len(code) + 1
    code += [(0x06, 0, 0, 0), (0x06, 0, 0, 1 << 18)]  # ret 0 (drop); ret 256 KiB (keep)

    def to(target: int, pc: int) -> int:
        return target - pc - 1

    patched = []
    for pc, (op, jt, jf, k) in enumerate(code):
        if pc in (1, 3):
            jf = to(drop, pc)
        elif pc == 5:
            jt = to(drop, pc)
        elif op == 0x15 and pc > 6:
            jt = to(keep, pc)
            jf = to(drop, pc) if pc == drop - 1 else 0
        patched.append(struct.pack("HBBI", op, jt, jf, k))
    program = ctypes.create_string_buffer(b"".join(patched))
    fprog = struct.pack("HL", len(patched), ctypes.addressof(program))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


class Capture:
    """Every TCP payload byte to or from `ports` on the loopback interface, from an AF_PACKET
    socket read on a thread. Fails (in .stop) when the kernel dropped a packet: a capture that
    lost bytes proves nothing."""

    def __init__(self, ports: set[int]) -> None:
        self.ports = ports
        # Protocol 0 receives nothing until bound: the kernel filter is in place before the
        # first packet, so other tests' loopback traffic never fills the buffer.
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
        _attach_filter(self.sock, ports)
        self.sock.bind(("lo", ETH_P_ALL))
        self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8)  # read (and reset) the counters
        self.sock.settimeout(0.1)
        self.to_server = bytearray()  # payload towards one of `ports`
        self.from_server = bytearray()
        self.packets = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self.sock.recv(1 << 17)
            except TimeoutError:
                continue
            except OSError:
                return
            self._take(frame)

    def _take(self, frame: bytes) -> None:
        if len(frame) < 34 or frame[12:14] != b"\x08\x00":  # Ethernet header, then IPv4
            return
        ip = frame[14:]
        ihl = (ip[0] & 0xF) * 4
        total = struct.unpack_from("!H", ip, 2)[0]
        if ip[9] != socket.IPPROTO_TCP or len(ip) < ihl + 20:
            return
        sport, dport = struct.unpack_from("!HH", ip, ihl)
        offset = (ip[ihl + 12] >> 4) * 4
        payload = ip[ihl + offset:total]
        if dport in self.ports:
            self.to_server += payload
            self.packets += 1
        elif sport in self.ports:
            self.from_server += payload
            self.packets += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        stats = self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8)
        self.sock.close()
        _, drops = struct.unpack("II", stats)
        assert drops == 0, f"the capture dropped {drops} packets: it proves nothing"

    @property
    def everything(self) -> bytes:
        return bytes(self.to_server + self.from_server)


@contextlib.contextmanager
def capture(*ports: int) -> Iterator[Capture]:
    require(os.geteuid() == 0, "a raw packet capture needs root")
    cap = Capture(set(ports))
    try:
        yield cap
    finally:
        time.sleep(0.2)  # the last packets of the session reach the socket
        cap.stop()


def pattern_seen(pattern: bytes, wire: bytes) -> bool:
    """Whether any WINDOW-byte piece of `pattern` (at a multiple of WINDOW) is in `wire`: a
    64 KiB upload split into TCP segments shows whole pieces inside the segments."""
    pieces = {pattern[i:i + WINDOW] for i in range(0, len(pattern) - WINDOW + 1, WINDOW)}
    return any(wire[i:i + WINDOW] in pieces for i in range(len(wire) - WINDOW + 1))


@pytest.fixture
def pattern(tmp_path: Path) -> tuple[bytes, Path]:
    data = os.urandom(64 << 10)
    path = tmp_path / "pattern.bin"
    path.write_bytes(data)
    return data, path


def upload(env: dict[str, str], path: Path) -> subprocess.CompletedProcess[str]:
    return run_client([sys.executable, str(UPLOAD), str(path)], env=env, timeout=60)


def other_identity(tmp_path: Path) -> str:
    """The fingerprint of a key that no server here presents."""
    return ensure_identity(tmp_path / "someone-else").fingerprint


# --------------------------------------------------------------------------- direct sessions
def test_a_pinned_session_keeps_the_token_and_the_data_off_the_wire(
        gpupool_server: GpupoolServer, pattern: tuple[bytes, Path]) -> None:
    data, path = pattern
    env = gpupool_server.client_env()
    assert env["GPUPOOL_TLS_FINGERPRINT"] == gpupool_server.fingerprint
    with capture(gpupool_server.port) as cap:
        proc = upload(env, path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"ok {len(data)}"
    # The session went over this port (both TLS sessions: the daemon's, then the worker's).
    assert len(cap.to_server) > len(data) and len(cap.from_server) > len(data)
    assert cap.to_server[:1] == b"\x16"  # a TLS handshake record first
    wire = cap.everything
    assert gpupool_server.token.encode() not in wire
    assert not pattern_seen(data, wire)


def test_the_same_session_in_plain_tcp_shows_both_on_the_wire(
        plain_server: GpupoolServer, pattern: tuple[bytes, Path]) -> None:
    """The control: with `tls = "off"` on both sides the capture sees the token and the data."""
    data, path = pattern
    env = plain_server.client_env()
    assert env["GPUPOOL_TLS"] == "0"
    with capture(plain_server.port) as cap:
        proc = upload(env, path)
    assert proc.returncode == 0, proc.stderr
    wire = cap.everything
    assert plain_server.token.encode() in wire
    assert pattern_seen(data, wire)


def test_a_client_without_a_pin_sends_nothing_and_names_the_fix(
        gpupool_server: GpupoolServer, pattern: tuple[bytes, Path]) -> None:
    data, path = pattern
    env = gpupool_server.client_env()
    del env["GPUPOOL_TLS_FINGERPRINT"]
    with capture(gpupool_server.port) as cap:
        proc = upload(env, path)
    assert proc.returncode != 0
    assert f"gpupool login {gpupool_server.address}" in proc.stderr, proc.stderr
    assert "nothing was sent" in proc.stderr
    assert not cap.to_server  # not even a TLS ClientHello: refused before connecting
    assert gpupool_server.token.encode() not in cap.everything


def test_a_wrong_pin_is_refused_before_anything_secret_is_sent(
        gpupool_server: GpupoolServer, pattern: tuple[bytes, Path], tmp_path: Path) -> None:
    data, path = pattern
    wrong = other_identity(tmp_path)
    env = gpupool_server.client_env({"GPUPOOL_TLS_FINGERPRINT": wrong})
    with capture(gpupool_server.port) as cap:
        proc = upload(env, path)
    assert proc.returncode != 0
    assert "IDENTITY" in proc.stderr.upper() and "CHANGED" in proc.stderr.upper(), proc.stderr
    assert gpupool_server.fingerprint in proc.stderr and wrong in proc.stderr
    assert cap.to_server  # it did connect and shake hands: the key was seen, then refused
    wire = cap.everything
    assert gpupool_server.token.encode() not in wire
    assert not pattern_seen(data, wire)
    # gpupoold saw a handshake and then nothing: no lease was started.
    assert gpupool_server.get_json("/api/v1/leases?state=all")["leases"] == []


# ------------------------------------------------------------------------------- redirects
class _Server:
    """A listener on `host` that serves each connection on a thread (`_handle`), inside TLS with
    its own key (`tls_dir`: an identity made there) or in plain TCP."""

    def __init__(self, host: str, tls_dir: Path | None) -> None:
        self.ctx: ssl.SSLContext | None = None
        self.fingerprint = ""
        if tls_dir is not None:
            ident = ensure_identity(tls_dir)
            self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.ctx.load_cert_chain(ident.cert_path, ident.key_path)
            self.ctx.num_tickets = 0
            self.fingerprint = ident.fingerprint
        self.sock = socket.create_server((host, 0))
        self.sock.settimeout(0.1)
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with contextlib.suppress(OSError, ssl.SSLError, EOFError, gp.ProtocolError):
                conn.settimeout(5)
                self._accepted()
                if self.ctx is not None:
                    conn = self.ctx.wrap_socket(conn, server_side=True)
                self._handle(conn)
            conn.close()

    def _accepted(self) -> None:
        """A TCP connection arrived (before any TLS handshake)."""

    def _handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close()


class Listener(_Server):
    """A listener on 127.0.0.2 (an address no client here names) that records every connection
    and every byte of application data it receives."""

    def __init__(self, tls_dir: Path | None) -> None:
        self.connections = 0
        self.received = bytearray()
        super().__init__("127.0.0.2", tls_dir)

    def _accepted(self) -> None:
        self.connections += 1

    def _handle(self, conn: socket.socket) -> None:
        while chunk := conn.recv(65536):
            self.received += chunk


class StandIn(_Server):
    """A stand-in gpupool server on 127.0.0.1 that answers every hello with GP_EREDIRECT to
    `target` (with `target_fingerprint` as the pin it vouches for)."""

    def __init__(self, tls_dir: Path | None, target: str, target_fingerprint: str) -> None:
        self.reply = gp.HelloReply(result=gp.GP_EREDIRECT, major=gp.MAJOR, minor=gp.MINOR,
                                   message=f"a GPU is held for this client at {target}",
                                   server="stand-in", redirect=target,
                                   redirect_fingerprint=target_fingerprint)
        self.hellos = 0
        super().__init__("127.0.0.1", tls_dir)

    def _handle(self, conn: socket.socket) -> None:
        from gpupool.wire import read_frame, send_message

        frame = read_frame(conn)
        if frame.op == gp.Hello.OP:
            self.hellos += 1
            send_message(conn, self.reply, frame.req)


TOKEN = "gpt_0123456789ab_redirect-test-secret-token"


def redirected_client(standin: StandIn, path: Path, build: Path, plain: bool = False
                      ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env.update(LD_LIBRARY_PATH=str(build / "client"), GPUPOOL_SERVER=standin.address,
               GPUPOOL_CONFIG="none", GPUPOOL_TOKEN=TOKEN, GPUPOOL_CONNECT_TIMEOUT="5")
    if plain:
        env["GPUPOOL_TLS"] = "0"
    else:
        env["GPUPOOL_TLS_FINGERPRINT"] = standin.fingerprint
    return upload(env, path)


@pytest.fixture
def listeners() -> Iterator[list[_Server]]:
    made: list[_Server] = []
    yield made
    for x in made:
        x.close()


@pytest.mark.parametrize("vouched", ["none", "another key"])
def test_a_redirect_without_the_targets_true_pin_gets_no_token(
        native_build: Path, tmp_path: Path, pattern: tuple[bytes, Path], vouched: str,
        listeners: list[_Server]) -> None:
    """The client trusts the stand-in (pinned); the stand-in sends it to a listener it never
    named, vouching for no key or for a key that listener does not have: not followed (no
    connection at all), or followed only as far as the TLS handshake, where the key is refused
    before the hello."""
    listener = Listener(tmp_path / "listener")
    listeners.append(listener)
    fp = "" if vouched == "none" else other_identity(tmp_path)
    standin = StandIn(tmp_path / "standin", listener.address, fp)
    listeners.append(standin)
    proc = redirected_client(standin, pattern[1], native_build)
    assert proc.returncode != 0
    assert standin.hellos >= 1  # the stand-in got the (pinned, encrypted) hello and redirected
    time.sleep(0.3)
    assert TOKEN.encode() not in listener.received and not listener.received
    assert listener.address in proc.stderr, proc.stderr
    if vouched == "none":
        assert listener.connections == 0
        assert "not followed, nothing was sent there" in proc.stderr
    else:
        assert "CHANGED" in proc.stderr.upper() and listener.fingerprint in proc.stderr


def test_a_redirect_over_plain_tcp_goes_only_to_a_configured_server(
        native_build: Path, tmp_path: Path, pattern: tuple[bytes, Path],
        listeners: list[_Server]) -> None:
    """A plain-TCP server (anyone on the path could have answered) sends the client to an
    address of its choosing: not followed, no connection made there."""
    listener = Listener(None)
    listeners.append(listener)
    standin = StandIn(None, listener.address, "")
    listeners.append(standin)
    proc = redirected_client(standin, pattern[1], native_build, plain=True)
    assert proc.returncode != 0
    assert standin.hellos >= 1
    time.sleep(0.3)
    assert listener.connections == 0 and not listener.received
    assert "not one of its configured servers" in proc.stderr, proc.stderr


def test_the_control_a_vouched_listener_does_receive_the_hello(
        native_build: Path, tmp_path: Path, pattern: tuple[bytes, Path],
        listeners: list[_Server]) -> None:
    """The control for the two tests above: when the trusted server vouches for the listener's
    true key (what a fleet's server does for another member, from the servers table), the
    client follows and the listener receives the hello, token included, inside TLS. So the
    listener above could have received a token, had the client sent one."""
    listener = Listener(tmp_path / "listener")
    listeners.append(listener)
    standin = StandIn(tmp_path / "standin", listener.address, listener.fingerprint)
    listeners.append(standin)
    proc = redirected_client(standin, pattern[1], native_build)
    assert proc.returncode != 0  # the listener never answers the hello
    deadline = time.monotonic() + 10
    while TOKEN.encode() not in listener.received and time.monotonic() < deadline:
        time.sleep(0.1)
    assert TOKEN.encode() in listener.received


# ------------------------------------------------------------------ the HTTP listener off loopback
def test_the_http_listener_off_loopback_speaks_https_that_the_exported_certificate_verifies(
        start_daemon: Any, native_build: Path, tmp_path: Path) -> None:
    """`http` on every address: HTTPS with the server's own identity; what `gpupoold fingerprint
    --pem` exports is the CA a scraper (Prometheus' tls_config ca_file) needs, with the host
    name checked, and its key is the fingerprint clients pin."""
    server = start_daemon("--http", "0.0.0.0:0", build_dir=native_build)
    server.wait_for_log(r"the HTTP listener speaks HTTPS \(this server's identity")
    port = int(server.http_url.rpartition(":")[2])
    pem = subprocess.run([sys.executable, "-m", "gpupoold", "fingerprint", "--pem",
                          "--state-dir", str(server.state_dir)], capture_output=True, text=True,
                         env=daemon_env(), cwd=REPO, timeout=60)
    assert pem.returncode == 0 and pem.stdout.startswith("-----BEGIN CERTIFICATE-----"), pem
    assert fingerprint_of_pem(pem.stdout.encode()) == server.fingerprint
    ca = tmp_path / "exported.crt"
    ca.write_text(pem.stdout)
    ctx = ssl.create_default_context(cafile=str(ca))  # names and chain checked, as a scraper does
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=socket.gethostname()) as tls:
        tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := tls.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200") and b'"ok": true' in reply
    # A certificate that is not the exported one is refused by the same check.
    other = ssl.create_default_context(cafile=str(ensure_identity(tmp_path / "x").cert_path))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            pytest.raises(ssl.SSLCertVerificationError):
        other.wrap_socket(raw, server_hostname=socket.gethostname())
