"""The hand-written runtime of the generated message classes (_generated.py), kept apart from
them as protobuf-c keeps its runtime apart from generated descriptors: the frame header, the
error every malformed frame or body raises, a whole frame, and the little-endian writer and
reader the generated `encode`/`decode` methods call field by field.

Pure Python, standard library only, Python 3.9 and later (the `gpupool` client supports 3.9).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# length, op, flags, request id (docs/protocol.md, "Frames")
HEADER = struct.Struct("<IHHQ")
HEADER_SIZE = HEADER.size
FLAG_REPLY = 0x1


class ProtocolError(ValueError):
    """A frame or message body that does not match the spec."""


@dataclass(frozen=True)
class Frame:
    op: int
    flags: int
    req: int
    body: bytes


def encode_frame(msg: Any, req: int = 0) -> bytes:
    """Header + body of a generated message object; replies get the reply flag."""
    body = msg.encode()
    flags = FLAG_REPLY if getattr(msg, "IS_REPLY", False) else 0
    return HEADER.pack(len(body), msg.OP, flags, req) + body


def parse_header(header: bytes, max_body: int) -> tuple[int, int, int, int]:
    """(length, op, flags, req) of a 16-byte header; ProtocolError for an oversized body."""
    length, op, flags, req = HEADER.unpack(header)
    if length > max_body:
        raise ProtocolError(f"frame body of {length} bytes exceeds the limit of {max_body}")
    return length, op, flags, req

class Writer:
    """Encodes one message body, field by field, in the order the spec lists them."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def scalar(self, fmt: str, value: float) -> None:
        self._parts.append(struct.pack("<" + fmt, value))

    def bytes(self, value: bytes, size: int) -> None:
        if len(value) != size:
            raise ProtocolError(f"expected {size} bytes, got {len(value)}")
        self._parts.append(bytes(value))

    def string(self, value: str, limit: int) -> None:
        self.blob(value.encode(), limit)

    def blob(self, value: bytes, limit: int) -> None:
        if len(value) > limit:
            raise ProtocolError(f"{len(value)} bytes exceed the limit of {limit}")
        self._parts.append(struct.pack("<I", len(value)) + bytes(value))

    def array(self, fmt: str, values: Sequence[int], limit: int) -> None:
        if len(values) > limit:
            raise ProtocolError(f"{len(values)} items exceed the limit of {limit}")
        self._parts.append(struct.pack(f"<I{len(values)}{fmt}", len(values), *values))

    def records(self, values: Sequence[Any], limit: int) -> None:
        """A count, then each record's fields (its generated `_put`)."""
        if len(values) > limit:
            raise ProtocolError(f"{len(values)} records exceed the limit of {limit}")
        self._parts.append(struct.pack("<I", len(values)))
        for value in values:
            value._put(self)

    def bulk(self, length: int) -> None:
        self._parts.append(struct.pack("<Q", length))

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


class Reader:
    """Decodes one message body, field by field; every read is bounds- and limit-checked."""

    def __init__(self, body: bytes) -> None:
        self._b = memoryview(body)
        self._p = 0

    def _take(self, n: int) -> memoryview:
        if n > len(self._b) - self._p:
            raise ProtocolError("message body too short")
        v = self._b[self._p:self._p + n]
        self._p += n
        return v

    def scalar(self, fmt: str) -> Any:
        s = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self._take(s))[0]

    def bytes(self, size: int) -> bytes:
        return bytes(self._take(size))

    def string(self, limit: int) -> str:
        try:
            return self.blob(limit).decode()
        except UnicodeDecodeError as exc:
            raise ProtocolError("string is not UTF-8") from exc

    def blob(self, limit: int) -> bytes:
        n = self.scalar("I")
        if n > limit:
            raise ProtocolError(f"{n} bytes exceed the limit of {limit}")
        return bytes(self._take(n))

    def array(self, fmt: str, limit: int) -> list[int]:
        n = self.scalar("I")
        if n > limit:
            raise ProtocolError(f"{n} items exceed the limit of {limit}")
        size = struct.calcsize("<" + fmt)
        return list(struct.unpack(f"<{n}{fmt}", self._take(n * size)))

    def records(self, cls: Any, limit: int) -> list[Any]:
        """A count, then that many records of the generated record class `cls`."""
        n = self.scalar("I")
        if n > limit:
            raise ProtocolError(f"{n} records exceed the limit of {limit}")
        return [cls._get(self) for _ in range(n)]

    def bulk(self) -> int:
        return int(self.scalar("Q"))

    def finish(self) -> None:
        if self._p != len(self._b):
            raise ProtocolError(f"{len(self._b) - self._p} trailing bytes in message body")
