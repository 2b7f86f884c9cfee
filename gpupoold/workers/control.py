"""The control channel's messages (protocol/gpupool.toml, "control"): one frame per packet of
the SOCK_SEQPACKET socket between gpupoold and a worker (worker/control.c), and in the end record
a session leaves for the next gpupoold (worker/adopt.c). Encoded and decoded by the generated
classes, as the worker's side is by the generated C."""

from __future__ import annotations

from typing import Any

import gpupool_protocol as gp

# The messages a worker sends; anything else on the socket is a protocol error.
FROM_WORKER: tuple[type, ...] = (gp.WorkerReady, gp.WorkerFailed, gp.WorkerStarted,
                                 gp.WorkerRefused, gp.WorkerStats, gp.WorkerEnded,
                                 gp.WorkerAdopted, gp.WorkerAdoptRefused, gp.WorkerDetachOk,
                                 gp.WorkerDetachNo, gp.WorkerWantsGpu, gp.WorkerIpcExport,
                                 gp.WorkerIpcOpen, gp.WorkerIpcExportEvent,
                                 gp.WorkerIpcOpenEvent, gp.WorkerPeerConnect,
                                 gp.WorkerPeerAccept)
CONTROL_VERSIONS = frozenset({gp.GP_WORKER_CONTROL_VERSION})  # what this gpupoold can follow
# Fields appended to a worker's message after builds that sent it without them, as the bytes
# their "not said" value encodes to, one entry per older build, newest first: an adoptable worker
# of an older build (its session outlived a package upgrade) ends its message before them, and a
# restart must still take it over.
APPENDED: dict[type, tuple[bytes, ...]] = {gp.WorkerAdopted: (
    bytes(4),  # flags: 0, nothing said (not even GP_ADOPTED_SAID: gpupoold guesses)
    bytes(12),  # and memory_quota: 0, no quota
)}


def encode(msg: Any) -> bytes:
    """One packet: the message's frame (req 0)."""
    return gp.encode_frame(msg)


def decode(packet: bytes) -> Any:
    """The worker's message in one packet. gp.ProtocolError when it is not one whole frame of a
    message a worker sends (a newer worker's appended fields are ignored)."""
    if len(packet) < gp.HEADER_SIZE:
        raise gp.ProtocolError(f"a control packet of {len(packet)} bytes (a frame has a "
                               f"{gp.HEADER_SIZE}-byte header)")
    length, op, flags, _ = gp.parse_header(packet[:gp.HEADER_SIZE], gp.MAX_BODY)
    if length != len(packet) - gp.HEADER_SIZE or flags & gp.FLAG_REPLY:
        raise gp.ProtocolError(f"a control frame of op {op} whose header says {length} bytes "
                               f"in a packet of {len(packet)}")
    cls = gp.REQUESTS.get(op)
    if cls not in FROM_WORKER:
        raise gp.ProtocolError(f"op {op} ({getattr(cls, 'NAME', 'unknown')}) is not a message "
                               "a worker sends")
    body = packet[gp.HEADER_SIZE:]
    try:
        return cls.decode(body, allow_trailing=True)
    except gp.ProtocolError:
        for tail in APPENDED.get(cls, ()):  # exactly an older build's message, nothing else
            try:
                return cls.decode(body + tail)
            except gp.ProtocolError:
                continue
        raise


def clip_text(text: str, limit: int) -> str:
    """text in at most `limit` UTF-8 bytes, never cutting a character."""
    return text.encode()[:limit].decode(errors="ignore")
