"""Frames on a blocking socket (the `gpupool` command's side): the 16-byte header, then a
length-checked body. The asyncio twin is gpupool_protocol/framing.py; both use the protocol
runtime's header, Frame and encode_frame."""

from __future__ import annotations

import socket

import gpupool_protocol as gp
from gpupool_protocol import Frame


def send_message(sock: socket.socket, msg: object, req: int = 0) -> None:
    """Header + body of a generated message object; replies get the reply flag."""
    sock.sendall(gp.encode_frame(msg, req))


def read_exactly(sock: socket.socket, n: int) -> bytes:
    """n bytes; EOFError when the peer closed first (tests use it too)."""
    parts = []
    left = n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError(f"the connection was closed after {n - left} of {n} bytes")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_frame(sock: socket.socket, max_body: int = gp.MAX_BODY) -> Frame:
    """One frame. gp.ProtocolError for an oversized body; EOFError when the peer closed."""
    length, op, flags, req = gp.parse_header(read_exactly(sock, gp.HEADER.size), max_body)
    return Frame(op, flags, req, read_exactly(sock, length))
