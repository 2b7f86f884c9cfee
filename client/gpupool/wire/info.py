"""The `info` request (protocol 1.1): what a server has, without taking a GPU.

One connection per request: connect (TLS when the server's settings say so: the `ssl` module,
the server's certificate checked against tls_ca or the system store, the host name checked, a
client certificate when tls_cert/tls_key are set), send `info` as the first frame, read the
reply; gpupoold then closes the connection.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import gpupool_protocol as gp

from gpupool.config import ServerConfig, format_number
from gpupool.wire.frames import Frame, read_frame, send_message

INFO_REQ = 1
NOTICE_OP = 3


class WireError(Exception):
    """The server could not be reached or did not answer `info` properly: one line, why.
    `kind` says which step failed: connect, tls, protocol."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


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
    data: dict[str, Any] = field(default_factory=dict)  # the json, parsed ({} on refusal)
    elapsed_s: float = 0.0
    tls_version: str = ""  # "TLSv1.3" over TLS, "" for plain TCP

    @property
    def ok(self) -> bool:
        return self.result == 0

    def result_name(self) -> str:
        return gp.RESULT_NAMES.get(self.result, str(self.result))


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return max(0.001, deadline - time.monotonic())


def _tls_context(srv: ServerConfig) -> ssl.SSLContext:
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=srv.tls_ca or None)
    except (OSError, ssl.SSLError) as exc:
        raise WireError(f"TLS: cannot use the CA file {srv.tls_ca} "
                        f"({getattr(exc, 'strerror', None) or exc}); set tls_ca "
                        "(GPUPOOL_TLS_CA) to a PEM file of CA certificates", "tls") from None
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
                         "port; drop tls:// and tls = true for this server (and unset "
                         "GPUPOOL_TLS), or enable tls_cert on the server", "tls")
    if "certificate required" in low or "handshake failure" in low:
        return WireError(f"TLS handshake failed ({why}): the server requires a client "
                         "certificate that its tls_client_ca signed: set tls_cert and tls_key "
                         "(GPUPOOL_TLS_CERT, GPUPOOL_TLS_KEY)", "tls")
    if "unknown ca" in low or "bad certificate" in low or "certificate" in low:
        return WireError(f"TLS: the server did not accept the client certificate ({why}): use "
                         "one that its tls_client_ca signed (tls_cert, GPUPOOL_TLS_CERT)", "tls")
    return WireError(f"TLS handshake failed ({why})", "tls")


def connect(srv: ServerConfig, timeout: float) -> socket.socket:
    """A connected socket to the server (TLS-wrapped per its settings). WireError says why not.
    `timeout` 0 means no limit."""
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
        ctx = _tls_context(srv)
        sock.settimeout(_remaining(deadline))
        try:
            return ctx.wrap_socket(sock, server_hostname=srv.host)
        except ssl.SSLError as exc:
            raise _tls_error(exc, srv) from None
        except (socket.timeout, TimeoutError):
            raise WireError(f"TLS handshake {limit}", "tls") from None
        except OSError as exc:
            raise WireError(f"TLS handshake failed: {exc.strerror or exc}: the server does not "
                            "speak TLS on this port, or closed the connection", "tls") from None
    except BaseException:
        sock.close()
        raise


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
    try:
        reply = gp.InfoReply.decode(frame.body)
    except gp.ProtocolError as exc:
        raise WireError(f"the server's info reply is malformed ({exc}); is it a gpupoold of "
                        "this version?", "protocol") from None
    data: dict[str, Any] = {}
    if reply.result == 0 and reply.json:
        try:
            parsed = json.loads(reply.json)
        except ValueError as exc:
            raise WireError(f"the server's info json is malformed ({exc})", "protocol") from None
        if not isinstance(parsed, dict):
            raise WireError("the server's info json is not an object", "protocol")
        data = parsed
    return InfoResult(result=reply.result, message=reply.message, major=reply.major,
                      minor=reply.minor, server=reply.server, gpus=reply.gpus,
                      matching=reply.matching, free_matching=reply.free_matching,
                      queue=reply.queue, data=data, elapsed_s=time.monotonic() - start,
                      tls_version=tls_version)
