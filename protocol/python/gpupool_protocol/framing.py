"""Frames on an asyncio stream (the daemon's side): the 16-byte header, the length-checked body.
The blocking-socket twin for the `gpupool` command is gpupool/wire/frames.py; both build on
runtime.py's header, Frame and encode_frame."""

from __future__ import annotations

import asyncio

from gpupool_protocol._generated import MAX_BODY
from gpupool_protocol.runtime import HEADER, Frame, parse_header


async def read_frame(reader: asyncio.StreamReader, max_body: int = MAX_BODY) -> Frame:
    """Read one frame. Raises ProtocolError on an oversized body, IncompleteReadError on EOF."""
    length, op, flags, req = parse_header(await reader.readexactly(HEADER.size), max_body)
    return Frame(op, flags, req, await reader.readexactly(length))
