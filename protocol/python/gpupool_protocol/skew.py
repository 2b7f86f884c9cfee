"""Reading the hello of an older client (docs/protocol.md, "Versioning").

A minor version may append fields to the hello. A client of an older minor version ends its
hello before them; the generated decoder, which reads every field of this version, would call
that body short. `complete_hello` appends the missing fields as zeros first, which every such
field is defined to mean "not said" (connect_timeout_ms 0: unknown). Hand-written, not generated:
the spec does not record which version added a field.
"""

from __future__ import annotations

import struct

from gpupool_protocol._generated import Hello
from gpupool_protocol.runtime import ProtocolError

_PREFIX = struct.Struct("<IHH")  # magic, major, minor: the same in every version
# (the minor version that appended them, their encoding as zeros), oldest first
_HELLO_APPENDED = (
    (5, struct.pack("<I", 0)),  # 1.5: u32 connect_timeout_ms
    (6, struct.pack("<IQ", 0, 0)),  # 1.6: u32 gpus, u64 memory
    (8, struct.pack("<QII", 0, 0, 0)),  # 1.8: u64 spread_group, u32 part, u32 parts
)


def decode_hello(body: bytes, *, allow_trailing: bool) -> Hello:
    """The hello as sent; if the decoder finds it short, as completed by `complete_hello` (an
    older client's). As sent first: a hello of this version whose minor field says older (a
    test's, a hand-made one) is whole and must not grow zeros it would then call trailing."""
    try:
        return Hello.decode(body, allow_trailing=allow_trailing)
    except ProtocolError:
        completed = complete_hello(body)
        if completed == body:
            raise
        return Hello.decode(completed, allow_trailing=allow_trailing)


def complete_hello(body: bytes) -> bytes:
    """`body` with the hello fields appended after its sender's minor version added as zeros;
    unchanged for a hello of this version or a newer one, or a body too short to say."""
    if len(body) < _PREFIX.size:
        return body
    minor = _PREFIX.unpack_from(body)[2]
    return body + b"".join(zeros for since, zeros in _HELLO_APPENDED if minor < since)
