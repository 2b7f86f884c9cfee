"""TLS on the remoting port (docs/protocol.md, "TLS"): a real gpupoold with `tls_cert`/`tls_key`
and real clients through the shim (tests/clients/hold_gpu.c), over a relay that records every
byte on the wire. The daemon runs the first TLS session (hello, queue), hands the plain socket to
the worker after GP_INFO_HANDOFF, and the worker runs the second one (worker/tls.c).
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import ssl
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gpupool_protocol as gp
import pytest
import trustme
from conftest import GpupoolServer, run_client
from gpupool.wire.frames import read_frame
from test_e2e_leases import ended_leases, facts, gpu_states, hold_gpu, start_client, wait_until  # noqa: F401  (hold_gpu is a fixture)

from gpupoold.remoting.tls_session import TlsStream, looks_like_tls
from gpupoold.tls import server_context
from gpupoold.workers.supervisor import WorkerSupervisor, WorkerTls

MIB = 1 << 20


# ----------------------------------------------------------------------------- certificates
class Pki:
    def __init__(self, root: Path) -> None:
        ca = trustme.CA()
        self.ca = root / "ca.pem"
        ca.cert_pem.write_to_path(str(self.ca))
        server = ca.issue_cert("localhost", "127.0.0.1")
        self.cert = root / "server.pem"
        self.key = root / "server.key"
        server.private_key_pem.write_to_path(str(self.key))
        server.cert_chain_pems[0].write_to_path(str(self.cert))
        for extra in server.cert_chain_pems[1:]:
            extra.write_to_path(str(self.cert), append=True)
        other = trustme.CA()
        self.other_ca = root / "other-ca.pem"
        other.cert_pem.write_to_path(str(self.other_ca))
        client_ca = trustme.CA()
        self.client_ca = root / "client-ca.pem"
        client_ca.cert_pem.write_to_path(str(self.client_ca))
        client = client_ca.issue_cert("tenant@example.org")
        self.client_cert = root / "client.pem"
        self.client_key = root / "client.key"
        client.cert_chain_pems[0].write_to_path(str(self.client_cert))
        client.private_key_pem.write_to_path(str(self.client_key))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def tls_daemon(start_daemon: Callable[..., GpupoolServer], native_build: Path, pki: Pki,
               tmp_path: Path, client_ca: bool = False) -> GpupoolServer:
    config = tmp_path / "gpupoold.toml"
    lines = [f'tls_cert = "{pki.cert}"', f'tls_key = "{pki.key}"']
    if client_ca:
        lines.append(f'tls_client_ca = "{pki.client_ca}"')
    config.write_text("\n".join(lines) + "\n")
    return start_daemon("--config", str(config), build_dir=native_build)


# ------------------------------------------------------------------------- a recording relay
class Relay:
    """127.0.0.1:port -> target, one connection at a time, keeping every byte both ways."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.wire = bytearray()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    self.wire += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (Linux)
        except OSError:
            pass
        self._accept.join(timeout=10)
        self.listener.close()
        for t in self._threads:
            t.join(timeout=10)
        for s in self._sockets:
            s.close()


@pytest.fixture
def relay_factory() -> Iterator[Callable[[GpupoolServer], Relay]]:
    relays: list[Relay] = []

    def make(server: GpupoolServer) -> Relay:
        relay = Relay((server.host, server.port))
        relays.append(relay)
        return relay

    yield make
    for r in relays:
        r.close()


def pattern(seed: int, start: int, n: int) -> bytes:
    """hold_gpu's pattern_byte(seed, i) for i in [start, start + n)."""
    out = bytearray()
    m = (1 << 64) - 1
    for i in range(start, start + n):
        x = (seed * 0x9E3779B97F4A7C15 + i) & m
        x ^= x >> 29
        x = (x * 0xBF58476D1CE4E5B9) & m
        x ^= x >> 32
        out.append((x | 1) & 0xFF)
    return bytes(out)


def run_hold(server: GpupoolServer, hold_gpu: Path, env: dict[str, str], nbytes: int = MIB,  # noqa: F811
             seed: int = 7) -> Any:
    """hold_gpu as a client of server with `env` on top of client_env(); a client given a CA
    (GPUPOOL_TLS_CA) trusts the server by that CA alone (no pin), as for an operator's own
    certificate."""
    full = server.client_env(env)
    if "GPUPOOL_TLS_CA" in env and "GPUPOOL_TLS_FINGERPRINT" not in env:
        full.pop("GPUPOOL_TLS_FINGERPRINT", None)
    return run_client([hold_gpu, str(nbytes), "0", str(seed)], env=full, timeout=120)


def samples(seed: int, nbytes: int) -> list[bytes]:
    return [pattern(seed, off, 48) for off in (0, 4096, nbytes // 2, nbytes - 48)]


# ------------------------------------------------------------------------------------ tests
def test_tls_session_is_bit_exact_and_nothing_readable_on_the_wire(
        start_daemon: Any, native_build: Path, hold_gpu: Path, pki: Pki, tmp_path: Path,  # noqa: F811
        relay_factory: Callable[[GpupoolServer], Relay]) -> None:
    server = tls_daemon(start_daemon, native_build, pki, tmp_path)
    relay = relay_factory(server)
    proc = run_hold(server, hold_gpu, {"GPUPOOL_SERVER": f"tls://127.0.0.1:{relay.port}",
                                       "GPUPOOL_TLS_CA": str(pki.ca)})
    assert proc.returncode == 0, proc.stderr
    f = facts(proc.stdout)
    assert f["exact"] == "1", f
    wire = bytes(relay.wire)
    assert len(wire) > 2 * MIB, "the copies did not go through the relay"
    for s in samples(7, MIB):
        assert s not in wire, "client data in plaintext on the wire"
    assert server.token.encode() not in wire, "the token in plaintext on the wire"
    assert b"GPPL" not in wire  # the hello's magic: the hello itself travels inside TLS
    assert "GP_INFO_HANDOFF" not in proc.stderr and "handing the connection" not in proc.stderr
    # The lease was served and is recorded like any other (the end is recorded just after the
    # client exits).
    wait_until("the lease recorded as ended by the client",
               lambda: any(le.get("end_reason") == "client exit" for le in
                           server.get_json("/api/v1/leases?state=all")["leases"]))


def test_the_relay_does_see_plaintext_without_tls(
        start_daemon: Any, native_build: Path, hold_gpu: Path,  # noqa: F811
        relay_factory: Callable[[GpupoolServer], Relay]) -> None:
    """The check above can fail: on a plaintext server the same relay sees the data, and a TLS
    client there gets a clear error instead of hanging."""
    # A plaintext server on purpose (`--tls off`); its clients say GPUPOOL_TLS=0 (client_env).
    server = start_daemon(build_dir=native_build, tls=False)
    relay = relay_factory(server)
    proc = run_hold(server, hold_gpu, {"GPUPOOL_SERVER": f"127.0.0.1:{relay.port}"})
    assert proc.returncode == 0, proc.stderr
    assert all(s in bytes(relay.wire) for s in samples(7, MIB))

    # A TLS client with a pin (any identity: it must get as far as the handshake, which a
    # client with neither pin nor CA never starts).
    proc = run_hold(server, hold_gpu, {"GPUPOOL_TLS": "1",
                                       "GPUPOOL_TLS_FINGERPRINT": "SHA256:" + "A" * 43})
    assert proc.returncode != 0
    assert "does not speak TLS" in proc.stderr and "GPUPOOL_TLS" in proc.stderr, proc.stderr
    assert server.running


@pytest.mark.san
def test_tls_errors_are_clear_and_the_daemon_keeps_serving(
        start_daemon: Any, native_build: Path, hold_gpu: Path, pki: Pki,  # noqa: F811
        tmp_path: Path) -> None:
    server = tls_daemon(start_daemon, native_build, pki, tmp_path)
    # A CA that did not sign the server's certificate.
    proc = run_hold(server, hold_gpu, {"GPUPOOL_TLS": "1", "GPUPOOL_TLS_CA": str(pki.other_ca)})
    assert proc.returncode != 0
    assert "certificate" in proc.stderr and "GPUPOOL_TLS_CA" in proc.stderr, proc.stderr
    # The wrong host name (127.1 reaches 127.0.0.1, but the certificate names localhost and
    # 127.0.0.1 only).
    proc = run_hold(server, hold_gpu, {"GPUPOOL_SERVER": f"tls://127.1:{server.port}",
                                       "GPUPOOL_TLS_CA": str(pki.ca)})
    assert proc.returncode != 0 and "not accepted" in proc.stderr, proc.stderr
    # A plaintext client on the TLS port: the daemon's notice says what to change (TLS is the
    # client's default: drop the GPUPOOL_TLS=0 opt-out, and pin the server).
    proc = run_hold(server, hold_gpu, {"GPUPOOL_TLS": "0"})
    assert proc.returncode != 0
    assert "requires TLS" in proc.stderr and "GPUPOOL_TLS=0" in proc.stderr, proc.stderr
    assert "gpupool login" in proc.stderr, proc.stderr
    # Host name form, and the daemon still serves.
    proc = run_hold(server, hold_gpu, {"GPUPOOL_SERVER": f"localhost:{server.port}",
                                       "GPUPOOL_TLS": "1", "GPUPOOL_TLS_CA": str(pki.ca)},
                    seed=11)
    assert proc.returncode == 0 and facts(proc.stdout)["exact"] == "1", proc.stderr
    assert server.running


@pytest.mark.san
def test_client_certificate_required(start_daemon: Any, native_build: Path, hold_gpu: Path,  # noqa: F811
                                     pki: Pki, tmp_path: Path) -> None:
    server = tls_daemon(start_daemon, native_build, pki, tmp_path, client_ca=True)
    base = {"GPUPOOL_TLS": "1", "GPUPOOL_TLS_CA": str(pki.ca)}
    proc = run_hold(server, hold_gpu, base)
    assert proc.returncode != 0
    assert "GPUPOOL_TLS_CERT" in proc.stderr, proc.stderr
    # A certificate from another CA is refused too.
    proc = run_hold(server, hold_gpu, {**base, "GPUPOOL_TLS_CERT": str(pki.cert),
                                       "GPUPOOL_TLS_KEY": str(pki.key)})
    assert proc.returncode != 0 and "did not accept the client certificate" in proc.stderr, \
        proc.stderr
    # Half a certificate is a local error, nothing sent.
    proc = run_hold(server, hold_gpu, {**base, "GPUPOOL_TLS_CERT": str(pki.client_cert)})
    assert proc.returncode != 0 and "GPUPOOL_TLS_KEY" in proc.stderr, proc.stderr
    proc = run_hold(server, hold_gpu, {**base, "GPUPOOL_TLS_CERT": str(pki.client_cert),
                                       "GPUPOOL_TLS_KEY": str(pki.client_key)}, seed=5)
    assert proc.returncode == 0 and facts(proc.stdout)["exact"] == "1", proc.stderr
    assert server.running


def test_queued_tls_client_gets_notices_then_the_gpu(
        start_daemon: Any, native_build: Path, hold_gpu: Path, pki: Pki,  # noqa: F811
        tmp_path: Path) -> None:
    """Queue notices travel in the daemon's TLS session; the hand-over happens after them."""
    server = tls_daemon(start_daemon, native_build, pki, tmp_path)
    env = server.client_env({"GPUPOOL_TLS": "1", "GPUPOOL_TLS_CA": str(pki.ca)})
    first = subprocess.Popen([str(hold_gpu), str(MIB), "1500", "1"], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not server.get_json("/api/v1/leases?state=active")["leases"]:
            assert time.monotonic() < deadline and first.poll() is None, "first never leased"
            time.sleep(0.05)
        second = run_client([hold_gpu, str(MIB), "0", "2"], env=env, timeout=120)
    finally:
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0 and facts(out)["exact"] == "1", err
    assert second.returncode == 0 and facts(second.stdout)["exact"] == "1", second.stderr
    assert "position 1" in second.stderr, second.stderr


def test_handshake_classifier() -> None:
    assert looks_like_tls(b"\x16\x03\x01\x02\x00")
    # A plaintext hello starts with its body length (< 16 KiB), never 0x16 0x03 0x01..0x04.
    for length in (0x16, 0x316, 0x3016, 16384):
        assert not looks_like_tls(struct.pack("<I", length))


def test_worker_session_message_and_argv(tmp_path: Path) -> None:
    plain = WorkerSupervisor(tmp_path / "w", tmp_path)
    tls = WorkerSupervisor(tmp_path / "w", tmp_path,
                           tls=WorkerTls(tmp_path / "c.pem", tmp_path / "k.pem",
                                         tmp_path / "ca.pem"))
    gpu = type("G", (), {"driver": "d", "ordinal": 0, "simulated": False, "writable": (),
                            "readable": ()})()
    assert "--tls-cert" not in plain.argv(gpu, 3)  # type: ignore[arg-type]
    args = tls.argv(gpu, 3)  # type: ignore[arg-type]
    assert args[-6:] == ["--tls-cert", str(tmp_path / "c.pem"), "--tls-key",
                         str(tmp_path / "k.pem"), "--tls-client-ca", str(tmp_path / "ca.pem")]
    # worker_session carries the TLS flag the worker acts on (worker/prestart.c).
    msg = gp.WorkerSession(session_id=9, hello_req=4, flags=gp.GP_WORKER_SESSION_TLS, hello=b"h")
    assert gp.WorkerSession.decode(gp.encode_frame(msg)[gp.HEADER_SIZE:]) == msg
    assert gp.GP_WORKER_SESSION_TLS == 1


# --------------------------------------------------- the hand-over, driven frame by frame
def _read_frame(sock: ssl.SSLSocket) -> tuple[int, int, int, bytes]:
    f = read_frame(sock)
    return f.op, f.flags, f.req, f.body


def until_handoff(sock: ssl.SSLSocket) -> None:
    """Read the daemon's frames up to GP_INFO_HANDOFF (queue notices may come first: the GPU
    is scrubbed after the daemon starts)."""
    while True:
        op, flags, _, body = _read_frame(sock)
        assert op == gp.Notice.OP and not flags & gp.FLAG_REPLY, (op, body)
        if gp.Notice.decode(body).code == gp.GP_INFO_HANDOFF:
            return
        assert gp.Notice.decode(body).code == gp.GP_INFO_QUEUED


def binding(body: bytes) -> int:
    return int.from_bytes(hashlib.sha256(b"gpupool tls handoff\0" + body).digest()[:8], "little")


@pytest.mark.parametrize("proof", ["right", "wrong"])
def test_handoff_needs_the_binding_of_the_hello(start_daemon: Any, native_build: Path, pki: Pki,
                                                tmp_path: Path, proof: str) -> None:
    """The daemon's session ends with GP_INFO_HANDOFF and close_notify; the worker's session
    serves only a client that proves it sent the hello (someone who took over the TCP connection
    between the two sessions gets nothing)."""
    server = tls_daemon(start_daemon, native_build, pki, tmp_path)
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    body = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=4242, host="laptop",
                    user="ada", program="pytest-client", token=server.token, gpu="", model="",
                    min_memory=0, va_base=0x200000000000, va_size=1 << 40).encode()
    raw = socket.create_connection((server.host, server.port), timeout=30)
    first = ctx.wrap_socket(raw, server_hostname="localhost")
    first.sendall(gp.HEADER.pack(len(body), gp.Hello.OP, 0, 9) + body)
    until_handoff(first)
    plain = first.unwrap()  # close_notify both ways
    second = ctx.wrap_socket(plain, server_hostname="localhost")
    token = binding(body) if proof == "right" else binding(body) ^ 1
    second.sendall(gp.encode_frame(gp.Ping(token=token), 10))
    if proof == "right":
        op, flags, req, reply = _read_frame(second)
        assert op == gp.Hello.OP and flags & gp.FLAG_REPLY and req == 9
        assert gp.HelloReply.decode(reply).result == 0
        second.sendall(gp.encode_frame(gp.Goodbye(), 11))
    else:
        with pytest.raises((ConnectionError, EOFError, ssl.SSLError, OSError)):
            _read_frame(second)
        server.wait_for_log("not the binding of its hello", timeout=20)
    second.close()
    # Either way the daemon goes on serving TLS clients.
    again = ctx.wrap_socket(socket.create_connection((server.host, server.port), timeout=30),
                            server_hostname="localhost")
    again.sendall(gp.HEADER.pack(len(body), gp.Hello.OP, 0, 12) + body)
    until_handoff(again)
    again.close()


# ------------------------------------------------------- TlsStream on its own (no daemon)
async def test_tls_stream_hands_over_at_the_record_boundary(pki: Pki) -> None:
    """gpupoold's TLS session ends exactly at the client's close_notify: bytes the client sends
    right after it (its next ClientHello) stay in the socket for the worker. And when the worker
    never takes the connection, the daemon can still answer in a new session of its own."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client_ctx = ssl.create_default_context(cafile=str(pki.ca))
    after = b"bytes for the worker"
    got: dict[str, Any] = {}

    def client() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
            tls = client_ctx.wrap_socket(raw, server_hostname="localhost")
            tls.sendall(b"hello")
            op, _, _, body = _read_frame(tls)
            got["notice"] = gp.Notice.decode(body).code
            plain = tls.unwrap()
            plain.sendall(after)
            got["drained"] = plain.recv(1)  # the daemon reads `after`, then starts a session
            with client_ctx.wrap_socket(plain, server_hostname="localhost") as again:
                got["reply"] = _read_frame(again)

    thread = threading.Thread(target=client)
    thread.start()
    conn, _ = await asyncio.get_running_loop().sock_accept(listener)
    conn.setblocking(False)
    stream = TlsStream(conn, server_context(pki.cert, pki.key, None, prefix="tls"))
    try:
        await stream.handshake()
        assert await stream.readexactly(5) == b"hello"
        await stream.handoff()
        assert stream.handed_over
        data = b""
        while len(data) < len(after):  # left in the kernel, unread by the TLS layer
            await asyncio.sleep(0.01)
            try:
                data += conn.recv(len(after) - len(data))
            except BlockingIOError:
                pass
        assert data == after
        conn.setblocking(True)
        conn.sendall(b"!")
        conn.setblocking(False)
        stream.write(gp.encode_frame(gp.Ping(token=3), 5))
        await asyncio.wait_for(stream.drain(), 30)
    finally:
        await asyncio.to_thread(thread.join, 30)
        stream.close()
        listener.close()
    assert got["notice"] == gp.GP_INFO_HANDOFF
    op, _, req, body = got["reply"]
    assert op == gp.Ping.OP and req == 5 and gp.Ping.decode(body).token == 3


def test_tls_client_killed_mid_transfer_ends_the_lease(
        start_daemon: Any, native_build: Path, hold_gpu: Path, pki: Pki,  # noqa: F811
        tmp_path: Path) -> None:
    """A TLS client killed mid-copy: the worker sees the connection end inside its TLS session,
    the lease ends as `client lost` and the GPU is scrubbed and free again."""
    server = tls_daemon(start_daemon, native_build, pki, tmp_path)
    wait_until("GPU free", lambda: gpu_states(server) == ["free"], timeout=30)
    proc = start_client(server, hold_gpu, 16 * MIB, 60_000, seed=3, loops=1_000_000,
                        env={"GPUPOOL_TLS": "1", "GPUPOOL_TLS_CA": str(pki.ca)})
    assert proc.stdout is not None
    assert "holding" in proc.stdout.readline()
    time.sleep(0.3)  # inside the copy loop
    proc.kill()
    proc.communicate()
    wait_until("the lease ended as client lost",
               lambda: [le["end_reason"] for le in ended_leases(server)] == ["client lost"],
               timeout=30)
    wait_until("GPU free again", lambda: gpu_states(server) == ["free"], timeout=30)
