"""The remoting listener: accept a client, read and check its hello, hand the socket to a worker.

The daemon reads exactly one frame per connection. Everything after the hello is between the
client and its worker: once the worker has the socket, the daemon closes its own copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import gpupool_protocol as gp

from gpupoold.auth import Authenticator
from gpupoold.handshake import HELLO_MAX_BODY, Refusal, parse_hello, refusal_reply
from gpupoold.scheduler import NoGpu, Scheduler
from gpupoold.sessions import Session, SessionRegistry
from gpupoold.settings import format_address, parse_address
from gpupoold.workers import WorkerStartError, WorkerSupervisor

log = logging.getLogger("gpupoold.remoting")


class RemotingListener:
    def __init__(self, listen: str, handshake_timeout: float, scheduler: Scheduler,
                 sessions: SessionRegistry, supervisor: WorkerSupervisor,
                 auth: Authenticator) -> None:
        self.listen = listen
        self.handshake_timeout = handshake_timeout
        self.scheduler = scheduler
        self.sessions = sessions
        self.supervisor = supervisor
        self.auth = auth
        self.address = ""  # "HOST:PORT" actually bound, once started
        self._server: asyncio.Server | None = None
        self._handshakes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        host, port = parse_address(self.listen)
        self._server = await asyncio.start_server(self._on_connect, host, port)
        bound = self._server.sockets[0].getsockname()
        self.address = format_address(bound[0], bound[1])

    async def close(self) -> None:
        """Stop accepting and drop connections still in their handshake."""
        if self._server is not None:
            self._server.close()
        for task in list(self._handshakes):
            task.cancel()
        if self._handshakes:
            await asyncio.wait(list(self._handshakes))
        if self._server is not None:
            await self._server.wait_closed()

    async def _on_connect(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handshakes.add(task)
        peername = writer.get_extra_info("peername")
        peer = format_address(peername[0], peername[1]) if peername else "?"
        try:
            await self._handshake(reader, writer, peer)
        except asyncio.CancelledError:
            log.info("connection from %s: dropped during shutdown", peer)
        except Exception:  # a bug here must cost one connection, never the daemon
            log.exception("connection from %s: unexpected error in the handshake", peer)
        finally:
            self._handshakes.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         peer: str) -> None:
        try:
            frame = await asyncio.wait_for(gp.read_frame(reader, max_body=HELLO_MAX_BODY),
                                           self.handshake_timeout)
        except TimeoutError:
            log.warning("connection from %s: no hello within %g s, closed", peer,
                        self.handshake_timeout)
            return
        except asyncio.IncompleteReadError:
            log.info("connection from %s: closed before its hello", peer)
            return
        except gp.ProtocolError as exc:
            log.warning("connection from %s: bad first frame (%s), closed", peer, exc)
            await self._send(writer, gp.Notice(code=gp.GP_EPROTO, op=0,
                                               text=f"bad first frame: {exc}"), 0)
            return
        # Nothing more is read from this socket here: the rest of the stream is the worker's.
        writer.transport.pause_reading()
        if frame.op != gp.Hello.OP or frame.flags & gp.FLAG_REPLY:
            log.warning("connection from %s: first frame is op %d, not hello; closed", peer,
                        frame.op)
            await self._send(writer, gp.Notice(
                code=gp.GP_EPROTO, op=frame.op,
                text=f"the first frame must be hello (op {gp.Hello.OP}), got op {frame.op}"), 0)
            return
        hello = parse_hello(frame.body)
        if isinstance(hello, Refusal):
            await self._refuse(writer, frame.req, peer, hello)
            return
        if _buffered(reader):
            await self._refuse(writer, frame.req, peer, Refusal(
                gp.GP_EPROTO, "the client sent data after its hello before the hello reply"))
            return
        decision = await self.auth.check(hello.token, peer)
        if not decision.ok:
            await self._refuse(writer, frame.req, peer, Refusal(gp.GP_EAUTH, decision.message))
            return
        try:
            gpu = self.scheduler.pick(hello.device_request)
        except NoGpu as exc:
            await self._refuse(writer, frame.req, peer, Refusal(gp.GP_EREFUSED, str(exc)))
            return
        session = Session(id=self.sessions.new_id(), gpu=gpu.index, peer=peer,
                          client_host=hello.host, client_user=hello.user,
                          client_pid=hello.pid, program=hello.program)
        sharing = len(self.sessions.on_gpu(gpu.index))
        sock = writer.get_extra_info("socket")
        fd = os.dup(sock.fileno())
        try:
            await self.supervisor.start(session, gpu, fd, frame.body, frame.req)
        except WorkerStartError as exc:
            log.error("session %d: %s", session.id, exc)
            await self._refuse(writer, frame.req, peer, Refusal(gp.GP_EREFUSED, str(exc)))
            return
        finally:
            os.close(fd)
        log.info("session %d: %s on GPU %d (%s), worker pid %s", session.id,
                 session.describe(), gpu.index, gpu.name, session.worker_pid)
        if sharing:
            log.info("session %d: GPU %d is shared with %d other session(s) "
                     "(exclusive leases come later)", session.id, gpu.index, sharing)

    async def _refuse(self, writer: asyncio.StreamWriter, req: int, peer: str,
                      refusal: Refusal) -> None:
        name = gp.RESULT_NAMES.get(refusal.result, str(refusal.result))
        log.warning("connection from %s: refused (%s): %s", peer, name, refusal.message)
        await self._send(writer, refusal_reply(refusal), req)

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, msg: object, req: int) -> None:
        try:
            writer.write(gp.encode_frame(msg, req))
            await asyncio.wait_for(writer.drain(), timeout=5)
        except (ConnectionError, TimeoutError) as exc:
            log.info("could not send %s: %s", type(msg).__name__, exc)


def _buffered(reader: asyncio.StreamReader) -> int:
    """Bytes the stream has read past the hello (none from a well-behaved client)."""
    return len(getattr(reader, "_buffer", b""))
