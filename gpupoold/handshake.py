"""The hello handshake, without I/O: decode and check a client's first frame.

The first 8 bytes of a hello body are `u32 magic, u16 major, u16 minor` in every protocol
version, so a client of another major version gets a clear refusal even when the rest of its hello
has a layout this server does not know.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

import gpupool_protocol as gp

from gpupoold import __version__

# The largest hello body of this protocol version is about 6 KiB; anything much longer is not a
# hello and is refused before it is read.
HELLO_MAX_BODY = 16 * 1024
_PREFIX = struct.Struct("<IHH")


@dataclass(frozen=True)
class Refusal:
    result: int  # a GP_E* code
    message: str


def server_name() -> str:
    return f"gpupoold {__version__} on {socket.gethostname()}"


def version_refusal(major: int, minor: int) -> Refusal:
    ours = f"{gp.MAJOR}.{gp.MINOR}"
    upgrade = ("upgrade gpupoold on this server" if major > gp.MAJOR
               else "upgrade the gpupool client (pip install -U gpupool)")
    return Refusal(gp.GP_EVERSION,
                   f"client speaks protocol {major}.{minor}, this server speaks {ours}; {upgrade}")


def parse_hello(body: bytes) -> gp.Hello | Refusal:
    """The decoded hello, or the refusal to send back."""
    if len(body) < _PREFIX.size:
        return Refusal(gp.GP_EPROTO, f"malformed hello: {len(body)} bytes is too short")
    magic, major, minor = _PREFIX.unpack_from(body)
    if magic != gp.MAGIC:
        return Refusal(gp.GP_EVERSION,
                       f"not a gpupool client: hello magic is 0x{magic:08x}, expected "
                       f"0x{gp.MAGIC:08x} (protocol {gp.MAJOR}.{gp.MINOR}); use the gpupool "
                       "client library that matches this server")
    if major != gp.MAJOR:
        return version_refusal(major, minor)
    try:
        return gp.Hello.decode(body)
    except gp.ProtocolError as exc:
        if minor > gp.MINOR:
            # A newer minor version may append fields this server cannot skip yet.
            return Refusal(gp.GP_EVERSION,
                           f"client speaks protocol {major}.{minor}, this server speaks "
                           f"{gp.MAJOR}.{gp.MINOR} and cannot read its hello ({exc}); "
                           "upgrade gpupoold on this server")
        return Refusal(gp.GP_EPROTO, f"malformed hello: {exc}")


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` UTF-8 bytes (the protocol's string limits are in bytes)."""
    return text.encode()[:limit].decode(errors="ignore")


def refusal_reply(refusal: Refusal) -> gp.HelloReply:
    return gp.HelloReply(result=refusal.result, major=gp.MAJOR, minor=gp.MINOR,
                         message=clip(refusal.message, 4095), server=clip(server_name(), 255))
