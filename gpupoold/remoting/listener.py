"""The remoting listener: accept a client, check its hello, queue it for a GPU, hand it over.

The daemon reads exactly one frame per connection, the hello. It authenticates the token, checks
the client's requirements against the GPUs, queues the client until a GPU is granted (sending its
position every `queue_notice_interval` seconds), and hands the socket to the GPU's pre-started
worker. Everything after the hello is between the client and its worker; the daemon then closes
its own copy of the socket.

The first frame may be `info` instead (protocol 1.1, remoting/info.py): authenticated as a hello,
answered by the daemon with counts and a JSON document, then the connection is closed. Or
`peer_hello` (protocol 1.9): another server of the fleet asks for a link of a spread lease,
checked by remoting/peer_hello.py; accepted, the socket goes to the part's worker
(remoting/peer_links.py) once TLS is closed.

Admission (remoting/admission.py): a connection needs a place among the handshakes in progress
(taken at accept, given back once its hello is answered), and a hello or info request from an
address refused for its failed logins is refused before its token is checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import ssl
import struct
import time
from typing import Any

import gpupool_protocol as gp

from gpupoold import sdlisten
from gpupoold.auth.authenticator import AuthDecision, Authenticator
from gpupoold.config.settings import Settings, format_address, parse_address
from gpupoold.log import journal_fields
from gpupoold.pool.counters import Counters
from gpupoold.pool.fleet import PartRefused, Redirect
from gpupoold.pool.leases import LeaseManager, LeaseStartError, QueueFull, ShuttingDown, Slot
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.views import PoolViews
from gpupoold.pool.waitqueue import ClientInfo, Waiter
from gpupoold.remoting import info
from gpupoold.remoting.admission import (
    FAILED_LOGINS,
    FailedLogins,
    Handshake,
    HandshakeGate,
    Quiet,
    peer_host,
)
from gpupoold.remoting.handshake import (
    HELLO_MAX_BODY,
    Refusal,
    parse_hello,
    queue_notice,
    redirect_reply,
    refusal_reply,
    requirements_text,
    spread_redirect_reply,
)
from gpupoold.remoting.peer_hello import PLAIN_TCP, PeerHelloChecker, PeerRefused
from gpupoold.remoting.peer_links import PeerLinks
from gpupoold.remoting.tls_session import TlsStream, start_tls_server
from gpupoold.store.database import store_errors
from gpupoold.tasks import stop_task
from gpupoold.tls import remoting_ssl_context
from gpupoold.tls_identity import fingerprint_of_der_cert

log = logging.getLogger("gpupoold.remoting")

# A frame (a reply, a notice) that makes no progress towards the client for SEND_TIMEOUT seconds,
# or is not sent within SEND_LIMIT seconds, is given up on and the connection is dropped; a
# closing connection gets CLOSE_TIMEOUT seconds to flush what is left.
SEND_TIMEOUT = 5.0
SEND_LIMIT = 30.0
CLOSE_TIMEOUT = 5.0
SHUTDOWN_NOTICE_WAIT = 1.0  # seconds at stop for the queued clients to be told to come back
PEER_HANDOFF_S = 3.0  # a link's TLS session ends (close_notify both ways) within this
MAX_INFO_AT_ONCE = 32  # info requests answered at once; more wait (up to handshake_timeout)
REDIRECT_MINOR = 3  # clients of protocol 1.3 and later follow GP_EREDIRECT
# Plaintext: connections the kernel may hold before they are accepted, and (asyncio) the most
# accepted in one go before their tasks run and the gate closes those over its caps: so also
# the descriptors a flood of connects can hold at once beyond max_handshakes. (Over TLS the gate
# is asked at each accept: tls_session.py.)
LISTEN_BACKLOG = 128
BLOCKED = "blocked"  # AuthDecision.reason: the address is refused for its failed logins


class RemotingListener:
    def __init__(self, settings: Settings, leases: LeaseManager, auth: Authenticator,
                 counters: Counters, sock: socket.socket | None = None,
                 views: PoolViews | None = None) -> None:
        self.settings = settings
        self.listen = settings.listen
        self.handshake_timeout = settings.handshake_timeout
        self.leases = leases
        self.auth = auth
        self.counters = counters
        self.address = ""  # "HOST:PORT" actually bound, once started
        # Socket activation (sdlisten.py): the listening socket systemd passed, used instead of
        # binding `listen`; `source` then says so (logs, the sd_notify STATUS= line).
        self._passed = sock
        self.source = sdlisten.describe(sdlisten.REMOTING, sock) if sock is not None else ""
        self._server: asyncio.Server | Any | None = None  # TLS: or a TlsServer
        self._handshakes: set[asyncio.Task[None]] = set()
        # Fair admission (remoting/admission.py): connections in their handshake, in total and
        # per address; addresses refused for a while after too many failed logins.
        self.gate = HandshakeGate(settings.max_handshakes, settings.max_handshakes_per_address,
                                  counters)
        self.logins = FailedLogins(settings.login_failures_per_address,
                                   settings.login_failure_window, settings.login_block_seconds)
        self._log_blocked = Quiet("connection from %s refused (GP_EAUTH): %s")
        self.info = info.InfoCache(settings, views if views is not None else PoolViews(leases),
                                   leases)
        # Bounds the memory and the time that info replies (up to 4 MiB each) hold at once.
        self._info_slots = asyncio.Semaphore(MAX_INFO_AT_ONCE)
        # Server-to-server links (issue 37, item 3), set by the daemon (gpupoold/app.py); None:
        # every peer_hello is refused.
        self.peer_links: PeerLinks | None = None
        self.peer_checker: PeerHelloChecker | None = None
        # Seconds from accept to the worker's `started`, for the last few leases (benchmarks).
        self.connect_times: list[float] = []

    async def start(self) -> None:
        sock = self._passed
        host, port = parse_address(self.listen) if sock is None else ("", 0)
        # TLS (unless tls = "off"): remoting/tls_session.py runs the daemon's TLS session and
        # hands _on_connect a TlsStream as both reader and writer (TlsSettingError if misset).
        tls = await asyncio.to_thread(remoting_ssl_context, self.settings)
        if tls is not None:
            self._server = await start_tls_server(self._on_connect, host, port, tls,
                                                  self.handshake_timeout, self.counters,
                                                  sock=sock, gate=self.gate)
            log.info("the remoting listener speaks TLS (%s%s)",
                     "tls_cert" if self.settings.tls_cert else "the server's own identity",
                     ", client certificates required" if self.settings.tls_client_ca else "")
        elif sock is not None:
            self._server = await asyncio.start_server(self._on_connect, sock=sock)
        else:
            self._server = await asyncio.start_server(self._on_connect, host, port,
                                                      backlog=LISTEN_BACKLOG)
        bound = self._server.sockets[0].getsockname()
        self.address = format_address(bound[0], bound[1])
        if sock is not None:
            log.info("remoting listener on %s: %s; setting 'listen' (%s) is not used",
                     self.address, self.source, self.listen)

    async def close(self) -> None:
        """Stop accepting; tell the clients waiting in the queue to come back (GP_ESHUTDOWN: the
        shim reconnects by itself, to the next gpupoold), then drop what is left."""
        if self._server is not None:
            self._server.close()
        self.leases.stop_queue()
        if self._handshakes:
            await asyncio.wait(list(self._handshakes), timeout=SHUTDOWN_NOTICE_WAIT)
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
        peername = writer.get_extra_info("peername")
        peer = format_address(peername[0], peername[1]) if peername else "?"
        # Its place among the handshakes in progress: taken at accept over TLS (tls_session.py),
        # here in plaintext; none free: closed at once (admission.py counted and logged it).
        place: Handshake | None = getattr(writer, "handshake_place", None)
        if place is None:
            place = self.gate.admit(peer_host(peer), task)
            if place is None:
                _abort(writer)
                return
        self._handshakes.add(task)
        try:
            await self._handshake(reader, writer, peer, place)
        except asyncio.CancelledError:
            if place.evicted:
                log.debug("connection from %s: dropped for a newer handshake", peer)
            else:
                log.info("connection from %s: dropped during shutdown", peer)
        except Exception:  # a bug here must cost one connection, never the daemon
            log.exception("connection from %s: unexpected error in the handshake", peer)
        finally:
            place.release()
            try:
                await _close(writer, peer)
            finally:
                self._handshakes.discard(task)

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         peer: str, place: Handshake) -> None:
        accepted = time.monotonic()
        self.counters.inc("connections")
        try:
            frame = await asyncio.wait_for(gp.read_frame(reader, max_body=HELLO_MAX_BODY),
                                           self.handshake_timeout)
        except TimeoutError:
            log.warning("connection from %s: no hello within %g s, closed", peer,
                        self.handshake_timeout)
            self.counters.inc("handshakes_refused", reason="timeout")
            return
        except asyncio.IncompleteReadError:
            log.info("connection from %s: closed before its hello", peer)
            self.counters.inc("handshakes_refused", reason="closed")
            return
        except gp.ProtocolError as exc:
            log.warning("connection from %s: bad first frame (%s), closed", peer, exc)
            self.counters.inc("handshakes_refused", reason="malformed")
            self._request("malformed")
            await self._send(writer, gp.Notice(code=gp.GP_EPROTO, op=0,
                                               text=f"bad first frame: {exc}"), 0)
            return
        # Nothing more is read from this socket here: the rest of the stream is the worker's.
        writer.transport.pause_reading()
        if frame.op == gp.Info.OP and not frame.flags & gp.FLAG_REPLY:
            # Its place is kept until it is answered: a flood of info requests waiting for
            # their turn (MAX_INFO_AT_ONCE) is bounded by the handshake caps too.
            await self._info(writer, frame, peer)
            return
        if frame.op == gp.PeerHello.OP and not frame.flags & gp.FLAG_REPLY:
            await self._peer_hello(writer, frame, peer)  # its place kept, as info's
            return
        if frame.op != gp.Hello.OP or frame.flags & gp.FLAG_REPLY:
            log.warning("connection from %s: first frame is op %d, not hello; closed", peer,
                        frame.op)
            self.counters.inc("handshakes_refused", reason="malformed")
            self._request("malformed")
            await self._send(writer, gp.Notice(
                code=gp.GP_EPROTO, op=frame.op,
                text=f"the first frame must be hello (op {gp.Hello.OP}) or info (op {gp.Info.OP}), "
                f"got op {frame.op}"), 0)
            return
        hello = parse_hello(frame.body)
        if isinstance(hello, Refusal):
            reason = "version" if hello.result == gp.GP_EVERSION else "malformed"
            self.counters.inc("handshakes_refused", reason=reason)
            self._request(reason)
            await self._refuse(writer, frame.req, peer, hello)
            return
        if _buffered(reader):
            self.counters.inc("handshakes_refused", reason="malformed")
            self._request("malformed")
            await self._refuse(writer, frame.req, peer, Refusal(
                gp.GP_EPROTO, "the client sent data after its hello before the hello reply"))
            return
        try:
            decision = await self._login(hello.token, peer)
        except store_errors() as exc:
            await self._store_down(writer, frame.req, peer, exc)
            return
        place.release()  # the handshake is over: the queue has its own limits
        if not decision.ok:
            self.counters.inc("handshakes_refused", reason="auth")
            self._request("auth")
            await self._refuse(writer, frame.req, peer, Refusal(gp.GP_EAUTH, decision.message),
                               quiet=decision.reason == BLOCKED)
            return
        req = Requirements.from_hello(hello)
        client = ClientInfo(host=hello.host, user=hello.user, pid=hello.pid,
                            program=hello.program, peer=peer,
                            connect_timeout_ms=hello.connect_timeout_ms)
        redirectable = hello.minor >= REDIRECT_MINOR
        why = self.leases.feasible(req, redirectable)
        if why is not None:
            self.counters.inc("handshakes_refused", reason="requirements")
            self._request("requirements")
            await self._refuse(writer, frame.req, peer, Refusal(gp.GP_EREFUSED, why))
            return
        try:
            waiter = self.leases.enqueue(req, decision.identity, client,
                                         redirectable=redirectable)
        except QueueFull as exc:
            self.counters.inc("handshakes_refused", reason="queue full")
            self._request("queue_full")
            await self._refuse(writer, frame.req, peer, Refusal(gp.GP_EBUSY, str(exc)))
            return
        except ShuttingDown:
            self._request("shutdown")
            await self._refuse(writer, frame.req, peer, _SHUTDOWN)
            return
        # Keepalives while the client waits for its GPU and its worker, for a client that asked
        # (it times out a server that falls silent: docs/protocol.md, "Keepalive"). One task
        # writes at a time: the queue's loop sends them itself, a task during the start.
        wants_keepalive = bool(hello.flags & gp.GP_HELLO_KEEPALIVE)
        slot = await self._wait_for_gpu(waiter, reader, writer, frame.req, peer, wants_keepalive)
        if slot is None:
            return
        if isinstance(slot, Redirect):
            self._request("redirected")
            log.info("connection from %s: sent to GPU %d of server %s (%s), where it is held "
                     "for this client (%.1f ms after connect)%s", peer, slot.gpu, slot.server,
                     slot.address, (time.monotonic() - accepted) * 1000,
                     f"; spread lease {slot.group}: " + ", ".join(
                         f"part {k} on {p.server}" for k, p in enumerate(slot.parts))
                     if slot.parts else "")
            redirect = (spread_redirect_reply(slot.group, [
                (p.server, p.address, p.fingerprint, len(p.gpus), p.first_device)
                for p in slot.parts], req.gpus) if slot.parts
                else redirect_reply(slot.address, slot.server, slot.gpu, slot.fingerprint))
            await self._send(writer, redirect, frame.req)
            await self._end_tls(writer)
            return
        if _buffered(reader):
            self.leases.abandon(waiter)
            self.counters.inc("handshakes_refused", reason="malformed")
            self._request("malformed")
            await self._refuse(writer, frame.req, peer, Refusal(
                gp.GP_EPROTO, "the client sent data after its hello before the hello reply"))
            return
        keepalive = (asyncio.create_task(_keepalive(writer), name=f"keepalive-{peer}")
                     if wants_keepalive and not isinstance(writer, TlsStream) else None)
        try:
            await self._start_lease(writer, frame, peer, hello, client, waiter, slot, keepalive,
                                    accepted)
        finally:
            await stop_task(keepalive)

    async def _start_lease(self, writer: asyncio.StreamWriter, frame: gp.Frame, peer: str,
                           hello: gp.Hello, client: ClientInfo, waiter: Waiter, slot: Slot,
                           keepalive: asyncio.Task[None] | None, accepted: float) -> None:
        """Hand the client of a granted GPU to its worker (keepalive: the task writing
        keepalives meanwhile, stopped before anything else is written)."""
        if isinstance(writer, TlsStream):  # TLS: end our TLS session; the worker runs the next
            await stop_task(keepalive)  # nothing more of ours in that session
            try:
                await asyncio.wait_for(writer.handoff(), self.handshake_timeout)
            except (ConnectionError, ssl.SSLError, OSError, TimeoutError) as exc:
                self.leases.abandon(waiter)
                log.info("connection from %s: TLS hand-over failed (%s)", peer, exc)
                self.counters.inc("handshakes_refused", reason="tls")
                self._request("other")
                return
        sock = writer.get_extra_info("socket")
        try:
            lease = await self.leases.begin(waiter, slot, frame.body, frame.req, sock.fileno(),
                                            before_handover=lambda: stop_task(keepalive))
        except store_errors() as exc:  # the lease could not be recorded: not started
            await stop_task(keepalive)
            await self._store_down(writer, frame.req, peer, exc)
            return
        except LeaseStartError as exc:
            self._request("other")
            await stop_task(keepalive)
            if exc.message is not None:
                log.error("connection from %s: %s", peer, exc.message)
                await self._refuse(writer, frame.req, peer, Refusal(gp.GP_EREFUSED, exc.message))
            return
        self._request("granted")
        took = time.monotonic() - accepted
        self.connect_times = (self.connect_times + [took])[-1000:]
        on = ", ".join(str(i) for i in lease.gpu_indexes())  # a lease of several: all of them
        log.info("lease %d: %s on GPU %s (%s) for token %r, %s; worker pid %d, %.1f ms from "
                 "connect to the hello reply (%.1f ms queued)", lease.id, client.describe(),
                 on, slot.gpu.name, lease.token, requirements_text(hello),
                 lease.worker.pid, took * 1000, lease.queued_s * 1000,
                 extra=journal_fields(lease.id, slot.gpu.index, client.describe()))

    async def _login(self, token: str, peer: str) -> AuthDecision:
        """The token check, unless the peer's address is refused for its failed logins
        (admission.py); a refusal is counted, and counts towards that address's limit."""
        host = peer_host(peer)
        wait = self.logins.blocked_for(host)
        if wait > 0:
            self.counters.inc("admission_refused", reason=FAILED_LOGINS)
            return AuthDecision(ok=False, reason=BLOCKED, message=self.logins.message(host, wait))
        decision = await self.auth.check(token, peer)
        if decision.ok:
            return decision
        self.counters.inc("auth_refused", reason=decision.reason or "refused")
        if decision.remembered:
            self.counters.inc("admission_refused", reason="token_remembered")
        if self.logins.failed(host):
            log.warning("%s: %d failed logins within %g s; its hellos are refused for the next "
                        "%g s (login_failures_per_address)", host, self.logins.limit,
                        self.logins.window, self.logins.block)
        return decision

    def _request(self, result: str) -> None:
        """Count a lease request (a hello) by its result (`gpupool_lease_requests_total`)."""
        self.counters.inc("lease_requests", result=result)

    async def _info(self, writer: asyncio.StreamWriter, frame: gp.Frame, peer: str) -> None:
        """Answer an `info` request (remoting/info.py); the caller closes the connection. At most
        MAX_INFO_AT_ONCE are answered at once; the others wait their turn, for at most
        `handshake_timeout` seconds, then get GP_EBUSY."""
        try:
            await asyncio.wait_for(self._info_slots.acquire(), self.handshake_timeout)
        except TimeoutError:
            self.counters.inc("info_requests", result="busy")
            log.warning("connection from %s: info refused (GP_EBUSY): %d info requests were "
                        "being answered for %g s", peer, MAX_INFO_AT_ONCE, self.handshake_timeout)
            await self._send(writer, info.refusal(Refusal(gp.GP_EBUSY, (
                f"the server is answering too many info requests at once ({MAX_INFO_AT_ONCE}) "
                "and yours waited its turn for "
                f"{self.handshake_timeout:g} s (handshake_timeout); try again in a moment"))),
                frame.req)
            await self._end_tls(writer)
            return
        try:
            await self._answer_info(writer, frame, peer)
        finally:
            self._info_slots.release()

    async def _answer_info(self, writer: asyncio.StreamWriter, frame: gp.Frame,
                           peer: str) -> None:
        request = info.parse_info(frame.body)
        if isinstance(request, Refusal):
            result = "version" if request.result == gp.GP_EVERSION else "malformed"
            self.counters.inc("info_requests", result=result)
            log.warning("connection from %s: info refused (%s): %s", peer,
                        gp.RESULT_NAMES.get(request.result, str(request.result)), request.message)
            await self._send(writer, info.refusal(request), frame.req)
            await self._end_tls(writer)
            return
        decision = await self._login(request.token, peer)
        if not decision.ok:
            self.counters.inc("info_requests", result="auth")
            if decision.reason == BLOCKED:
                self._log_blocked.note(peer, decision.message)
            else:
                log.warning("connection from %s: info refused (GP_EAUTH): %s", peer,
                            decision.message)
            await self._send(writer, info.refusal(Refusal(gp.GP_EAUTH, decision.message)),
                             frame.req)
            await self._end_tls(writer)
            return
        reply = await self.info.answer(request, decision.identity, decision.role, self.address)
        self.counters.inc("info_requests", result="ok")
        log.debug("connection from %s: info for token %r on %r: %d GPUs, %d matching, %d free, "
                  "%d queued", peer, decision.identity, request.host, reply.gpus, reply.matching,
                  reply.free_matching, reply.queue)
        await self._send(writer, reply, frame.req)
        await self._end_tls(writer)

    async def _peer_hello(self, writer: asyncio.StreamWriter, frame: gp.Frame,
                          peer: str) -> None:
        """Another server's peer_hello: checked (remoting/peer_hello.py), matched with its
        worker's accept (remoting/peer_links.py), answered; then TLS ends (close_notify both
        ways) and the plain socket goes to that worker."""
        links, checker = self.peer_links, self.peer_checker
        try:
            if links is None or checker is None:
                raise PeerRefused(gp.GP_EREFUSED, "this gpupoold makes no server-to-server links")
            if not isinstance(writer, TlsStream):
                raise PeerRefused(gp.GP_EREFUSED, "this server speaks plain TCP: " + PLAIN_TCP)
            wait = self.logins.blocked_for(peer_host(peer))  # as a hello from there would be
            if wait > 0:
                self.counters.inc("admission_refused", reason=FAILED_LOGINS)
                raise PeerRefused(gp.GP_EAUTH, f"too many refused logins or peer_hellos from "
                                  f"{peer_host(peer)}; retry in {math.ceil(wait)} s")
            try:
                req = await checker.check(frame.body, _tls_client_fp(writer)
                                          if self.settings.tls_client_ca else None)
            except PeerRefused as exc:
                if exc.link_id is not None:  # authenticated: its worker may hear why
                    links.refused(exc.spread_group, exc.link_id,
                                  f"the link was refused here: {exc.message}")
                elif exc.result == gp.GP_EAUTH:  # an unknown key or a bad signature
                    self.logins.failed(peer_host(peer))
                raise
            meet = await links.arrived(req)
        except PeerRefused as exc:
            name = gp.RESULT_NAMES.get(exc.result, str(exc.result))
            log.warning("connection from %s: peer_hello refused (%s): %s", peer, name, exc.message)
            if links is not None:
                links.count("hello", "auth" if exc.result == gp.GP_EAUTH else "refused")
            await self._send(writer, gp.PeerHelloReply(result=exc.result,
                                                       message=exc.message[:1023]), frame.req)
            await self._end_tls(writer)
            return
        except store_errors() as exc:
            log.warning("connection from %s: peer_hello refused (GP_EBUSY): the fleet's database "
                        "cannot be reached (%s)", peer, exc)
            await self._send(writer, gp.PeerHelloReply(
                result=gp.GP_EBUSY, message="the fleet's database cannot be reached from this "
                "server right now; try again in a moment"), frame.req)
            await self._end_tls(writer)
            return
        sent = await self._send(writer, gp.PeerHelloReply(result=0, message=""), frame.req)
        try:
            if not sent:
                raise ConnectionError("the reply could not be sent")
            # A few seconds, not handshake_timeout: the worker waits ACCEPT_DEADLINE_S in all.
            await asyncio.wait_for(writer.handoff(notice=False), PEER_HANDOFF_S)
        except (ConnectionError, ssl.SSLError, OSError, TimeoutError) as exc:
            why = (f"not within {PEER_HANDOFF_S:g} s" if isinstance(exc, TimeoutError)
                   else "it sent link data before the TLS session ended" if "after its hello"
                   in str(exc) else str(exc) or type(exc).__name__)
            meet.fail(f"the TLS session with server {req.sender} did not end cleanly ({why})")
            log.info("connection from %s: link %d of server %s: TLS close failed (%s)", peer,
                     req.link_id, req.sender, why)
            return
        meet.deliver(os.dup(writer.get_extra_info("socket").fileno()))
        links.count("hello", "ok")
        log.info("lease %d: link %d from part %d (server %s) to part %d made", req.lease_id,
                 req.link_id, req.from_part, req.sender, req.to_part)

    @staticmethod
    async def _end_tls(writer: asyncio.StreamWriter) -> None:
        """TLS: close the session cleanly (close_notify) before the socket closes."""
        if isinstance(writer, TlsStream):
            with contextlib.suppress(ConnectionError, ssl.SSLError, OSError, TimeoutError):
                await asyncio.wait_for(writer.close_session(), SEND_TIMEOUT)

    async def _wait_for_gpu(self, waiter: Waiter, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter, req: int, peer: str,
                            keepalive: bool = False) -> Slot | Redirect | None:
        """The granted GPU (in a fleet: or another server's, a Redirect), or None when the
        client left, timed out or the daemon stops (the client has been told why, where it can
        still hear it)."""
        if waiter.future.done() and waiter.future.exception() is None:
            return waiter.future.result()  # type: ignore[no-any-return]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.queue_timeout
        # While queued, watch the connection: end of stream means the client is gone.
        writer.transport.resume_reading()
        gone = asyncio.ensure_future(reader.read(1))
        got: Slot | Redirect | None = None
        # Position notices every queue_notice_interval; keepalive beats in between (a client
        # that asked for them). This loop is the only writer to the connection meanwhile.
        notice_due = loop.time()
        beat_due = notice_due + KEEPALIVE_EVERY
        try:
            # The first beat at once, before the client can be seen queued: from it the client
            # knows that this server keeps it informed, and that silence means trouble.
            if keepalive and not await self._send(writer, _WORKING, 0):
                self._request("abandoned")
                return None
            while True:
                now = loop.time()
                pos, total = self.leases.position(waiter)
                sent: object = None
                if pos and now >= notice_due:
                    log.info("connection from %s: waiting for a GPU, position %d of %d", peer,
                             pos, total)
                    sent = queue_notice(pos, total, waiter.waited(), _local_name(writer))
                    notice_due = now + self.settings.queue_notice_interval
                elif keepalive and now >= beat_due:
                    sent = _WORKING
                if sent is not None:
                    beat_due = now + KEEPALIVE_EVERY
                    if not await self._send(writer, sent, 0):
                        log.info("connection from %s: left the queue (a notice could not be "
                                 "sent)", peer)
                        self.counters.inc("queue_abandoned")
                        self._request("abandoned")
                        return None
                left = deadline - loop.time()
                if left <= 0:
                    self.counters.inc("handshakes_refused", reason="queue timeout")
                    self._request("queue_timeout")
                    await self._refuse(writer, req, peer, Refusal(gp.GP_EBUSY, (
                        f"no GPU became free within {self.settings.queue_timeout:g} s "
                        f"(queue_timeout; you were position {pos} of {total}); try again "
                        "later, or ask the operator (`gpupoold status`)")))
                    return None
                wake = notice_due if pos else loop.time() + self.settings.queue_notice_interval
                if keepalive:
                    wake = min(wake, beat_due)
                done, _ = await asyncio.wait(
                    {waiter.future, gone}, timeout=max(0.0, min(wake - loop.time(), left)),
                    return_when=asyncio.FIRST_COMPLETED)
                if waiter.future in done:
                    failed = waiter.future.exception()
                    if isinstance(failed, PartRefused):  # a spread part with nothing held
                        self.counters.inc("handshakes_refused", reason="requirements")
                        self._request("requirements")
                        await self._refuse(writer, req, peer,
                                           Refusal(gp.GP_EREFUSED, str(failed)))
                        return None
                    if failed is not None:  # ShuttingDown
                        self._request("shutdown")
                        await self._refuse(writer, req, peer, _SHUTDOWN)
                        return None
                    got = waiter.future.result()
                    if gone.done():  # it left at the same moment
                        got = None
                        self._request("abandoned")
                        log.info("connection from %s: left the queue", peer)
                    return got
                if gone in done:
                    log.info("connection from %s: left while waiting for a GPU (%.1f s)", peer,
                             waiter.waited())
                    self.counters.inc("queue_abandoned")
                    self._request("abandoned")
                    return None
        finally:
            if got is None:
                self.leases.abandon(waiter)
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await gone
            writer.transport.pause_reading()

    async def _store_down(self, writer: asyncio.StreamWriter, req: int, peer: str,
                          exc: BaseException) -> None:
        """The store (the fleet's database) cannot be reached: no new lease can be recorded.
        The leases running go on; the client is told to try again."""
        self.counters.inc("handshakes_refused", reason="store")
        self._request("store")
        await self._refuse(writer, req, peer, Refusal(gp.GP_EBUSY, (
            "the gpupool server cannot reach its database right now "
            f"({str(exc).strip() or type(exc).__name__}), so it cannot start a lease; the "
            "leases already running go on. Try again in a moment (the server reconnects by "
            "itself)")))

    async def _refuse(self, writer: asyncio.StreamWriter, req: int, peer: str,
                      refusal: Refusal, quiet: bool = False) -> None:
        """Send a refusal; `quiet`: one of a flood, logged at most every few seconds."""
        name = gp.RESULT_NAMES.get(refusal.result, str(refusal.result))
        if quiet:
            self._log_blocked.note(peer, refusal.message)
        else:
            log.warning("connection from %s: refused (%s): %s", peer, name, refusal.message)
        await self._send(writer, refusal_reply(refusal), req)

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, msg: object, req: int) -> bool:
        """Send one frame; False when it could not be (the client is gone, or took nothing of
        it for SEND_TIMEOUT seconds, or not all of it in SEND_LIMIT: then the connection is
        dropped at once, so that neither the frame nor this task waits on the client any
        longer)."""
        try:
            writer.write(gp.encode_frame(msg, req))
            await _drain(writer)
            return True
        except TimeoutError as exc:
            log.info("could not send %s: %s; connection dropped", type(msg).__name__, exc)
            _abort(writer)
        except (ConnectionError, OSError, ssl.SSLError) as exc:
            log.info("could not send %s: %s", type(msg).__name__, exc)
        return False


_SHUTDOWN = Refusal(gp.GP_ESHUTDOWN, "the gpupool server is stopping or restarting; connect "
                    "again in a moment (gpupool clients retry by themselves)")
# Keepalive notices to a client that asked for them, while it waits for its GPU and its worker:
# twice per GP_KEEPALIVE_MS, the longest silence a client may see from a live server.
KEEPALIVE_EVERY = gp.GP_KEEPALIVE_MS / 2000
_WORKING = gp.Notice(code=gp.GP_INFO_WORKING, op=0, text="")
_KEEPALIVE_FRAME = gp.encode_frame(_WORKING, 0)


async def _keepalive(writer: asyncio.StreamWriter) -> None:
    """Keepalive notices until cancelled, or until the client stops taking them (then it is
    its own business: the hello reply's send drops it)."""
    with contextlib.suppress(ConnectionError, OSError, ssl.SSLError, TimeoutError):
        while True:
            await asyncio.sleep(KEEPALIVE_EVERY)
            writer.write(_KEEPALIVE_FRAME)
            await _drain(writer)


def _unsent(writer: asyncio.StreamWriter) -> int:
    if isinstance(writer, TlsStream):
        return writer.unsent()
    return writer.transport.get_write_buffer_size()


async def _drain(writer: asyncio.StreamWriter) -> None:
    """writer.drain(), as long as the client keeps taking what is sent: TimeoutError (saying
    why) when it takes nothing for SEND_TIMEOUT seconds, or the whole takes over SEND_LIMIT."""
    loop = asyncio.get_running_loop()
    end = loop.time() + SEND_LIMIT
    left = _unsent(writer)
    while True:
        wait = min(SEND_TIMEOUT, end - loop.time())
        try:
            await asyncio.wait_for(writer.drain(), max(wait, 0))
            return
        except TimeoutError:
            now = _unsent(writer)
            if loop.time() >= end:
                raise TimeoutError(f"the client read too slowly ({now} bytes still unsent "
                                   f"after {SEND_LIMIT:g} s)") from None
            if now >= left:
                raise TimeoutError(f"the client read nothing for {SEND_TIMEOUT:g} s") from None
            left = now


def _abort(writer: asyncio.StreamWriter) -> None:
    """Drop the connection now, with what is still unsent: a reset (SO_LINGER 0), so that the
    kernel does not keep the unsent bytes either."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _tls_client_fp(writer: asyncio.StreamWriter) -> str:
    """The fingerprint of the connection's TLS client certificate ("none": it showed none)."""
    tls = writer.get_extra_info("ssl_object")
    der = tls.getpeercert(binary_form=True) if tls is not None else None
    return fingerprint_of_der_cert(der) if der else "none"


async def _close(writer: asyncio.StreamWriter, peer: str) -> None:
    """Close the connection; what is still unsent gets CLOSE_TIMEOUT seconds to leave."""
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), CLOSE_TIMEOUT)
    except TimeoutError:
        log.info("connection from %s: the client read nothing for %g s; connection dropped",
                 peer, CLOSE_TIMEOUT)
        _abort(writer)
    except asyncio.CancelledError:
        _abort(writer)
        raise
    except Exception:  # an error of a closing connection: nothing to do
        pass


def _local_name(writer: asyncio.StreamWriter) -> str:
    """This server as the client reached it (not 0.0.0.0): host name and port."""
    sockname = writer.get_extra_info("sockname")
    port = sockname[1] if sockname else 0
    return f"{socket.gethostname()}:{port}"


def _buffered(reader: asyncio.StreamReader) -> int:
    """Bytes the stream has read past the hello (none from a well-behaved client)."""
    return len(getattr(reader, "_buffer", b""))
