"""The worker's end of server-to-server links (worker/h_peer.c, worker/peer_link.c; issue 37,
item 3): two workers on the simulated device, each with its session and client, and the test
playing both servers' gpupoold on their control sockets: it answers worker_peer_connect and
worker_peer_accept with the two ends of a socket pair (or of a proxy that alters the stream),
as gpupoold hands over the connection it opened between the servers. The client's end
(client/shim/api_peer.c) against a fake core: tests/c/test_api_peer.c, run here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gpupool_protocol as gp
import pytest
from conftest import SANITIZER_MARKS, require
from test_worker_control import HELLO_REQ, SIM, VA_BASE, VA_SIZE, WORKER, Client, RawWorker
from worker_client import WorkerSession

from gpupoold.workers import control

pytestmark = pytest.mark.san  # quick: scripts/test.sh runs them against the sanitizer build too

CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_SUPPORTED = 801
KEY = bytes(range(32))
S_PART, D_PART = 0, 1
MIB = 1 << 20


@pytest.fixture(autouse=True)
def built(native_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require(WORKER.exists(), "gpupool-worker is not built")
    require(SIM.exists(), "the simulated device (libgpupool-sim.so) is not built")
    monkeypatch.delenv("GPUPOOL_SIM_CONFIG", raising=False)


@dataclass
class Part:
    """One part of a spread lease: its worker, its session and its client."""

    rw: RawWorker
    client: Client
    session: int
    req: int = 1000

    def send(self, msg: object) -> int:
        self.req += 1
        self.client.sock.sendall(gp.encode_frame(msg, self.req))
        return self.req

    def reply(self, req: int) -> object:
        op, got, body = self.client.frame()
        assert got == req, (op, got, req)
        return gp.REPLIES[op].decode(body)

    def call(self, msg: object) -> object:
        return self.reply(self.send(msg))

    def request(self, kind: type) -> object:
        """The worker's next control message of `kind` (statistics skipped). Decoded here, not
        by gpupoold's control.decode, which takes only what its supervisor handles."""
        while True:
            packet = self.rw.ctl.recv(65536)
            assert packet, "control socket closed"
            length, op, _, _ = gp.parse_header(packet[:gp.HEADER_SIZE], gp.MAX_BODY)
            if op == kind.OP:  # type: ignore[attr-defined]
                return kind.decode(packet[gp.HEADER_SIZE:])  # type: ignore[attr-defined]

    def answer(self, msg: object, sock: socket.socket | None) -> None:
        socket.send_fds(self.rw.ctl, [control.encode(msg)], [sock.fileno()] if sock else [])

    def alloc(self, size: int) -> int:
        r, _ = self.client.call(gp.MemAlloc(size=size, stream=0, flags=0))
        assert r.result == 0, r  # type: ignore[attr-defined]
        return r.dptr  # type: ignore[attr-defined]

    def write(self, ptr: int, data: bytes) -> None:
        self.client.post(gp.MemcpyHtod(dst=ptr, stream=0, is_async=0, data=len(data)), data)

    def read(self, ptr: int, size: int) -> bytes:
        r, data = self.client.call(gp.MemcpyDtoh(src=ptr, size=size, stream=0, is_async=0))
        assert r.result == 0, r  # type: ignore[attr-defined]
        return data


def start_part(cache: Path, session: int) -> Part:
    cache.mkdir()
    rw = RawWorker(cache)
    assert isinstance(rw.event(), gp.WorkerReady)
    c = Client()
    hello = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=os.getpid(),
                     flags=gp.GP_HELLO_KEEPALIVE, host="testhost", user="tester",
                     program="test_worker_peer_links", va_base=VA_BASE, va_size=VA_SIZE)
    msg = control.encode(gp.WorkerSession(session_id=session, hello_req=HELLO_REQ,
                                          hello=hello.encode()))
    socket.send_fds(rw.ctl, [msg], [c.hand_over()])
    c.close_server_side()
    assert isinstance(rw.event(), gp.WorkerStarted)
    assert c.hello_reply().result == 0
    return Part(rw, c, session)


@contextmanager
def two_parts(tmp_path: Path) -> Iterator[tuple[Part, Part]]:
    """The source part's worker (S) and the destination part's (D)."""
    s = start_part(tmp_path / "s", 71)
    d = start_part(tmp_path / "d", 72)
    yield s, d
    for p in (s, d):
        p.client.close()  # the session ends: its links close with it
        try:
            p.request(gp.WorkerEnded)
        finally:
            p.rw.ctl.shutdown(socket.SHUT_RDWR)
            p.rw.finish(timeout=20)


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[Part, Part]]:
    with two_parts(tmp_path) as both:
        yield both


def link(s: Part, d: Part, link_id: int, key_s: bytes = KEY, key_d: bytes = KEY,
         ends: tuple[socket.socket, socket.socket] | None = None) -> tuple[object, object]:
    """peer_link on both (the receiving side first, as the shim does), both gpupoolds' answers
    with the two ends of a connection: (D's reply, S's reply)."""
    rd = d.send(gp.PeerLink(link_id=link_id, key=key_d, role=gp.GP_PEER_RECV, peer_part=S_PART))
    acc = d.request(gp.WorkerPeerAccept)
    assert (acc.session_id, acc.link_id, acc.from_part) == (d.session, link_id, S_PART)
    rs = s.send(gp.PeerLink(link_id=link_id, key=key_s, role=gp.GP_PEER_SEND, peer_part=D_PART))
    con = s.request(gp.WorkerPeerConnect)
    assert (con.session_id, con.link_id, con.to_part) == (s.session, link_id, D_PART)
    a, b = ends or socket.socketpair()
    s.answer(gp.WorkerPeerConnected(session_id=s.session, link_id=link_id), a)
    d.answer(gp.WorkerPeerAccepted(session_id=d.session, link_id=link_id), b)
    a.close()
    b.close()
    return d.reply(rd), s.reply(rs)


def peer_copy(s: Part, d: Part, link_id: int, src: int, dst: int, size: int, copy_id: int = 1,
              sent_id: int | None = None, sent_size: int | None = None,
              pause: float = 0) -> tuple[object, object]:
    """peer_recv on D, peer_send on S (after `pause` s): (D's reply, S's reply)."""
    rd = d.send(gp.PeerRecv(link_id=link_id, copy_id=copy_id, dst=dst, size=size))
    time.sleep(pause)
    rs = s.send(gp.PeerSend(link_id=link_id, copy_id=copy_id if sent_id is None else sent_id,
                            src=src, size=size if sent_size is None else sent_size))
    return d.reply(rd), s.reply(rs)


def ok(*replies: object) -> None:
    for r in replies:
        assert r.code == 0, r  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------- copies
def test_copies_across_a_link_are_bit_exact(parts: tuple[Part, Part]) -> None:
    s, d = parts
    ok(*link(s, d, 0x51))
    size = 64 * MIB
    src, dst = s.alloc(size), d.alloc(size)
    data = os.urandom(size)
    s.write(src, data)
    before_s, before_d = s.call(gp.Stats()), d.call(gp.Stats())
    for n in (1, 3 * MIB + 7, size):
        ok(*peer_copy(s, d, 0x51, src, dst, n, copy_id=n))
        assert d.read(dst, n) == data[:n], n
    # Counted as the worker's copies (the dashboard's traffic): sent as d2h, received as h2d.
    after_s, after_d = s.call(gp.Stats()), d.call(gp.Stats())
    moved = 1 + 3 * MIB + 7 + size
    assert after_s.d2h_bytes - before_s.d2h_bytes == moved  # type: ignore[attr-defined]
    assert after_d.h2d_bytes - before_d.h2d_bytes == moved  # type: ignore[attr-defined]
    # Off an allocation's start too, and the link stays up for the next copy.
    ok(*peer_copy(s, d, 0x51, src + 4096 + 3, dst + 5, MIB + 1, copy_id=9))
    assert d.read(dst + 5, MIB + 1) == data[4096 + 3:4096 + 3 + MIB + 1]


def test_the_client_hears_keepalives_while_a_copy_waits(parts: tuple[Part, Part]) -> None:
    s, d = parts
    ok(*link(s, d, 0x52))
    src, dst = s.alloc(MIB), d.alloc(MIB)
    s.write(src, b"k" * MIB)
    ok(*peer_copy(s, d, 0x52, src, dst, MIB, pause=2.5))  # D waits for S's data meanwhile
    assert any(n.code == gp.GP_INFO_WORKING for n in d.client.notices), d.client.notices
    assert d.read(dst, MIB) == b"k" * MIB


def test_the_receiver_waits_longer_for_a_copy_to_start_than_for_its_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender busy with another call for longer than the silence limit (1 s here) is no dead
    link: the receiver waits for the COPY record up to 10 times that limit; and a receiver busy
    so is none either: the sender's first records (up to what the buffers hold) wait as long."""
    monkeypatch.setenv("GPUPOOL_WORKER_PEER_SILENCE_MS", "1000")
    with two_parts(tmp_path) as (s, d):
        ok(*link(s, d, 0x5F))
        src, dst = s.alloc(MIB), d.alloc(MIB)
        s.write(src, b"w" * MIB)
        ok(*peer_copy(s, d, 0x5F, src, dst, MIB, pause=2.5))
        assert d.read(dst, MIB) == b"w" * MIB
        # The other way round: the receiver busy (it asks 2.5 s late) while the sender's
        # records fill the socket's buffers: the first ones wait as long.
        size = 8 * MIB
        src, dst = s.alloc(size), d.alloc(size)
        data = os.urandom(size)
        s.write(src, data)
        rs = s.send(gp.PeerSend(link_id=0x5F, copy_id=2, src=src, size=size))
        time.sleep(2.5)
        rd = d.send(gp.PeerRecv(link_id=0x5F, copy_id=2, dst=dst, size=size))
        ok(s.reply(rs), d.reply(rd))
        assert d.read(dst, size) == data


# ---------------------------------------------------------------------------------- failures
def test_a_wrong_key_fails_the_link_with_words(parts: tuple[Part, Part]) -> None:
    s, d = parts
    rd, rs = link(s, d, 0x53, key_d=bytes(32))
    assert rs.code == 0  # type: ignore[attr-defined]  # the sender cannot tell: it only wrote
    assert rd.code == CUDA_ERROR_NOT_SUPPORTED, rd  # type: ignore[attr-defined]
    assert "did not decrypt" in rd.error and "different keys" in rd.error  # type: ignore[attr-defined]


def relay(pump: Callable[[socket.socket, socket.socket], None],
          ) -> tuple[socket.socket, socket.socket, threading.Thread]:
    """Two ends (for S, for D) of a connection whose bytes pump(from S's side, to D's side)
    passes on, in a thread; both inner ends close when it returns or the link breaks."""
    s_end, proxy_in = socket.socketpair()
    proxy_out, d_end = socket.socketpair()

    def run() -> None:
        try:
            pump(proxy_in, proxy_out)
        except OSError:
            pass
        finally:
            proxy_in.close()
            proxy_out.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return s_end, d_end, t


def proxy(alter: Callable[[bytes, int], bytes]) -> tuple[socket.socket, socket.socket, threading.Thread]:
    """Two ends (for S, for D) of a connection whose bytes pass through alter(chunk, offset of
    the chunk in the stream) on their way."""
    def pump(proxy_in: socket.socket, proxy_out: socket.socket) -> None:
        seen = 0
        while chunk := proxy_in.recv(65536):
            proxy_out.sendall(alter(chunk, seen))
            seen += len(chunk)

    return relay(pump)


def flip_at(at: int) -> Callable[[bytes, int], bytes]:
    def alter(chunk: bytes, seen: int) -> bytes:
        if seen <= at < seen + len(chunk):
            altered = bytearray(chunk)
            altered[at - seen] ^= 0x10
            return bytes(altered)
        return chunk

    return alter


def replay_first(n: int) -> Callable[[bytes, int], bytes]:
    """Sends the stream's first n bytes (one whole record) a second time right after them."""
    first = bytearray()

    def alter(chunk: bytes, seen: int) -> bytes:
        if seen >= n:
            return chunk
        first.extend(chunk[: n - seen])
        if len(first) < n:
            return chunk
        cut = n - seen
        return chunk[:cut] + bytes(first) + chunk[cut:]

    return alter


HELLO_RECORD, COPY_RECORD = 4 + 9 + 16, 4 + 17 + 16


def test_a_byte_altered_in_flight_fails_the_copy_and_closes_the_link(
        parts: tuple[Part, Part]) -> None:
    s, d = parts
    s_end, d_end, relay = proxy(flip_at(HELLO_RECORD + COPY_RECORD + 4 + 1000))
    ok(*link(s, d, 0x54, ends=(s_end, d_end)))
    # More than the sockets between S and D hold: D fails on the first DATA record and closes
    # its end while S still writes, so S's copy fails too.
    size = 16 * MIB + 7
    src, dst = s.alloc(size), d.alloc(size)
    s.write(src, os.urandom(size))
    rd, rs = peer_copy(s, d, 0x54, src, dst, size)
    assert rd.code != 0 and "did not decrypt" in rd.error, rd  # type: ignore[attr-defined]
    assert rs.code != 0 and "closed the link" in rs.error, rs  # type: ignore[attr-defined]
    relay.join(10)
    assert not relay.is_alive()  # D closed its end
    rd = d.call(gp.PeerRecv(link_id=0x54, copy_id=2, dst=dst, size=1))
    assert rd.code == CUDA_ERROR_INVALID_VALUE and "no server-to-server link" in rd.error, rd  # type: ignore[attr-defined]
    # S closed its own end too (no peer_unlink sent): the link is gone there as well.
    rs = s.call(gp.PeerSend(link_id=0x54, copy_id=2, src=src, size=1))
    assert rs.code == CUDA_ERROR_INVALID_VALUE and "no server-to-server link" in rs.error, rs  # type: ignore[attr-defined]


def test_a_replayed_record_does_not_decrypt(parts: tuple[Part, Part]) -> None:
    """The record counter is the nonce: the link's hello sent again (a replay by whoever sits
    on the connection) fails the next copy instead of passing for a record of it."""
    s, d = parts
    s_end, d_end, relay = proxy(replay_first(HELLO_RECORD))
    ok(*link(s, d, 0x5A, ends=(s_end, d_end)))
    src, dst = s.alloc(MIB), d.alloc(MIB)
    rd, _ = peer_copy(s, d, 0x5A, src, dst, 10)
    assert rd.code != 0 and "did not decrypt" in rd.error, rd  # type: ignore[attr-defined]
    relay.join(10)


@pytest.mark.parametrize("what", ["copy_id", "size"])
def test_a_copy_the_receiver_does_not_expect_fails(parts: tuple[Part, Part], what: str) -> None:
    s, d = parts
    ok(*link(s, d, 0x55))
    src, dst = s.alloc(MIB), d.alloc(MIB)
    if what == "copy_id":
        rd, _ = peer_copy(s, d, 0x55, src, dst, 100, copy_id=3, sent_id=4)
    else:
        rd, _ = peer_copy(s, d, 0x55, src, dst, 100, sent_size=101)
    assert rd.code != 0 and "out of step" in rd.error, rd  # type: ignore[attr-defined]
    rd = d.call(gp.PeerRecv(link_id=0x55, copy_id=5, dst=dst, size=1))
    assert "no server-to-server link" in rd.error, rd  # type: ignore[attr-defined]  # closed


def test_calls_that_name_no_usable_link_are_refused_with_words(parts: tuple[Part, Part]) -> None:
    s, d = parts
    src, dst = s.alloc(MIB), d.alloc(MIB)
    rs = s.call(gp.PeerSend(link_id=0x999, copy_id=1, src=src, size=1))
    assert rs.code == CUDA_ERROR_INVALID_VALUE, rs  # type: ignore[attr-defined]
    assert "no server-to-server link 0x999" in rs.error  # type: ignore[attr-defined]
    ok(*link(s, d, 0x56))
    rs = s.call(gp.PeerLink(link_id=0x56, key=KEY, role=gp.GP_PEER_SEND, peer_part=D_PART))
    assert rs.code == CUDA_ERROR_INVALID_VALUE and "in use" in rs.error, rs  # type: ignore[attr-defined]
    rs = s.call(gp.PeerLink(link_id=0x57, key=KEY, role=7, peer_part=D_PART))
    assert rs.code == CUDA_ERROR_INVALID_VALUE and "role 7" in rs.error, rs  # type: ignore[attr-defined]
    # A copy of 0 bytes fails on both ends (and closes the link); the link still worked before.
    ok(*peer_copy(s, d, 0x56, src, dst, 1))
    rd, rs = peer_copy(s, d, 0x56, src, dst, 0)
    assert rd.code == rs.code == CUDA_ERROR_INVALID_VALUE, (rd, rs)  # type: ignore[attr-defined]
    assert "0 bytes" in rd.error and "0 bytes" in rs.error  # type: ignore[attr-defined]
    # A copy asked of the wrong end is refused and closes that end, so the other end's copy
    # fails at once with the link's end, not after its 30 s silence limit.
    ok(*link(s, d, 0x5B))
    rd = d.send(gp.PeerRecv(link_id=0x5B, copy_id=1, dst=dst, size=1))
    t0 = time.monotonic()
    rs = s.call(gp.PeerRecv(link_id=0x5B, copy_id=1, dst=src, size=1))  # S's end sends
    assert rs.code == CUDA_ERROR_INVALID_VALUE and "sending end" in rs.error, rs  # type: ignore[attr-defined]
    r = d.reply(rd)
    assert r.code == CUDA_ERROR_NOT_SUPPORTED and "closed the link" in r.error, r  # type: ignore[attr-defined]
    assert time.monotonic() - t0 < 15


def test_gpupoolds_refusal_reaches_the_client(parts: tuple[Part, Part]) -> None:
    s, _ = parts
    why = ("server b (10.0.0.2:7070) could not be reached from this server: timed out; open the "
           "remoting port between the fleet's servers")
    rs = s.send(gp.PeerLink(link_id=0x58, key=KEY, role=gp.GP_PEER_SEND, peer_part=D_PART))
    s.request(gp.WorkerPeerConnect)
    s.answer(gp.WorkerPeerConnected(session_id=s.session, link_id=0x58,
                                    code=CUDA_ERROR_NOT_SUPPORTED, error=why), None)
    r = s.reply(rs)
    assert (r.code, r.error) == (CUDA_ERROR_NOT_SUPPORTED, why)  # type: ignore[attr-defined]
    # The id was not taken by the failed link: the next try with it goes to gpupoold again.
    rs = s.send(gp.PeerLink(link_id=0x58, key=KEY, role=gp.GP_PEER_SEND, peer_part=D_PART))
    assert s.request(gp.WorkerPeerConnect).link_id == 0x58  # type: ignore[attr-defined]
    s.answer(gp.WorkerPeerConnected(session_id=s.session, link_id=0x58, code=2, error="x"), None)
    assert s.reply(rs).code == 2  # type: ignore[attr-defined]


def test_a_device_error_of_the_sender_reaches_the_receiver(parts: tuple[Part, Part]) -> None:
    """The sender cannot read its memory: ABORT with the driver's code, both ends fail."""
    s, d = parts
    ok(*link(s, d, 0x59))
    dst = d.alloc(MIB)
    nowhere = VA_BASE + (VA_SIZE >> 1)  # in the window, never allocated
    rd, rs = peer_copy(s, d, 0x59, nowhere, dst, MIB)
    assert rs.code not in (0, CUDA_ERROR_NOT_SUPPORTED), rs  # type: ignore[attr-defined]
    assert "reading" in rs.error and "device memory" in rs.error  # type: ignore[attr-defined]
    assert rd.code == rs.code and "could not send the copy" in rd.error, rd  # type: ignore[attr-defined]


def test_a_worker_without_gpupoold_makes_no_link(tmp_path: Path) -> None:
    ws = WorkerSession(tmp_path)
    try:
        r, _ = ws.call(gp.PeerLink(link_id=1, key=KEY, role=gp.GP_PEER_SEND, peer_part=1))
        assert r.code == CUDA_ERROR_NOT_SUPPORTED, r  # type: ignore[attr-defined]
        assert "need gpupoold" in r.error, r  # type: ignore[attr-defined]
        assert "through the client" not in r.error, r  # type: ignore[attr-defined]  # the client's words
    finally:
        code = ws.close()
    err = ws.stderr_text()
    assert code == 0 and not any(bad in err for bad in SANITIZER_MARKS), err


def test_the_sender_refusing_a_copy_fails_the_receiver_at_once_with_its_reason(
        parts: tuple[Part, Part]) -> None:
    """S refuses before reading any memory (here: a range that wraps): its ABORT, sent before
    any COPY, carries its words, and D fails at once with them."""
    s, d = parts
    ok(*link(s, d, 0x5C))
    dst = d.alloc(MIB)
    t0 = time.monotonic()
    rd, rs = peer_copy(s, d, 0x5C, (1 << 64) - 50, dst, 100)
    assert time.monotonic() - t0 < 15  # not the 30 s silence limit
    assert rs.code == CUDA_ERROR_INVALID_VALUE and "no device range" in rs.error, rs  # type: ignore[attr-defined]
    assert rd.code == CUDA_ERROR_INVALID_VALUE, rd  # type: ignore[attr-defined]
    assert "could not send the copy" in rd.error and "no device range" in rd.error, rd  # type: ignore[attr-defined]


def test_a_copy_larger_than_any_device_range_is_refused_on_both_ends(
        parts: tuple[Part, Part]) -> None:
    s, d = parts
    ok(*link(s, d, 0x5D))
    src, dst = s.alloc(MIB), d.alloc(MIB)
    rd, rs = peer_copy(s, d, 0x5D, src, dst, 1 << 60)
    for r in (rd, rs):
        assert r.code == CUDA_ERROR_INVALID_VALUE, r  # type: ignore[attr-defined]
        assert "larger than any device range" in r.error, r  # type: ignore[attr-defined]


def dribble_after(n: int, every: float) -> tuple[socket.socket, socket.socket, threading.Thread]:
    """Two ends (for S, for D) of a connection that passes the first n bytes at once, then one
    byte every `every` s: a peer that is never silent for long but never finishes a record."""
    def pump(proxy_in: socket.socket, proxy_out: socket.socket) -> None:
        passed = 0
        while passed < n and (chunk := proxy_in.recv(n - passed)):
            proxy_out.sendall(chunk)  # as it comes: the link's HELLO before its COPY
            passed += len(chunk)
        while byte := proxy_in.recv(1):
            time.sleep(every)
            proxy_out.sendall(byte)

    return relay(pump)


def test_a_peer_that_dribbles_bytes_fails_the_copy_at_the_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One deadline per DATA record: a byte every 100 ms restarts nothing, and with a 1 s limit
    the copy fails in about 1 s, with words (the DATA record alone would take 12 s)."""
    monkeypatch.setenv("GPUPOOL_WORKER_PEER_SILENCE_MS", "1000")
    with two_parts(tmp_path) as (s, d):
        s_end, d_end, relay = dribble_after(HELLO_RECORD + COPY_RECORD, 0.1)
        ok(*link(s, d, 0x5E, ends=(s_end, d_end)))
        src, dst = s.alloc(MIB), d.alloc(MIB)
        t0 = time.monotonic()
        rd, _ = peer_copy(s, d, 0x5E, src, dst, 100)
        took = time.monotonic() - t0
        assert rd.code == CUDA_ERROR_NOT_SUPPORTED, rd  # type: ignore[attr-defined]
        assert "did not send a whole record in 1.000 s" in rd.error, rd  # type: ignore[attr-defined]
        assert took < 8, took  # well before the DATA record could have arrived
        relay.join(10)


def alter_at(at: int, new: bytes) -> Callable[[bytes, int], bytes]:
    def alter(chunk: bytes, seen: int) -> bytes:
        b = bytearray(chunk)
        for k, v in enumerate(new):
            if seen <= at + k < seen + len(chunk):
                b[at + k - seen] = v
        return bytes(b)

    return alter


def test_a_record_longer_than_the_maximum_fails_the_copy(parts: tuple[Part, Part]) -> None:
    s, d = parts
    too_long = (1 << 20) + 64 + 1
    s_end, d_end, _ = proxy(alter_at(HELLO_RECORD, too_long.to_bytes(4, "little")))
    ok(*link(s, d, 0x5F, ends=(s_end, d_end)))
    src, dst = s.alloc(MIB), d.alloc(MIB)
    rd, _ = peer_copy(s, d, 0x5F, src, dst, 100)
    assert rd.code == CUDA_ERROR_NOT_SUPPORTED, rd  # type: ignore[attr-defined]
    assert f"a record of {too_long} bytes" in rd.error, rd  # type: ignore[attr-defined]


def open_fds(p: Part) -> int:
    return len(os.listdir(f"/proc/{p.rw.proc.pid}/fd"))


def test_answers_that_are_not_this_links_are_dropped_and_their_sockets_closed(
        parts: tuple[Part, Part]) -> None:
    s, _ = parts
    before = open_fds(s)
    rs = s.send(gp.PeerLink(link_id=0x60, key=KEY, role=gp.GP_PEER_SEND, peer_part=D_PART))
    s.request(gp.WorkerPeerConnect)
    # A late answer for another link, then one for this link but another session: both come
    # with a socket, neither is taken, both sockets closed.
    for link_id, session in ((0x61, s.session), (0x60, s.session + 1)):
        a, b = socket.socketpair()
        s.answer(gp.WorkerPeerConnected(session_id=session, link_id=link_id), a)
        a.close()
        b.close()
    # This link's answer: code 0 but no socket.
    s.answer(gp.WorkerPeerConnected(session_id=s.session, link_id=0x60), None)
    r = s.reply(rs)
    assert r.code not in (0, CUDA_ERROR_NOT_SUPPORTED), r  # type: ignore[attr-defined]
    assert "without the link's socket" in r.error, r  # type: ignore[attr-defined]
    assert open_fds(s) == before


def test_worker_end_during_the_wait_for_gpupoold_ends_the_session_cleanly(tmp_path: Path) -> None:
    s = start_part(tmp_path / "s", 73)
    try:
        s.send(gp.PeerLink(link_id=0x62, key=KEY, role=gp.GP_PEER_SEND, peer_part=D_PART))
        s.request(gp.WorkerPeerConnect)
        s.rw.ctl.send(control.encode(gp.WorkerEnd(code=100007, text="maintenance")))
        ended = s.request(gp.WorkerEnded)
        assert ended.reason == "server ended", ended  # type: ignore[attr-defined]
        s.client.wait_closed()
    finally:
        s.client.close()
        s.rw.ctl.shutdown(socket.SHUT_RDWR)
        code, err = s.rw.finish(timeout=20)
    assert code == 0, err


def test_the_clients_end_against_a_fake_core(native_build: Path) -> None:
    """tests/c/test_api_peer.c: the legacy-stream waits before a copy, unlinks and new links after
    a failed copy, a pair that waits 30 s and then links again, failures that cost no try, whose
    words, a lost server, plain-TCP connections, copies from several threads."""
    proc = subprocess.run([native_build / "tests" / "test_api_peer"], capture_output=True,
                          text=True, timeout=60)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "PASS test_api_peer" in proc.stdout, said
    assert not any(bad in proc.stderr for bad in SANITIZER_MARKS), said
