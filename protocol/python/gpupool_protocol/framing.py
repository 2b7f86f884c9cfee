"""Frames on an asyncio stream: the 16-byte header, the length-checked body."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gpupool_protocol._generated import HEADER, MAX_BODY, ProtocolError


@dataclass(frozen=True)
class Frame:
    op: int
    flags: int
    req: int
    body: bytes


def encode_frame(msg: object, req: int = 0) -> bytes:
    """Header + body of a generated message object (replies get the reply flag)."""
    body = msg.encode()  # type: ignore[attr-defined]
    flags = 1 if getattr(msg, "IS_REPLY", False) else 0
    return HEADER.pack(len(body), msg.OP, flags, req) + body  # type: ignore[attr-defined]


async def read_frame(reader: asyncio.StreamReader, max_body: int = MAX_BODY) -> Frame:
    """Read one frame. Raises ProtocolError on an oversized body, IncompleteReadError on EOF."""
    header = await reader.readexactly(HEADER.size)
    length, op, flags, req = HEADER.unpack(header)
    if length > max_body:
        raise ProtocolError(f"frame body of {length} bytes exceeds the limit of {max_body}")
    body = await reader.readexactly(length)
    return Frame(op, flags, req, body)
