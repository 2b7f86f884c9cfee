"""The hello handshake, without I/O: decode and check a client's first frame.

The first 8 bytes of a hello body are `u32 magic, u16 major, u16 minor` in every protocol
version, so a client of another major version gets a clear refusal even when the rest of its hello
has a layout this server does not know.

The hello also carries the client's requirements (`gpu`, `model`, `min_memory`; empty / 0 = any),
which the lease manager matches against the GPUs; `requirements_text` renders them for logs and
the API. While the client waits for a GPU the daemon sends it `queue_notice`s.
"""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gpupool_protocol as gp

from gpupoold import __version__
from gpupoold.pool.requirements import Requirements, format_bytes

# The largest hello body of this protocol version is about 6.2 KiB; anything much longer is not a
# hello and is refused before it is read.
HELLO_MAX_BODY = 16 * 1024
_PREFIX = struct.Struct("<IHH")


@dataclass(frozen=True)
class Refusal:
    result: int  # a GP_E* code
    message: str


def server_banner() -> str:
    """The software and host a reply's `server` field names, for people reading a client's
    messages; not the server's name in the fleet (config/identity.py, `server_name`)."""
    return f"gpupoold {__version__} on {socket.gethostname()}"


def version_refusal(major: int, minor: int) -> Refusal:
    ours = f"{gp.MAJOR}.{gp.MINOR}"
    upgrade = ("upgrade gpupoold on this server" if major > gp.MAJOR
               else "upgrade the gpupool client (pip install -U gpupool)")
    return Refusal(gp.GP_EVERSION,
                   f"client speaks protocol {major}.{minor}, this server speaks {ours}; {upgrade}")


def parse_first_frame(body: bytes, cls: Any, what: str, client: str) -> Any:
    """The decoded first frame of a connection (`cls`: gp.Hello or gp.Info, `what` its name in
    messages, `client` what the user should match to this server), or the refusal to send
    back: wrong magic or major version (GP_EVERSION), a body that does not decode (GP_EPROTO).
    A newer minor version is served: the fields it appended are skipped."""
    if len(body) < _PREFIX.size:
        return Refusal(gp.GP_EPROTO, f"malformed {what}: {len(body)} bytes is too short")
    magic, major, minor = _PREFIX.unpack_from(body)
    if magic != gp.MAGIC:
        return Refusal(gp.GP_EVERSION,
                       f"not a gpupool client: {what} magic is 0x{magic:08x}, expected "
                       f"0x{gp.MAGIC:08x} (protocol {gp.MAJOR}.{gp.MINOR}); use the {client} "
                       "that matches this server")
    if major != gp.MAJOR:
        return version_refusal(major, minor)
    try:
        # A newer minor version appends fields at the end: read the ones we know, skip the rest
        # (docs/protocol.md, "Versioning"). From our own version, trailing bytes are malformed.
        # An older one ends before the fields appended since: they read as 0 ("not said").
        if cls is gp.Hello:
            return gp.decode_hello(body, allow_trailing=minor > gp.MINOR)
        return cls.decode(body, allow_trailing=minor > gp.MINOR)
    except gp.ProtocolError as exc:
        return Refusal(gp.GP_EPROTO, f"malformed {what}: {exc}")


def parse_hello(body: bytes) -> gp.Hello | Refusal:
    """The decoded hello, or the refusal to send back."""
    result: gp.Hello | Refusal = parse_first_frame(body, gp.Hello, "hello",
                                                   "gpupool client library")
    if isinstance(result, gp.Hello):
        # A spread group is a fleet ticket: the lease records keep it in a signed 64-bit integer,
        # so one above that is refused here, not when its lease is recorded.
        why = Requirements.from_hello(result).malformed()
        if why is not None:
            return Refusal(gp.GP_EPROTO, f"malformed hello: {why}")
    return result


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` UTF-8 bytes (the protocol's string limits are in bytes)."""
    return text.encode()[:limit].decode(errors="ignore")


def refusal_reply(refusal: Refusal) -> gp.HelloReply:
    return gp.HelloReply(result=refusal.result, major=gp.MAJOR, minor=gp.MINOR,
                         message=clip(refusal.message, 4095), server=clip(server_banner(), 255))


def redirect_reply(address: str, server: str, gpu: int, fingerprint: str = "") -> gp.HelloReply:
    """GP_EREDIRECT: GPU `gpu` of fleet server `server` is held for this client at `address`.
    `fingerprint`: the TLS identity that server registered (the servers table), which the
    client must find there before it sends anything secret; "" for a server on plain TCP (a
    client that pins refuses such a redirect)."""
    return gp.HelloReply(result=gp.GP_EREDIRECT, major=gp.MAJOR, minor=gp.MINOR,
                         message=clip(f"GPU {gpu} of server {server} ({address}) is held for "
                                      "this client: connect there", 4095),
                         server=clip(server_banner(), 255), redirect=clip(address, 255),
                         redirect_fingerprint=clip(fingerprint, 63))


def spread_redirect_reply(group: int, parts: Sequence[tuple[str, str, str, int, int]],
                          gpus: int) -> gp.HelloReply:
    """GP_EREDIRECT with the parts of a spread lease (protocol 1.8): `gpus` GPUs held for this
    client on several servers of the fleet under `group`; each part as (server name, address,
    fingerprint, GPU count, first device), in device order. The client says a part's hello to
    each address (spread_group = `group`, its part and how many); `redirect` and
    `redirect_fingerprint` name part 0, for a reader of one address."""
    where = ", ".join(f"{n} on {name} ({address})" for name, address, _, n, _ in parts)
    _, address, fingerprint, _, _ = parts[0]
    return gp.HelloReply(
        result=gp.GP_EREDIRECT, major=gp.MAJOR, minor=gp.MINOR,
        message=clip(f"no one server has {gpus} free GPUs; the fleet holds them for this client "
                     f"in {len(parts)} parts (spread lease {group}): {where}: say each part's "
                     "hello there", 4095),
        server=clip(server_banner(), 255), redirect=clip(address, 255),
        redirect_fingerprint=clip(fingerprint, 63), spread_group=group,
        redirect_parts=[gp.RedirectPart(server=clip(address, 255), fingerprint=clip(fp, 63),
                                        gpus=n, first_device=first)
                        for _, address, fp, n, first in parts])


_PLAIN = re.compile(r"[\w.:-]+")  # a GPU index or UUID: shown as it is; anything else quoted


def format_size(n: int) -> str:
    """Bytes, exact ("40 GiB", "40 GB", "1536 MiB", "12345 bytes"): a log line says precisely
    what the client asked for."""
    return format_bytes(n, exact=True)


def requirements_text(hello: gp.Hello) -> str:
    """The client's requirements in one line, e.g. "gpu=1 model='A100' min_memory=40 GiB", or
    "any GPU". The strings come from the client: they are quoted (repr) unless they are a plain
    index or UUID, so a log line can never be split or forged by them."""
    parts = []
    gpu, model, min_memory = hello.gpu.strip(), hello.model.strip(), hello.min_memory
    if gpu:
        parts.append(f"gpu={gpu}" if _PLAIN.fullmatch(gpu) else f"gpu={gpu!r}")
    if model:
        parts.append(f"model={model!r}")
    if min_memory:
        parts.append(f"min_memory={format_size(min_memory)}")
    if hello.gpus > 1:
        parts.append(f"gpus={hello.gpus}")
    if hello.memory:
        parts.append(f"memory={format_size(hello.memory)}")
    if hello.flags & gp.GP_HELLO_SPREAD:
        parts.append("spread")
    if hello.spread_group:
        parts.append(f"part={hello.part} of {hello.parts} (spread lease {hello.spread_group})")
    return " ".join(parts) if parts else "any GPU"


def queue_notice(position: int, total: int, waited_s: float, server: str) -> gp.Notice:
    """The notice a queued client prints while it waits for a GPU (before its hello reply):
    "waiting for a GPU on HOST:PORT: position 3 of 5 in the queue (waited 12 s)". The code is
    informational (GP_INFO_QUEUED): the client never takes it for an error."""
    text = (f"waiting for a GPU on {server}: position {position} of {total} in the queue "
            f"(waited {max(0, round(waited_s))} s)")
    return gp.Notice(code=gp.GP_INFO_QUEUED, op=0, text=clip(text, 4095))
