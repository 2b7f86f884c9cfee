"""Frames on a blocking socket: the 16-byte header, then a length-checked body."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from gpupool import _wire_generated as gp


@dataclass(frozen=True)
class Frame:
    op: int
    flags: int
    req: int
    body: bytes


def send_message(sock: socket.socket, msg: object, req: int = 0) -> None:
    """Header + body of a generated message object; replies get the reply flag."""
    body = msg.encode()  # type: ignore[attr-defined]
    flags = gp.FLAG_REPLY if getattr(msg, "IS_REPLY", False) else 0
    sock.sendall(gp.HEADER.pack(len(body), msg.OP, flags, req) + body)  # type: ignore[attr-defined]


def _read_exactly(sock: socket.socket, n: int) -> bytes:
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
    length, op, flags, req = gp.HEADER.unpack(_read_exactly(sock, gp.HEADER.size))
    if length > max_body:
        raise gp.ProtocolError(f"frame body of {length} bytes exceeds the limit of {max_body}")
    return Frame(op, flags, req, _read_exactly(sock, length))
