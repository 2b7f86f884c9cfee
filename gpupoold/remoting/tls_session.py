"""TLS on the remoting listener: gpupoold's part of a client's connection (docs/protocol.md, "TLS").

Unless `tls = "off"` (with `tls_cert`/`tls_key`, or the server's own identity), the listener accepts
raw TCP and runs the server side of the client's first TLS session here, with `ssl.SSLObject` over
memory BIOs: the hello, refusals and queue notices travel inside it. When the lease starts,
`TlsStream.handoff` sends a notice with `GP_INFO_HANDOFF`, both sides exchange close_notify, and the
plain socket goes to the worker, which runs a second TLS handshake with the client itself (OpenSSL,
worker/tls.c): the data path never passes through Python.

The socket is read one TLS record at a time (5-byte header, then exactly the length it gives),
never further: the bytes after the client's close_notify are its second ClientHello, and they
must stay in the kernel for the worker.

An `info` request (the other first frame) is answered inside the daemon's TLS session, which
then ends with close_notify (`TlsStream.close_session`); there is no hand-over.

`TlsStream` offers what `RemotingListener._handshake` uses of `asyncio.StreamReader` and
`StreamWriter` (readexactly, read, write, drain, close, get_extra_info, transport.pause/resume),
so that the plaintext code path runs unchanged over TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import gpupool_protocol as gp

from gpupoold.config.settings import format_address
from gpupoold.pool.counters import Counters
from gpupoold.remoting.admission import Handshake, HandshakeGate, peer_host
from gpupoold.remoting.handshake import Refusal, refusal_reply
from gpupoold.remoting.info import refusal as info_refusal

log = logging.getLogger("gpupoold.remoting")

RECORD_HEADER = 5
MAX_RECORD_BODY = 16384 + 2048  # the largest TLS 1.2/1.3 ciphertext record
MAX_HANDOFF_RECORDS = 8  # records the client may send before its close_notify at the hand-over
NOT_TLS_MESSAGE = (
    "this gpupool server requires TLS on its remoting port: remove `tls = false` (GPUPOOL_TLS=0) "
    "for it and pin it with `gpupool login HOST:PORT` (or GPUPOOL_TLS_FINGERPRINT=the output of "
    "`gpupoold fingerprint` on the server)")
HANDOFF_TEXT = "handing the connection to the GPU's worker (TLS session ends here)"

Handler = Callable[[Any, Any], Awaitable[None]]


def looks_like_tls(first: bytes) -> bool:
    """A TLS handshake record starts 0x16 0x03 0x01..0x04. A plaintext hello cannot: its first
    bytes are a body length, and 0x??0301..0x??0304 is far above the 16 KiB hello limit."""
    return len(first) >= 3 and first[0] == 0x16 and first[1] == 0x03 and 1 <= first[2] <= 4


class _Transport:
    """Pausing is a no-op: a TlsStream reads only when asked to. `abort` drops the connection
    (TlsStream.abort)."""

    def __init__(self, stream: TlsStream) -> None:
        self._stream = stream

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def abort(self) -> None:
        self._stream.abort()


class TlsStream:
    """A client connection inside the daemon's TLS session; reader and writer in one object."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._context = context
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._ssl: ssl.SSLObject | None = None
        self._rbuf = bytearray()  # raw bytes of the record being read (survives cancellation)
        self._buffer = bytearray()  # decrypted bytes not consumed yet (remoting._buffered reads it)
        self._pending: list[bytes] = []  # written, not yet encrypted (drain does that)
        self._unsent = b""  # encrypted, not yet taken by the kernel from _unsent[_sent:]
        self._sent = 0
        self._send_lock = asyncio.Lock()
        self._eof = False
        self._aborted = False
        self.handed_over = False
        self.transport = _Transport(self)
        # Its place among the handshakes in progress (admission.py), taken at accept; the
        # remoting listener gives it back once the hello is answered.
        self.handshake_place: Handshake | None = None

    # ------------------------------------------------------------------ raw socket, by record
    async def _wait_readable(self) -> None:
        fut = self._loop.create_future()
        fd = self._sock.fileno()
        self._loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            self._loop.remove_reader(fd)

    async def _ensure(self, n: int) -> bool:
        """At least n raw bytes in _rbuf, reading no more than that. False at end of stream."""
        while len(self._rbuf) < n:
            try:
                data = self._sock.recv(n - len(self._rbuf))
            except (BlockingIOError, InterruptedError):
                await self._wait_readable()
                continue
            if not data:
                return False
            self._rbuf += data
        return True

    async def peek(self, n: int) -> bytes:
        """The first n raw bytes of the stream (fewer at its end), left for the TLS layer."""
        await self._ensure(n)
        return bytes(self._rbuf[:n])

    async def _read_record(self) -> bool:
        """Feed one whole TLS record to the TLS object. False at end of stream."""
        if not await self._ensure(RECORD_HEADER):
            return False
        length = int.from_bytes(self._rbuf[3:5], "big")
        if length > MAX_RECORD_BODY:
            raise ssl.SSLError(f"TLS record of {length} bytes (not TLS, or a broken client)")
        if not await self._ensure(RECORD_HEADER + length):
            return False
        self._in.write(bytes(self._rbuf))
        self._rbuf.clear()
        return True

    async def _wait_writable(self) -> None:
        fut = self._loop.create_future()
        fd = self._sock.fileno()
        self._loop.add_writer(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            self._loop.remove_writer(fd)

    async def _flush(self) -> None:
        """Send what the TLS object wrote. Cancelled, it keeps what is left for the next call
        (`unsent` says how much), so that a caller can wait for progress in steps."""
        if self._aborted:
            raise ConnectionError("the connection was dropped")
        async with self._send_lock:
            data = self._out.read()
            if data:
                self._unsent = self._unsent[self._sent:] + data
                self._sent = 0
            while self._sent < len(self._unsent):
                try:
                    self._sent += self._sock.send(memoryview(self._unsent)[self._sent:])
                except (BlockingIOError, InterruptedError):
                    await self._wait_writable()
            self._unsent, self._sent = b"", 0

    def unsent(self) -> int:
        """Bytes written and not yet taken by the kernel (plaintext not yet encrypted counted as
        it is)."""
        return len(self._unsent) - self._sent + sum(map(len, self._pending)) + self._out.pending

    # ------------------------------------------------------------------ the TLS session
    async def handshake(self) -> None:
        """The server handshake of a new session. ssl.SSLError / ConnectionError on failure."""
        self._ssl = self._context.wrap_bio(self._in, self._out, server_side=True)
        while True:
            try:
                self._ssl.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._read_record():
                    raise ConnectionError("the client closed the connection during the TLS "
                                          "handshake") from None
            except ssl.SSLError:
                await self._flush_quietly()  # the alert tells the client why
                raise
        await self._flush()

    async def _flush_quietly(self) -> None:
        with contextlib.suppress(OSError):
            await self._flush()

    async def handoff(self, notice: bool = True) -> None:
        """End the daemon's TLS session before the socket goes to the worker: GP_INFO_HANDOFF
        (unless not `notice`: a peer_hello's reply says it), then close_notify both ways; no
        application data may follow the client's. Raises ConnectionError (the client is gone or
        misbehaved) or ssl.SSLError."""
        assert self._ssl is not None
        if notice:
            self._ssl.write(gp.encode_frame(gp.Notice(code=gp.GP_INFO_HANDOFF, op=0,
                                                      text=HANDOFF_TEXT), 0))
        for _ in range(MAX_HANDOFF_RECORDS):
            try:
                self._ssl.unwrap()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._read_record():
                    raise ConnectionError("the client closed the connection at the TLS "
                                          "hand-over") from None
        else:
            raise ConnectionError("the client sent data instead of closing the TLS session at "
                                  "the hand-over")
        await self._flush()
        if self._buffer or self._in.pending or self._rbuf:
            raise ConnectionError("the client sent data after its hello before the hello reply")
        self._ssl = None
        self.handed_over = True

    async def close_session(self) -> None:
        """Send our close_notify (after an `info` reply: the connection ends here). The client's
        close_notify is not waited for; the socket is closed next."""
        if self._ssl is None or self._aborted:
            return
        try:
            self._ssl.unwrap()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            pass  # ours is sent; theirs would have to be read
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            pass
        await self._flush()
        self._ssl = None

    # ------------------------------------------------------------------ StreamReader part
    async def _fill(self) -> bool:
        """More decrypted bytes into _buffer. False at end of stream (close_notify or EOF)."""
        while not self._eof:
            if self._ssl is None:
                self._eof = True
                break
            try:
                data = self._ssl.read(65536)
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._read_record():
                    self._eof = True
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                self._eof = True
                break
            if data:
                self._buffer += data
                return True
            self._eof = True
        return False

    async def readexactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            if not await self._fill():
                raise asyncio.IncompleteReadError(bytes(self._buffer), n)
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    async def read(self, n: int = -1) -> bytes:
        if not self._buffer and not await self._fill():
            return b""
        take = len(self._buffer) if n < 0 else min(n, len(self._buffer))
        data = bytes(self._buffer[:take])
        del self._buffer[:take]
        return data

    # ------------------------------------------------------------------ StreamWriter part
    def write(self, data: bytes) -> None:
        self._pending.append(data)

    async def drain(self) -> None:
        if self._ssl is None and self.handed_over:
            # The worker never took the connection (it failed to start): the client is
            # waiting for its second handshake; answer it here so it can read why.
            self.handed_over = False
            await self.handshake()
        if self._ssl is None:
            raise ConnectionError("no TLS session")
        pending, self._pending = self._pending, []
        for data in pending:
            self._ssl.write(data)
        await self._flush()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        try:
            if name == "peername":
                return self._sock.getpeername()
            if name == "sockname":
                return self._sock.getsockname()
        except OSError:
            return default
        if name == "socket":
            return self._sock
        if name == "ssl_object":
            return self._ssl
        return default

    def abort(self) -> None:
        """Give up on the connection (a send timed out): nothing more is sent, and closing it
        resets it (SO_LINGER 0) instead of leaving the unsent bytes to the kernel. The socket
        itself is closed by `close`, once no reader waits on it."""
        self._aborted = True
        self._pending.clear()
        self._unsent, self._sent = b"", 0
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def close(self) -> None:
        self._sock.close()

    async def wait_closed(self) -> None:
        pass


class TlsServer:
    """Accepts raw TCP, runs the TLS handshake (within `handshake_timeout`), then calls
    `handler(stream, stream)` as asyncio.start_server would with (reader, writer)."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, handler: Handler,
                 handshake_timeout: float, counters: Counters,
                 gate: HandshakeGate | None = None) -> None:
        self.sockets = [sock]
        self._gate = gate
        self._sock = sock
        self._context = context
        self._handler = handler
        self._timeout = handshake_timeout
        self._counters = counters
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepting = asyncio.ensure_future(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(self._sock)
            except (ConnectionAbortedError, InterruptedError):
                continue
            except OSError as exc:  # e.g. EMFILE: say so, breathe, go on
                log.error("remoting listener: accept failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            peer = format_address(addr[0], addr[1]) if isinstance(addr, tuple) else "?"
            # A place among the handshakes in progress, before any TLS work and before this
            # loop accepts the next one: none free, the connection is closed here and now
            # (admission.py counts and logs it), so that a flood of connects holds no
            # descriptor longer than this.
            place = None
            if self._gate is not None:
                place = self._gate.admit(peer_host(peer), None)
                if place is None:
                    conn.close()
                    continue
            conn.setblocking(False)
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.ensure_future(self._serve(conn, peer, place))
            if place is not None:
                place.task = task  # cancelled should a newer handshake take the place
            # Cancelled before it ran (a newer handshake took its place, a stop), the task
            # never closed its socket.
            task.add_done_callback(lambda t, c=conn: c.close() if t.cancelled() else None)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket, peer: str, place: Handshake | None) -> None:
        stream = TlsStream(conn, self._context)
        stream.handshake_place = place
        try:
            ok = await asyncio.wait_for(self._tls_handshake(stream, peer), self._timeout)
        except TimeoutError:
            log.warning("connection from %s: no TLS handshake within %g s, closed", peer,
                        self._timeout)
            self._counters.inc("handshakes_refused", reason="tls")
            ok = False
        except asyncio.CancelledError:  # a stop, or a newer handshake took its place
            if place is not None:
                place.release()
            conn.close()
            raise
        if not ok:
            if place is not None:
                place.release()
            await _linger_close(conn)
            return
        # From here the handler owns the connection, and the listener tracks its task: at a
        # stop it still tells a queued client to come back (GP_ESHUTDOWN) before it cancels
        # what is left, as in plaintext. close() cancels only connections still in their TLS
        # handshake.
        task = asyncio.current_task()
        if task is not None:
            self._tasks.discard(task)
        await self._handler(stream, stream)  # closes the stream

    async def _tls_handshake(self, stream: TlsStream, peer: str) -> bool:
        try:
            first = await stream.peek(3)
            if not first:
                log.info("connection from %s: closed before its hello", peer)
                self._counters.inc("connections")
                self._counters.inc("handshakes_refused", reason="closed")
                return False
            if not looks_like_tls(first):
                await self._refuse_plaintext(stream, peer)
                return False
            await stream.handshake()
            return True
        except (ssl.SSLError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc
            log.warning("connection from %s: TLS handshake failed (%s), closed", peer, reason)
            self._counters.inc("connections")
            self._counters.inc("handshakes_refused", reason="tls")
            return False

    async def _refuse_plaintext(self, stream: TlsStream, peer: str) -> None:
        """A plaintext client on the TLS port: answer its hello in plaintext, saying why."""
        log.warning("connection from %s: plaintext client on the TLS remoting port, refused", peer)
        self._counters.inc("connections")
        self._counters.inc("handshakes_refused", reason="tls")
        header = await stream.peek(gp.HEADER.size)
        _, op, _, req = gp.HEADER.unpack(header) if len(header) == gp.HEADER.size else (0, 0, 0, 0)
        refused = Refusal(gp.GP_EPROTO, NOT_TLS_MESSAGE)
        # An info request gets an info reply (the same result and message), anything else a
        # hello reply.
        reply = gp.encode_frame(info_refusal(refused) if op == gp.Info.OP
                                else refusal_reply(refused), req)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError):
            await asyncio.wait_for(loop.sock_sendall(stream.get_extra_info("socket"), reply), 5)

    def close(self) -> None:
        self._accepting.cancel()
        for task in list(self._tasks):
            task.cancel()
        self._sock.close()

    async def wait_closed(self) -> None:
        tasks = [self._accepting, *self._tasks]
        await asyncio.gather(*tasks, return_exceptions=True)


async def _linger_close(conn: socket.socket, linger: float = 1.0) -> None:
    """Close so that the client reads what we sent last (a TLS alert, a refusal): closing with
    its data unread (the hello it sends right after its side of a TLS 1.3 handshake) would make
    the kernel answer with a reset, which can destroy the alert before the client reads it."""
    loop = asyncio.get_running_loop()

    async def drain() -> None:
        while await loop.sock_recv(conn, 65536):
            pass

    try:
        conn.shutdown(socket.SHUT_WR)
        await asyncio.wait_for(drain(), linger)
    except (OSError, TimeoutError):
        pass
    finally:
        conn.close()


async def start_tls_server(handler: Handler, host: str, port: int, context: ssl.SSLContext,
                           handshake_timeout: float, counters: Counters,
                           sock: socket.socket | None = None,
                           gate: HandshakeGate | None = None) -> TlsServer:
    """Listen on host:port like asyncio.start_server (dual-stack for "" / "::" as it does not:
    one socket per the first address resolved), or, given `sock` (a listening socket systemd
    passed, sdlisten.py), accept on that one and ignore host and port."""
    if sock is not None:
        sock.setblocking(False)
        return TlsServer(sock, context, handler, handshake_timeout, counters, gate)
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)  # as remoting/listener.py's LISTEN_BACKLOG
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return TlsServer(sock, context, handler, handshake_timeout, counters, gate)
