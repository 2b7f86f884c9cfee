"""Server-to-server links of a spread lease (issue 37, item 3; docs/multi-gpu.md, "Across
servers"; docs/protocol.md, "Server-to-server links"): gpupoold's side.

A worker under Landlock may not open TCP, so its gpupoold does it for it and hands it the plain
socket over the control channel (SCM_RIGHTS), as it hands over a client's:
- the SENDING part's worker asks `worker_peer_connect`: `connect` finds the destination part's
  server in the fleet's store (never an address from the tenant), connects to its registered
  remoting address, pins its registered fingerprint, says a signed peer_hello
  (remoting/peer_hello.py), reads the reply, closes the TLS session cleanly (close_notify both
  ways) and answers `worker_peer_connected` with the socket;
- the RECEIVING part's worker asks `worker_peer_accept`: `accept` waits (up to
  PEER_ACCEPT_WAIT_S) for that link's peer_hello, which the remoting listener checked and
  hands here (`arrived`: either may come first), and answers `worker_peer_accepted` with it.
Any failure answers CUDA_ERROR_NOT_SUPPORTED and words: the client then copies through itself.
The worker supervisor (workers/supervisor.py) passes the workers' requests to `PeerLinks.answer`
and sends the answer back with the socket.

The connection is made in a thread (blocking ssl with one deadline for it all, `_dial`):
`ssl.SSLSocket.unwrap` gives the plain socket back after close_notify, which asyncio's TLS
streams cannot. Those threads are daemon threads of their own (DIAL_THREADS at once, at most
DIAL_QUEUE more waiting: beyond, "busy"), so that links never take asyncio's default pool from
lease ends, NVML and info, and a stopping daemon never waits for a dial.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gpupool_protocol as gp

from gpupoold.config.settings import parse_address
from gpupoold.pool.counters import Counters
from gpupoold.remoting.peer_hello import (
    PLAIN_TCP,
    PartServer,
    PeerRefused,
    PeerRequest,
    load_private_key,
    make_peer_hello,
)
from gpupoold.tls_identity import fingerprint_of_der_cert, fingerprints_equal

log = logging.getLogger(__name__)

CUDA_ERROR_NOT_SUPPORTED = 801
PEER_ACCEPT_WAIT_S = 10.0  # a link's peer_hello and its worker's accept wait this for the other
# The worker's accept, all told (the other half, then the TLS session's end): within the
# worker's own 20 s answer timeout, so it never gets a link it has given up on.
ACCEPT_DEADLINE_S = 12.0
CONNECT_TIMEOUT_S = 5.0  # to the other server's remoting port
DIAL_DEADLINE_S = 15.0  # the whole dial: connect, TLS, peer_hello, its reply (up to
# PEER_ACCEPT_WAIT_S on the other side), close_notify
DIAL_THREADS = 4  # dials at once (each a thread for up to DIAL_DEADLINE_S)...
DIAL_QUEUE = 8  # ...and waiting for one of them; beyond, a link request is refused ("busy")
CERT_MAX = 8192  # the peer_hello's certificate field (protocol/gpupool.toml)
REPLY_MAX_BODY = 4096
# What the operator can do; the client adds what it does meanwhile (its spread_copy mode).
THROUGH_CLIENT = "open the remoting port between the fleet's servers"


@dataclass(frozen=True)
class PeerIdentity:
    """This server's remoting TLS identity, which signs its peer_hellos and is its client
    certificate towards the other servers."""

    cert: Path
    key: Path
    fingerprint: str


class LinkFailed(Exception):
    """No link: the worker gets CUDA_ERROR_NOT_SUPPORTED and this message."""


@dataclass
class _Rendezvous:
    """A link's two halves on the receiving server: the worker's accept and the peer_hello."""

    lease_id: int
    group: int  # the lease's spread_group
    from_part: int = -1  # as the worker said it (-1: not yet)
    asked: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    came: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    sock: asyncio.Future[int] = field(  # the link's fd, or LinkFailed
        default_factory=lambda: asyncio.get_running_loop().create_future())

    def deliver(self, fd: int) -> None:
        """The link's socket (this takes it over) for the waiting worker."""
        if self.sock.done():
            os.close(fd)
        else:
            self.sock.set_result(fd)

    def fail(self, message: str) -> None:
        if not self.sock.done():
            self.sock.set_exception(LinkFailed(message))
            self.sock.exception()  # whoever waits still gets it; nobody waiting is no error


class PeerLinks:
    """The links of this server's spread leases. `lease_part(session_id)`: (spread_group, part)
    of the lease a worker serves (None: no such lease running); `part_server(group, part)`: where
    a part runs (the store)."""

    def __init__(self, server: str, identity: PeerIdentity | None,
                 lease_part: Callable[[int], tuple[int, int] | None],
                 part_server: Callable[[int, int], Awaitable[PartServer | None]],
                 counters: Counters | None = None) -> None:
        self.server = server
        self.identity = identity
        self._lease_part = lease_part
        self._part_server = part_server
        self._counters = counters if counters is not None else Counters()
        self._waiting: dict[tuple[int, int], _Rendezvous] = {}
        self._dial_threads = asyncio.Semaphore(DIAL_THREADS)  # its waiters: the queue
        self._dialing = 0  # dials running or queued
        self._closed = False
        self._key: Any = None
        self._cert_der = b""
        self._context: ssl.SSLContext | None = None

    # ----------------------------------------------------------------- the sending side
    async def connect(self, session_id: int, link_id: int, to_part: int) -> int:
        """The plain socket (fd) of a link to part `to_part` of the session's spread lease, its
        peer_hello answered; LinkFailed saying why not."""
        group, part = self._spread_of(session_id)
        if self.identity is None:
            raise LinkFailed("this server speaks plain TCP: " + PLAIN_TCP)
        if to_part == part:
            raise LinkFailed(f"part {to_part} is this server's own part of the lease")
        where = await self._part_server(group, to_part)
        if where is None:
            raise LinkFailed(f"no server of the fleet holds part {to_part} of spread lease "
                             f"{group} now")
        if not where.up:
            raise LinkFailed(f"server {where.server}, which holds part {to_part}, is marked down")
        if not where.fingerprint:
            raise LinkFailed(f"server {where.server} speaks plain TCP: {PLAIN_TCP}")
        if self._context is None:
            try:
                self._key, self._cert_der, self._context = await asyncio.to_thread(
                    _load_identity, self.identity)
            except (OSError, ValueError, ssl.SSLError) as exc:
                raise LinkFailed(f"this server's TLS identity ({self.identity.cert}, "
                                 f"{self.identity.key}) cannot sign a peer_hello: {exc}"
                                 ) from None
        key, cert_der, ctx = self._key, self._cert_der, self._context
        if len(cert_der) > CERT_MAX:
            raise LinkFailed(f"this server's certificate ({self.identity.cert}) is "
                             f"{len(cert_der)} bytes, and a peer_hello carries at most {CERT_MAX}: "
                             "use a shorter certificate (an EC key, no long chain of names)")
        if self._closed:
            raise LinkFailed("this gpupoold is stopping")
        if self._dialing >= DIAL_THREADS + DIAL_QUEUE:
            raise LinkFailed(f"this server is busy making {self._dialing} links; a later copy "
                             "tries again")

        def hello() -> gp.PeerHello:
            return make_peer_hello(key, cert_der, where.fingerprint, group, part, to_part,
                                   link_id)

        self._dialing += 1
        try:
            async with self._dial_threads:
                sock = await _in_thread(_dial, where.remoting, where.fingerprint, ctx, hello)
        except PeerRefused as exc:
            raise LinkFailed(f"server {where.server} ({where.remoting}) refused the link "
                             f"({gp.RESULT_NAMES.get(exc.result, exc.result)}): {exc.message}"
                             ) from None
        except DialBroken as exc:
            raise LinkFailed(f"the link to server {where.server} ({where.remoting}) failed: "
                             f"{exc}; see both servers' logs") from None
        except (OSError, ssl.SSLError, ValueError, gp.ProtocolError) as exc:
            why = "timed out" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
            raise LinkFailed(f"server {where.server} ({where.remoting}) could not be reached "
                             f"from this server: {why}; {THROUGH_CLIENT}") from None
        finally:
            self._dialing -= 1
        return sock.detach()

    def close(self) -> None:
        """The daemon stops: dials in flight are not waited for (daemon threads: each ends by
        its deadline, and its socket, which nobody takes, is closed)."""
        self._closed = True

    def _spread_of(self, session_id: int) -> tuple[int, int]:
        spread = self._lease_part(session_id)
        if spread is None:
            raise LinkFailed(f"session {session_id} is not running on this server")
        if spread[0] == 0:
            raise LinkFailed("the lease is not spread over several servers: its devices "
                             "copy between themselves on this server")
        return spread

    # ----------------------------------------------------------------- the receiving side
    async def accept(self, session_id: int, link_id: int, from_part: int) -> int:
        """The link's socket (fd) once the peer_hello of part `from_part`'s server for
        `link_id` came (before or within PEER_ACCEPT_WAIT_S); LinkFailed otherwise."""
        group, _ = self._spread_of(session_id)
        key = (session_id, link_id)
        meet = self._waiting.get(key)
        if meet is None:
            meet = self._waiting[key] = _Rendezvous(session_id, group)
        if meet.asked.done():
            raise LinkFailed(f"link {link_id} was already asked for")
        meet.from_part = from_part
        meet.asked.set_result(None)
        taken = False
        deadline = time.monotonic() + ACCEPT_DEADLINE_S
        try:
            await asyncio.wait([meet.came, meet.sock], timeout=PEER_ACCEPT_WAIT_S,
                               return_when=asyncio.FIRST_COMPLETED)
            if not (meet.came.done() or meet.sock.done()):
                raise LinkFailed(f"no server connected for link {link_id} from part {from_part} "
                                 f"of spread lease {group} within {PEER_ACCEPT_WAIT_S:g} s; "
                                 f"{THROUGH_CLIENT}")
            try:
                await asyncio.wait_for(asyncio.shield(meet.sock),
                                       max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise LinkFailed(f"the connection for link {link_id} was not handed over within "
                                 f"{ACCEPT_DEADLINE_S:g} s of the request") from None
            taken = True
            return meet.sock.result()  # LinkFailed: the listener's words
        finally:
            if self._waiting.get(key) is meet:
                del self._waiting[key]
            meet.fail("the worker stopped waiting")
            if not taken and meet.sock.exception() is None:
                os.close(meet.sock.result())  # delivered as the worker gave up

    async def arrived(self, req: PeerRequest) -> _Rendezvous:
        """A checked peer_hello (the remoting listener's): its worker's accept, once asked for
        (within PEER_ACCEPT_WAIT_S). The caller replies, ends TLS, then `deliver`s the socket or
        `fail`s. PeerRefused (GP_EREFUSED) when the worker never asks or names another part."""
        key = (req.lease_id, req.link_id)
        meet = self._waiting.get(key)
        if meet is None:
            meet = self._waiting[key] = _Rendezvous(req.lease_id, req.spread_group)
        if meet.came.done():
            raise PeerRefused(gp.GP_EREFUSED, f"link {req.link_id} is already connected")
        meet.came.set_result(None)
        # The worker's accept, or the lease's end (which fails `sock`): never the whole wait
        # holding this connection's handshake place for a lease that is gone.
        await asyncio.wait([meet.asked, meet.sock], timeout=PEER_ACCEPT_WAIT_S,
                           return_when=asyncio.FIRST_COMPLETED)
        if meet.sock.done():
            exc = meet.sock.exception()
            if self._waiting.get(key) is meet:
                del self._waiting[key]
            raise PeerRefused(gp.GP_EREFUSED, f"link {req.link_id}: "
                              f"{exc if exc is not None else 'already handed over'}")
        if not meet.asked.done():
            self._waiting.pop(key, None)
            raise PeerRefused(gp.GP_EREFUSED, f"the worker of part {req.to_part} did not ask for "
                              f"link {req.link_id} within {PEER_ACCEPT_WAIT_S:g} s")
        if meet.from_part != req.from_part:
            message = (f"link {req.link_id} was asked for from part {meet.from_part}, and server "
                       f"{req.sender} connected from part {req.from_part}")
            meet.fail(message)
            raise PeerRefused(gp.GP_EREFUSED, message)
        return meet

    def lease_ended(self, lease_id: int) -> None:
        """Fail the links still waiting for the lease (its worker is gone)."""
        for key, meet in list(self._waiting.items()):
            if key[0] == lease_id:
                del self._waiting[key]
                meet.fail("the lease ended")

    def refused(self, group: int, link_id: int, message: str) -> None:
        """A peer_hello for `link_id` of spread lease `group` that authenticated and was
        refused: the worker waiting for that link gets the words (an unauthenticated one touches
        no link, nor does one for another lease's link of that id)."""
        for key, meet in list(self._waiting.items()):
            if key[1] == link_id and meet.group == group and meet.asked.done():
                meet.fail(message)
                if not meet.came.done():
                    meet.came.set_result(None)

    def count(self, side: str, result: str) -> None:
        """`gpupool_peer_links_total{side, result}`: side `connect`/`accept` (a worker's
        request: "ok" or "refused"), `hello` (another server's peer_hello: "ok", "refused",
        "auth")."""
        self._counters.inc("peer_links", side=side, result=result)

    async def answer(self, session_id: int | None, ev: Any) -> tuple[Any, int | None]:
        """The worker supervisor's entry (workers/supervisor.py): `answer` below."""
        return await answer(self, session_id, ev)


async def answer(links: PeerLinks | None, session_id: int | None,
                 ev: Any) -> tuple[Any, int | None]:
    """The answer to a worker's request of REQUESTS for the worker serving `session_id` (not
    what the message claims): the message to send back and the fd to send with it (the caller
    closes it once sent), or None."""
    connect = isinstance(ev, gp.WorkerPeerConnect)
    side = "connect" if connect else "accept"
    fd: int | None = None
    try:
        if links is None:
            raise LinkFailed("this gpupoold makes no server-to-server links now (it is "
                             "stopping)")
        if session_id is None or ev.session_id != session_id:
            raise LinkFailed(f"the worker asked for session {ev.session_id}, which it does not "
                             "serve")
        fd = (await links.connect(session_id, ev.link_id, ev.to_part) if connect
              else await links.accept(session_id, ev.link_id, ev.from_part))
        code, error = 0, ""
        links.count(side, "ok")
    except Exception as exc:  # LinkFailed; or a bug, which costs this link (the worker hears it)
        if not isinstance(exc, LinkFailed):
            log.exception("[session %s] link %d (%s): unexpected error", session_id, ev.link_id,
                          side)
        code = CUDA_ERROR_NOT_SUPPORTED
        error = str(exc) if isinstance(exc, LinkFailed) else (
            f"gpupoold could not make the link ({type(exc).__name__}: {exc}); see its "
            "log")
        if links is not None:
            links.count(side, "refused")
        log.info("[session %s] link %d (%s): %s", session_id, ev.link_id, side, error)
    cls = gp.WorkerPeerConnected if connect else gp.WorkerPeerAccepted
    return cls(session_id=ev.session_id, link_id=ev.link_id, code=code, error=error[:1023]), fd


def _load_identity(identity: PeerIdentity) -> tuple[Any, bytes, ssl.SSLContext]:
    """The signing key, the certificate (DER) and the client TLS context (its certificate
    presented; the server's checked by pin, not by a CA)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    key = load_private_key(identity.key.read_bytes())
    # (the first certificate of the file; text before it, as openssl x509 -text writes, is fine)
    der = x509.load_pem_x509_certificate(identity.cert.read_bytes()).public_bytes(
        serialization.Encoding.DER)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the registered fingerprint is checked instead (_dial)
    ctx.load_cert_chain(str(identity.cert), str(identity.key))
    return key, der, ctx


async def _in_thread(fn: Callable[..., socket.socket], *args: Any) -> socket.socket:
    """fn(*args) in a daemon thread of its own: never asyncio's default pool (lease ends, NVML,
    info share it), and never joined at exit. A result nobody takes any more is closed."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[socket.socket] = loop.create_future()

    def settle(result: socket.socket | None, exc: BaseException | None) -> None:
        if done.cancelled():
            if result is not None:
                result.close()
        elif exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # noqa: BLE001 (handed to the waiting coroutine)
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the loop is closed: the daemon stopped
            if result is not None:
                result.close()

    threading.Thread(target=run, name="peer-dial", daemon=True).start()
    return await done


class DialBroken(Exception):
    """The other server was reached and the link's set-up failed after: what failed, in words."""


def _dial(address: str, fingerprint: str, ctx: ssl.SSLContext,
          hello: Callable[[], gp.PeerHello]) -> socket.socket:
    """(In a thread.) Connect, pin, say peer_hello, read the reply, close TLS both ways, all
    within DIAL_DEADLINE_S: the plain socket. OSError before the connection is made (the port
    cannot be reached), PeerRefused for a refusal, DialBroken for anything after."""
    deadline = time.monotonic() + DIAL_DEADLINE_S
    host, port = parse_address(address)
    raw = socket.create_connection((host, port), timeout=min(CONNECT_TIMEOUT_S, DIAL_DEADLINE_S))
    try:
        raw.settimeout(_left(deadline))
        tls = ctx.wrap_socket(raw, server_hostname=None)
    except ssl.SSLError as exc:
        raw.close()
        raise DialBroken(_tls_failure(exc)) from None
    except BaseException as exc:
        raw.close()
        raise DialBroken(_broken(exc)) from None
    try:
        der = tls.getpeercert(binary_form=True)
        found = fingerprint_of_der_cert(der) if der else "none"
        if not fingerprints_equal(found, fingerprint):
            raise PeerRefused(gp.GP_EAUTH, f"its certificate's key is {found}, and the fleet's "
                              f"database registers {fingerprint} for it: another machine "
                              "answers at its address, or its key changed without a restart")
        tls.settimeout(_left(deadline))
        tls.sendall(gp.encode_frame(hello(), 1))
        tls.settimeout(_left(deadline))
        length, op, flags, _ = gp.parse_header(_read_exactly(tls, gp.HEADER.size),
                                               REPLY_MAX_BODY)
        body = _read_exactly(tls, length)
        if op != gp.PeerHello.OP or not flags & gp.FLAG_REPLY:
            if op == gp.Hello.OP or op == gp.Notice.OP:  # an older server's refusal
                raise PeerRefused(gp.GP_EVERSION, "that server's gpupoold does not know "
                                  "peer_hello (protocol 1.9): upgrade it")
            raise gp.ProtocolError(f"it answered op {op} to peer_hello")
        reply = gp.PeerHelloReply.decode(body, allow_trailing=True)
        if reply.result != 0:
            raise PeerRefused(reply.result, reply.message)
        tls.settimeout(_left(deadline))
        plain = tls.unwrap()  # close_notify both ways: nothing of TLS is left on the socket
    except PeerRefused:
        with contextlib.suppress(OSError):
            tls.close()
        raise
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tls.close()
        if isinstance(exc, ssl.SSLError):
            raise DialBroken(_tls_failure(exc)) from None
        if isinstance(exc, Exception):
            raise DialBroken(_broken(exc)) from None
        raise
    plain.settimeout(None)
    return plain


def _left(deadline: float) -> float:
    """What is left of the dial's deadline (TimeoutError once it has passed)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _tls_failure(exc: ssl.SSLError) -> str:
    text = str(exc)
    if "alert" in text.lower():
        return (f"the other server ended the TLS handshake ({exc.reason or text}): if it sets "
                "tls_client_ca, that CA must sign this server's certificate (tls_cert)")
    return f"TLS failed ({exc.reason or text})"


def _broken(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return (f"it connected, and the link was not set up within {DIAL_DEADLINE_S:g} s "
                "(the other server is overloaded, or its gpupoold is stuck)")
    if isinstance(exc, ConnectionError):
        return (str(exc) if not exc.errno else
                f"the other server closed the connection ({exc.strerror or exc})")
    if isinstance(exc, (gp.ProtocolError, ValueError)):
        return f"the other server answered something this server cannot read ({exc})"
    return f"{type(exc).__name__}: {exc}"


def _read_exactly(sock: ssl.SSLSocket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the other server closed the connection")
        data += chunk
    return bytes(data)
