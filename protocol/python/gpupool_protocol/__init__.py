"""The gpupool wire protocol for Python: the message classes generated from
protocol/gpupool.toml (_generated.py), their hand-written runtime (runtime.py) and frame I/O on
an asyncio stream (framing.py). One package for the daemon and the `gpupool` client."""

from gpupool_protocol._generated import *  # noqa: F403
from gpupool_protocol._generated import MAJOR, MAX_BODY, MINOR, REPLIES, REQUESTS
from gpupool_protocol.framing import read_frame
from gpupool_protocol.runtime import (
                                      FLAG_REPLY,
                                      HEADER,
                                      HEADER_SIZE,
                                      Frame,
                                      ProtocolError,
                                      Reader,
                                      Writer,
                                      encode_frame,
                                      parse_header,
)
from gpupool_protocol.skew import complete_hello, decode_hello

__version__ = "1.9.0"  # the distribution's: MAJOR.MINOR of the protocol it speaks, then a patch

__all__ = [
    "FLAG_REPLY",
    "HEADER",
    "HEADER_SIZE",
    "MAJOR",
    "MAX_BODY",
    "MINOR",
    "REPLIES",
    "REQUESTS",
    "Frame",
    "ProtocolError",
    "Reader",
    "Writer",
    "complete_hello",
    "decode_hello",
    "encode_frame",
    "parse_header",
    "read_frame",
]
