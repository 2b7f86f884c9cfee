"""Reading the hello of an older client (docs/protocol.md, "Versioning").

A minor version may append fields to the hello. A client of an older minor version ends its
hello before them; the generated decoder, which reads every field of this version, would call
that body short. `complete_hello` appends the missing fields as zeros first, which every such
field is defined to mean "not said" (connect_timeout_ms 0: unknown). Hand-written, not generated:
the spec does not record which version added a field.
"""

from __future__ import annotations

import struct

_PREFIX = struct.Struct("<IHH")  # magic, major, minor: the same in every version
# (the minor version that appended them, their encoding as zeros), oldest first
_HELLO_APPENDED = (
    (5, struct.pack("<I", 0)),  # 1.5: u32 connect_timeout_ms
)


def complete_hello(body: bytes) -> bytes:
    """`body` with the hello fields appended after its sender's minor version added as zeros;
    unchanged for a hello of this version or a newer one, or a body too short to say."""
    if len(body) < _PREFIX.size:
        return body
    minor = _PREFIX.unpack_from(body)[2]
    return body + b"".join(zeros for since, zeros in _HELLO_APPENDED if minor < since)
