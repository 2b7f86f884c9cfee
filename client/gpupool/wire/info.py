"""The `info` request (protocol 1.1): what a server has, without taking a GPU.

One connection per request: connect, send `info` as the first frame, read the reply; gpupoold
then closes the connection. `document` turns the reply's records into the dictionary `gpupool
status`, `smi` and `doctor` read (and `status --json` prints), with the HTTP API's names.

Trust follows the shims' rules (client/common/tls.c), asked of the same C code through
libgpupool-config.so (gpupool.config.trust_problem, check_pin), so the command and programs
never disagree about a server:
- plain TCP only when the server's settings say tls = false (GPUPOOL_TLS=0);
- TLS with a pin (tls_fingerprint / GPUPOOL_TLS_FINGERPRINT): no chain or host name to check
  (the server's certificate is self-signed); after the handshake the key it presents must be the
  pinned one, before a byte of ours is written;
- TLS with a CA (tls_ca): the chain and the host name are checked (and the pin too when both
  are set);
- neither: refused before connecting, with the one line that names `gpupool login HOST:PORT`.
`gpupool login` alone connects without either ("learn", peer_identity) to show the user the
fingerprint; it sends nothing on that connection.
"""

from __future__ import annotations

import math
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import gpupool_protocol as gp

from gpupool.config import (
    ConfigError,
    ServerConfig,
    check_pin,
    fingerprint_of_cert,
    format_number,
    server_desc,
    trust_problem,
)
from gpupool.wire.frames import Frame, read_frame, send_message

INFO_REQ = 1
NOTICE_OP = 3


# WireError kinds where this client refused the server, not the other way round: nothing
# secret was sent. "trust": neither a pin nor a CA (not even connected); "identity": the key it
# presents is not the pinned one (or it presented none).
TRUST_KINDS = ("trust", "identity")


class WireError(Exception):
    """The server could not be reached, was not trusted, or did not answer `info` properly: one
    line, why. `kind` says which step failed: trust, connect, tls, identity, protocol."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind

    @property
    def refused_by_us(self) -> bool:
        """This client refused the server (TRUST_KINDS): nothing secret was sent."""
        return self.kind in TRUST_KINDS


@dataclass
class InfoResult:
    result: int  # 0 or a GP_E* code (then `message` says why)
    message: str
    major: int  # the server's protocol version
    minor: int
    server: str  # "gpupoold VERSION on HOST"
    gpus: int
    matching: int
    free_matching: int
    queue: int
    data: dict[str, Any] = field(default_factory=dict)  # document(reply) ({} on refusal)
    elapsed_s: float = 0.0
    tls_version: str = ""  # "TLSv1.3" over TLS, "" for plain TCP
    identity: str = ""  # the fingerprint of the key that answered (TLS), checked as configured

    @property
    def ok(self) -> bool:
        return self.result == 0

    def result_name(self) -> str:
        return gp.RESULT_NAMES.get(self.result, str(self.result))


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return max(0.001, deadline - time.monotonic())


def _tls_context(srv: ServerConfig, verify: bool) -> ssl.SSLContext:
    """With `verify`, the CA's rules (tls_ca: chain and host name); without, none: the pin
    checked after the handshake is the identity (or, for `gpupool login`, the user's eyes)."""
    if verify:
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=srv.tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise WireError(f"TLS: cannot use the CA file {srv.tls_ca} "
                            f"({getattr(exc, 'strerror', None) or exc}); set tls_ca "
                            "(GPUPOOL_TLS_CA) to a PEM file of CA certificates", "tls") from None
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if srv.tls_cert:
        try:
            ctx.load_cert_chain(srv.tls_cert, srv.tls_key or None)
        except (OSError, ssl.SSLError) as exc:
            raise WireError(f"TLS: cannot use the client certificate {srv.tls_cert} with the "
                            f"key {srv.tls_key} ({getattr(exc, 'strerror', None) or exc}); set "
                            "tls_cert and tls_key (GPUPOOL_TLS_CERT / GPUPOOL_TLS_KEY) to a PEM "
                            "chain and its unencrypted key", "tls") from None
    return ctx


def _tls_error(exc: ssl.SSLError, srv: ServerConfig) -> WireError:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return WireError(f"TLS: the server's certificate was not accepted "
                         f"({exc.verify_message}); set tls_ca (GPUPOOL_TLS_CA) to the CA "
                         "certificate that signed it (PEM) and connect with the host name the "
                         "certificate names", "tls")
    why = exc.reason or str(exc)
    low = str(exc).lower()
    if any(w in low for w in ("wrong version number", "packet length too long",
                              "record layer failure", "unexpected eof", "record_layer")):
        return WireError(f"TLS handshake failed ({why}): the server does not speak TLS on this "
                         "port (a gpupoold with tls = \"off\", or older than TLS by default); "
                         "ask its operator to turn TLS on, or, on a network you trust, use it "
                         f"in plain TCP: `gpupool login {server_desc(srv)} --plain` (tls = "
                         "false for this server)", "tls")
    if "certificate required" in low or "handshake failure" in low:
        return WireError(f"TLS handshake failed ({why}): the server requires a client "
                         "certificate that its tls_client_ca signed: set tls_cert and tls_key "
                         "(GPUPOOL_TLS_CERT, GPUPOOL_TLS_KEY)", "tls")
    if "unknown ca" in low or "bad certificate" in low or "certificate" in low:
        return WireError(f"TLS: the server did not accept the client certificate ({why}): use "
                         "one that its tls_client_ca signed (tls_cert, GPUPOOL_TLS_CERT)", "tls")
    return WireError(f"TLS handshake failed ({why})", "tls")


def _judge(srv: ServerConfig) -> None:
    """WireError "trust" when `srv` may not be sent a token (the shims' rule)."""
    try:
        problem = trust_problem(srv)
    except ConfigError as exc:
        raise WireError(str(exc), "trust") from None
    if problem:
        raise WireError(problem, "trust")


def _peer_cert(sock: ssl.SSLSocket) -> bytes:
    der = sock.getpeercert(binary_form=True)
    if not der:
        raise WireError("TLS: the server sent no certificate, so its identity cannot be "
                        "checked: nothing was sent", "identity")
    return der


def _check_identity(sock: ssl.SSLSocket, srv: ServerConfig) -> None:
    """The key the server presents against the pin, before a byte of ours is written."""
    if not srv.tls_fingerprint:
        return
    try:
        problem = check_pin(_peer_cert(sock), srv.tls_fingerprint, server_desc(srv))
    except ConfigError as exc:
        raise WireError(str(exc), "identity") from None
    if problem:
        raise WireError(problem, "identity")


def connect(srv: ServerConfig, timeout: float, learn: bool = False) -> socket.socket:
    """A connected socket to the server (TLS-wrapped and its identity checked per its
    settings). WireError says why not; a server this client does not trust is refused before
    connecting. `timeout` 0 means no limit. `learn` (gpupool login only): TLS without any check
    of who answers, for the caller to show the fingerprint; nothing may be sent on it."""
    if learn and not srv.tls:
        raise AssertionError("learn needs TLS")  # a bug of ours: plain TCP has no identity
    if not learn:
        _judge(srv)
    deadline = time.monotonic() + timeout if timeout > 0 else None
    limit = f"timed out after {format_number(timeout)} s"
    try:
        sock = socket.create_connection((srv.host, int(srv.port)), timeout=_remaining(deadline))
    except socket.gaierror as exc:
        raise WireError(f"cannot resolve {srv.host}: {exc.strerror}; check the address",
                        "connect") from None
    except ConnectionRefusedError:
        raise WireError("connection refused", "connect") from None
    except (socket.timeout, TimeoutError):
        raise WireError(limit, "connect") from None
    except OSError as exc:
        raise WireError(exc.strerror or str(exc), "connect") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not srv.tls:
            return sock
        ctx = _tls_context(srv, verify=bool(srv.tls_ca) and not learn)
        sock.settimeout(_remaining(deadline))
        try:
            tls = ctx.wrap_socket(sock, server_hostname=srv.host)
        except ssl.SSLError as exc:
            raise _tls_error(exc, srv) from None
        except (socket.timeout, TimeoutError):
            raise WireError(f"TLS handshake {limit}", "tls") from None
        except OSError as exc:
            raise WireError(f"TLS handshake failed: {exc.strerror or exc}: the server does not "
                            "speak TLS on this port, or closed the connection", "tls") from None
        try:
            if not learn:
                _check_identity(tls, srv)
        except BaseException:
            tls.close()
            raise
        return tls
    except BaseException:
        sock.close()
        raise


@dataclass
class PeerIdentity:
    """Who answered a `learn` connection: its certificate and the fingerprint of its key."""

    der: bytes
    fingerprint: str


def peer_identity(srv: ServerConfig, timeout: float) -> PeerIdentity:
    """Connect with TLS, take the server's certificate and close: nothing but the handshake
    crosses (no token, no frame). For `gpupool login`, which shows the fingerprint to the user
    (or compares it with --fingerprint) before anything secret is sent."""
    sock = connect(srv, timeout, learn=True)
    assert isinstance(sock, ssl.SSLSocket)
    with sock:
        der = _peer_cert(sock)
    try:
        return PeerIdentity(der, fingerprint_of_cert(der))
    except ConfigError as exc:
        raise WireError(f"TLS: cannot read the server's certificate ({exc})", "identity") \
            from None


def identity_of(sock: socket.socket) -> str:
    """The fingerprint of the key a TLS peer presented ("" for plain TCP)."""
    if not isinstance(sock, ssl.SSLSocket):
        return ""
    der = sock.getpeercert(binary_form=True)
    try:
        return fingerprint_of_cert(der) if der else ""
    except ConfigError:
        return ""


def _read_reply(sock: socket.socket, srv: ServerConfig, deadline: float | None,
                timeout: float) -> Frame:
    while True:
        sock.settimeout(_remaining(deadline))
        try:
            frame = read_frame(sock)
        except (socket.timeout, TimeoutError):
            raise WireError(f"no answer to info: timed out after {format_number(timeout)} s",
                            "protocol") from None
        except EOFError:
            raise WireError("the server closed the connection without answering info; is it "
                            "a gpupoold remoting port?", "protocol") from None
        except gp.ProtocolError as exc:
            raise WireError(f"not a gpupoold remoting port? Its answer is not a gpupool frame "
                            f"({exc})", "protocol") from None
        except ssl.SSLError as exc:
            raise _tls_error(exc, srv) from None
        except OSError as exc:
            raise WireError(f"reading the answer: {exc.strerror or exc}", "protocol") from None
        if frame.op == gp.InfoReply.OP and frame.flags & gp.FLAG_REPLY:
            return frame
        if frame.op == NOTICE_OP and not frame.flags & gp.FLAG_REPLY:
            try:
                notice = gp.Notice.decode(frame.body)
            except gp.ProtocolError as exc:
                raise WireError(f"the server sent a malformed notice ({exc})", "protocol") \
                    from None
            if notice.code in gp.INFO_CODES:
                continue
            if "must be hello" in notice.text:
                raise WireError(f"server {srv.address} speaks protocol 1.0; this client needs "
                                f"{gp.MAJOR}.{gp.MINOR} for info: upgrade gpupoold", "protocol")
            raise WireError(f"the server said: {notice.text}", "protocol")
        raise WireError(f"the server answered info with op {frame.op} (flags {frame.flags}); "
                        "is it a gpupoold of this version?", "protocol")


def fetch_info(srv: ServerConfig, timeout: float, gpu: str = "", model: str = "",
               min_memory: int = 0, host: str | None = None) -> InfoResult:
    """Ask `srv` for info with these requirements. An InfoResult when it answered (its .result
    may be a refusal), WireError when it could not be reached or spoke garbage."""
    start = time.monotonic()
    deadline = start + timeout if timeout > 0 else None
    sock = connect(srv, timeout)
    with sock:
        req = gp.Info(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, flags=0, token=srv.token,
                      gpu=gpu, model=model, min_memory=min_memory,
                      host=host if host is not None else socket.gethostname())
        try:
            sock.settimeout(_remaining(deadline))
            send_message(sock, req, INFO_REQ)
        except (socket.timeout, TimeoutError):
            raise WireError(f"sending info: timed out after {format_number(timeout)} s",
                            "protocol") from None
        except OSError as exc:
            raise WireError(f"sending info: {exc.strerror or exc}", "protocol") from None
        frame = _read_reply(sock, srv, deadline, timeout)
        tls_version = (sock.version() or "") if isinstance(sock, ssl.SSLSocket) else ""
        identity = identity_of(sock)
    try:
        reply = decode_reply(frame.body)
    except gp.ProtocolError as exc:
        raise WireError(f"the server's info reply is malformed ({exc}); is it a gpupoold of "
                        "this version?", "protocol") from None
    data = document(reply) if reply.result == 0 else {}
    return InfoResult(result=reply.result, message=reply.message, major=reply.major,
                      minor=reply.minor, server=reply.server, gpus=reply.gpus,
                      matching=reply.matching, free_matching=reply.free_matching,
                      queue=reply.queue, data=data, elapsed_s=time.monotonic() - start,
                      tls_version=tls_version, identity=identity)


# The fields appended to the info reply since 1.3, by the minor version that added them, as the
# bytes an empty value of each encodes to: an older server's reply ends before them.
_APPENDED = ((4, bytes(8)),   # 1.4: an empty fingerprint and an empty fleet_servers
             (7, bytes(12)))  # 1.7: empty shared_gpus, share_views and lease_gpus


def decode_reply(body: bytes) -> gp.InfoReply:
    """An info reply of this protocol version, of a newer 1.x (its added fields ignored), or of
    an older 1.x from 1.3 on (it ends before the fields added since: read as empty)."""
    try:
        return gp.InfoReply.decode(body)
    except gp.ProtocolError as exc:
        error = exc
    try:
        reply = gp.InfoReply.decode(body, allow_trailing=True)
        if reply.major == gp.MAJOR and reply.minor > gp.MINOR:
            return reply
    except gp.ProtocolError:
        pass
    for n, (since, _) in enumerate(_APPENDED):
        try:  # a server older than `since`: every field from there on is missing
            reply = gp.InfoReply.decode(body + b"".join(z for _, z in _APPENDED[n:]))
            if reply.major == gp.MAJOR and reply.minor < since:
                return reply
        except gp.ProtocolError:
            pass
    raise error


# ------------------------------------------------------------------------------ the document
def _known(value: float | int) -> Any:
    """A reply number as the document shows it: None where the server said unknown (-1, NaN)."""
    if isinstance(value, float):
        return None if math.isnan(value) else value
    return None if value < 0 else value


def _client(r: Any) -> dict[str, Any]:
    return {"host": r.client_host, "user": r.client_user, "pid": r.client_pid,
            "program": r.client_program, "peer": r.client_peer}


def lease_view(r: gp.InfoLease) -> dict[str, Any]:
    # gpu None: detached while idle (its state waits on the server)
    return {"id": r.id, "gpu": None if r.gpu == gp.GP_INFO_NO_GPU else r.gpu,
            "token": r.token, "client": _client(r),
            "request": r.request, "started": _known(r.started),
            "duration_s": _known(r.duration_s), "queued_s": _known(r.queued_s),
            "worker_pid": r.worker_pid, "bytes_h2d": r.bytes_h2d, "bytes_d2h": r.bytes_d2h,
            "module_bytes": r.module_bytes, "mine": bool(r.mine)}


def waiter_view(r: gp.InfoWaiter) -> dict[str, Any]:
    return {"position": r.position, "ticket": r.ticket, "token": r.token,
            "client": _client(r), "request": r.request, "since": _known(r.since),
            "waiting_s": _known(r.waiting_s), "mine": bool(r.mine)}


def share_view(r: gp.InfoShare, lease: dict[str, Any] | None) -> dict[str, Any]:
    """A share of a shared GPU (protocol 1.7), as GET /api/v1/gpus shows it: its holder (token,
    client) from its lease's view (None: left out of a truncated reply), and `mine`."""
    return {"id": r.lease_id, "token": lease["token"] if lease else None,
            "client": lease["client"] if lease else None,
            "memory_quota": r.memory_quota, "memory_used": r.memory_used,
            "busy_s": _known(r.busy_s), "mine": bool(lease and lease["mine"])}


def shares_by_gpu(reply: gp.InfoReply, leases: dict[int, dict[str, Any]],
                  ) -> dict[int, dict[str, Any]]:
    """The `shares` of each shared GPU (protocol 1.7): its capacity, whether it is closed to new
    shares, and the shares it holds. A GPU not in it is not shared (or the server is older)."""
    out = {g.gpu: {"max": g.max_shares, "closed": bool(g.closed), "leases": []}
           for g in reply.shared_gpus}
    for r in reply.share_views:
        if r.gpu in out:
            out[r.gpu]["leases"].append(share_view(r, leases.get(r.lease_id)))
    return out


def gpu_view(r: gp.InfoGpu, leases: dict[int, dict[str, Any]],
             shares: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    live = {"at": _known(r.live_at), "memory_total": _known(r.live_memory_total),
            "memory_used": _known(r.memory_used), "memory_free": _known(r.memory_free),
            "gpu_util": _known(r.gpu_util), "memory_util": _known(r.memory_util),
            "temperature_c": _known(r.temperature_c), "power_w": _known(r.power_w),
            "power_limit_w": _known(r.power_limit_w), "energy_j": _known(r.energy_j),
            "sm_clock_mhz": _known(r.sm_clock_mhz), "mem_clock_mhz": _known(r.mem_clock_mhz),
            "cuda_driver_version": _known(r.cuda_driver_version)}
    lease = {k: v for k, v in leases[r.lease_id].items() if k != "mine"} \
        if r.lease_id in leases else None
    return {"index": r.index, "name": r.name, "uuid": r.uuid, "simulated": bool(r.simulated),
            "memory_total": r.memory_total, "pci_bus_id": r.pci_bus_id, "state": r.state,
            "since": _known(r.since), "draining": bool(r.draining),
            "worker_ready": bool(r.worker_ready), "lease": lease,
            "shares": (shares or {}).get(r.index), "live": live}


def document(reply: gp.InfoReply) -> dict[str, Any]:
    """The reply's server facts and views, with the names of the HTTP API's views (docs/api.md):
    {"server": {...}, "you": {...}, "time", "gpus": [...], "leases": [...], "queue": [...],
    "truncated", "fleet": [...]}. Unknown numbers are None. A lease has `gpus` (every GPU it is
    on, device 0 first; [] while detached) and a GPU `shares` (None: not shared), as the API's
    views do."""
    leases = [lease_view(r) for r in reply.lease_views]
    by_id = {lease["id"]: lease for lease in leases}
    # Protocol 1.7: every GPU of each lease. A 1.6 server says only its first, and names the
    # lease in the view of each GPU it holds: those, device 0 first.
    for lease in leases:
        first = [] if lease["gpu"] is None else [lease["gpu"]]
        lease["gpus"] = first + [r.index for r in reply.gpu_views
                                 if r.lease_id == lease["id"] and r.index not in first]
    if reply.lease_gpus:
        for lease in leases:
            lease["gpus"] = []
        for r in reply.lease_gpus:
            if r.lease_id in by_id:
                by_id[r.lease_id]["gpus"].append(r.gpu)
    shares = shares_by_gpu(reply, by_id)
    return {
        "server": {"version": reply.version, "host": reply.host, "remoting": reply.remoting,
                   "protocol": f"{reply.major}.{reply.minor}", "auth": reply.auth,
                   "simulated": bool(reply.simulated), "driver_version": reply.driver_version,
                   "cuda_driver_version": _known(reply.cuda_driver_version) or 0},
        "you": {"name": reply.you_name, "role": reply.you_role},
        "time": _known(reply.time),
        "gpus": [gpu_view(r, by_id, shares) for r in reply.gpu_views],
        "leases": leases,
        "queue": [waiter_view(r) for r in reply.queue_views],
        "truncated": bool(reply.truncated),
        # Protocol 1.3: every GPU of the fleet this server belongs to (empty: no fleet).
        "fleet": [fleet_gpu_view(r) for r in getattr(reply, "fleet_gpus", ())],
        # Protocol 1.4: the server's own identity, and every server of its fleet with the
        # identity it registered (what `gpupool login` pins for them).
        "fingerprint": reply.fingerprint,
        "fleet_servers": [fleet_server_view(r) for r in reply.fleet_servers],
    }


def fleet_server_view(r: gp.InfoFleetServer) -> dict[str, Any]:
    return {"server": r.server, "address": r.address, "server_state": r.server_state,
            "this": bool(r.this), "fingerprint": r.fingerprint}


def fleet_gpu_view(r: gp.InfoFleetGpu) -> dict[str, Any]:
    return {"server": r.server, "address": r.address, "server_state": r.server_state,
            "this": bool(r.this), "index": r.index, "name": r.name, "uuid": r.uuid,
            "memory_total": r.memory_total, "state": r.state, "available": bool(r.available),
            "lease_id": r.lease_id or None, "token": r.token}
