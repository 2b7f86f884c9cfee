"""The gpupool wire protocol for Python: generated message classes plus frame helpers."""

from gpupool_protocol._generated import *  # noqa: F403
from gpupool_protocol._generated import (
    FLAG_REPLY,
    HEADER,
    MAJOR,
    MAX_BODY,
    MINOR,
    REPLIES,
    REQUESTS,
    ProtocolError,
)
from gpupool_protocol.framing import Frame, encode_frame, read_frame

__all__ = [
    "FLAG_REPLY",
    "HEADER",
    "MAJOR",
    "MAX_BODY",
    "MINOR",
    "REPLIES",
    "REQUESTS",
    "Frame",
    "ProtocolError",
    "encode_frame",
    "read_frame",
]
