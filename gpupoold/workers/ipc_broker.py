"""CUDA IPC between the workers of one job on this server (issue 37, item 4; docs/multi-gpu.md,
"CUDA IPC between the workers of one job").

A program's `cuIpcGetMemHandle` makes its worker export the allocation as a file descriptor
(`cuMemExportToShareableHandle`, POSIX fd) and send it here over its control socket; the broker
keeps it under a new id with a random secret, bound to the exporting session's token. Another
program's `cuIpcOpenMemHandle` makes its worker ask for that id and secret; the broker gives a
copy of the fd only to a session of the same token. The 64 bytes a program holds (`IpcHandle`)
are therefore useless to anyone else: another tenant's lease has another token, a handle of
another server names an id this broker does not know, and the secret is 128 random bits.

The fd never reaches a tenant: it goes worker to gpupoold to worker. The broker owns the fds it
keeps and closes those of a session when the session ends (an importer that already mapped the
memory keeps its mapping: the driver holds the memory until its last mapping goes).

Events go the same way (`cuIpcGetEventHandle` / `cuIpcOpenEventHandle`), without an fd: the
driver's own 64-byte event handle is what the exporter's worker sends and what the importer's
worker opens; the broker keeps it under an id and secret like memory, so the program's handle
carries no bytes of the driver's (they name the exporting process's event to any process on the
server) and only the exporter's token gets them.

Everything here runs on the event loop and does no blocking call (dup and close of an fd only).
`answer` turns a worker's control message into the broker's call and the message back
(gpupoold/workers/supervisor.py calls it); the daemon makes the broker and ends a lease's
exports when the lease ends (gpupoold/app.py).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gpupool_protocol as gp

log = logging.getLogger(__name__)

# CUresult values the workers pass on to the program (the driver's, cudaapi/gp_cuda.h).
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2

HANDLE_SIZE = 64  # CUipcMemHandle's reserved[64]
HANDLE_MAGIC = b"GPIPC1\0\0"
EVENT_HANDLE_MAGIC = b"GPIPE1\0\0"  # a CUipcEventHandle: the same layout, size and offset 0
SECRET_SIZE = 16
# magic, handle id, secret, allocation size, offset of the pointer in it, server id; padded.
_LAYOUT = struct.Struct("<8sQ16sQQ8s")
MAX_EXPORTS_PER_SESSION = 4096  # fds this daemon holds for one session (each is an open file)
# Distinct driver event handles kept for one session (64 bytes each, kept until it ends: the
# worker does not say when an event is destroyed). The same event exported again is not counted.
MAX_EVENT_EXPORTS_PER_SESSION = 4096


@dataclass(frozen=True)
class IpcHandle:
    """The 64 bytes of a CUipcMemHandle (or, event True, a CUipcEventHandle) as gpupool writes
    them (the shim packs, the worker reads): which export, its secret, the allocation's size and
    where the pointer lies in it (0 for an event), and the server that keeps it (so that a handle
    taken to another server is named as such)."""

    handle_id: int
    secret: bytes
    size: int
    offset: int
    server: bytes  # 8 bytes: IpcBroker.server_id
    event: bool = False

    def pack(self) -> bytes:
        magic = EVENT_HANDLE_MAGIC if self.event else HANDLE_MAGIC
        body = _LAYOUT.pack(magic, self.handle_id, self.secret, self.size, self.offset,
                            self.server)
        return body.ljust(HANDLE_SIZE, b"\0")

    @classmethod
    def unpack(cls, data: bytes, *, event: bool = False) -> IpcHandle:
        """IpcRefused when data is not a handle gpupool wrote (of an event when `event`)."""
        magic, call = ((EVENT_HANDLE_MAGIC, "cuIpcGetEventHandle") if event
                       else (HANDLE_MAGIC, "cuIpcGetMemHandle"))
        if len(data) != HANDLE_SIZE or data[:len(magic)] != magic:
            raise IpcRefused(CUDA_ERROR_INVALID_VALUE,
                             f"not a CUDA IPC {'event ' if event else ''}handle of gpupool "
                             "(a handle must be passed on unchanged from the process that "
                             f"called {call})")
        _, handle_id, secret, size, offset, server = _LAYOUT.unpack_from(data)
        return cls(handle_id, secret, size, offset, server, event)


class IpcRefused(Exception):
    """The broker refuses: `code` (a CUresult) goes to the program with the message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class _Export:
    session_id: int
    token: str
    fd: int | None  # an allocation's (None for an event)
    size: int
    secret: bytes
    event: bytes  # the driver's CUipcEventHandle (b"" for memory)
    importers: set[int] = field(default_factory=set)  # sessions that opened it


class IpcBroker:
    """The exported allocations of this server's sessions. `token_of(session_id)` says the token
    of a running session (None when the session is not running here)."""

    def __init__(self, token_of: Callable[[int], str | None], *,
                 max_per_session: int = MAX_EXPORTS_PER_SESSION,
                 max_events_per_session: int = MAX_EVENT_EXPORTS_PER_SESSION,
                 server_id: bytes | None = None) -> None:
        self._token_of = token_of
        self._max = max_per_session
        self._max_events = max_events_per_session
        self.server_id = server_id if server_id is not None else secrets.token_bytes(8)
        self._exports: dict[int, _Export] = {}
        self._by_session: dict[int, set[int]] = {}
        # (session, the driver's event handle) -> its export: PyTorch exports one event per
        # CUDA tensor it sends, mostly the same few events again, which keep their handle.
        self._event_ids: dict[tuple[int, bytes], int] = {}
        self._events_of: dict[int, int] = {}  # how many of a session's exports are events
        self._next_id = secrets.randbits(32) + 1  # ids are not the secret; just not reused

    def __len__(self) -> int:
        return len(self._exports)

    def export(self, session_id: int, fd: int, size: int, offset: int = 0) -> IpcHandle:
        """Keep `fd` (the broker owns it from now on, also when it refuses: it is closed then)
        for `session_id` and answer the handle its program may pass to another process."""
        try:
            if size <= 0 or not 0 <= offset < size:
                raise IpcRefused(CUDA_ERROR_INVALID_VALUE,
                                 f"an exported allocation of {size} bytes with the pointer at "
                                 f"{offset}")
            return self._keep(session_id, fd, size, offset, b"")
        except IpcRefused:
            os.close(fd)
            raise

    def export_event(self, session_id: int, driver_handle: bytes) -> IpcHandle:
        """Keep the driver's CUipcEventHandle of an event of `session_id` and answer the handle
        its program may pass to another process (the driver's bytes are not in it)."""
        if len(driver_handle) != HANDLE_SIZE:
            raise IpcRefused(CUDA_ERROR_INVALID_VALUE,
                             f"an event handle of {len(driver_handle)} bytes, not {HANDLE_SIZE}")
        key = (session_id, bytes(driver_handle))
        known = self._exports.get(self._event_ids.get(key, 0))
        if known is not None and known.session_id == session_id:
            return IpcHandle(self._event_ids[key], known.secret, 0, 0, self.server_id, True)
        return self._keep(session_id, None, 0, 0, bytes(driver_handle))

    def _keep(self, session_id: int, fd: int | None, size: int, offset: int,
              event: bytes) -> IpcHandle:
        token = self._token_of(session_id)
        if token is None:
            raise IpcRefused(CUDA_ERROR_INVALID_VALUE,
                             f"session {session_id} is not running on this server")
        mine = self._by_session.setdefault(session_id, set())
        events = self._events_of.get(session_id, 0)
        kept = events if event else len(mine) - events
        if event and kept >= self._max_events:
            raise IpcRefused(CUDA_ERROR_OUT_OF_MEMORY,
                             f"this process already exported {self._max_events} different "
                             "interprocess events (cuIpcGetEventHandle), which the server keeps "
                             "until the process ends; export the same events again instead of "
                             "new ones (or restart the process)")
        if not event and kept >= self._max:
            raise IpcRefused(CUDA_ERROR_OUT_OF_MEMORY,
                             f"this process already has {self._max} CUDA IPC memory handles "
                             "open on the server; close some (cuIpcCloseMemHandle in the "
                             "processes that opened them, then free the memory)")
        handle_id = self._next_id
        self._next_id += 1
        secret = secrets.token_bytes(SECRET_SIZE)
        self._exports[handle_id] = _Export(session_id, token, fd, size, secret, event)
        mine.add(handle_id)
        if event:
            self._event_ids[(session_id, event)] = handle_id
            self._events_of[session_id] = events + 1
        return IpcHandle(handle_id, secret, size, offset, self.server_id, bool(event))

    def open(self, session_id: int, handle: IpcHandle) -> tuple[int, int]:
        """A new fd (the caller closes it once sent) of the allocation `handle` names, and its
        size, for a session of the exporter's token. IpcRefused otherwise, saying why in words
        that do not tell a stranger whether the handle exists."""
        exp = self._find(session_id, handle)
        if exp.fd is None or not 0 <= handle.offset < exp.size or handle.size != exp.size:
            # The shim maps the opened range by the handle's size: it must be the export's.
            raise IpcRefused(CUDA_ERROR_INVALID_VALUE,
                             f"the CUDA IPC handle says {handle.size} bytes, {handle.offset} into "
                             f"an allocation of {exp.size}: it was altered")
        fd = os.dup(exp.fd)
        exp.importers.add(session_id)
        return fd, exp.size

    def open_event(self, session_id: int, handle: IpcHandle) -> bytes:
        """The driver's CUipcEventHandle of the event `handle` names, for a session of the
        exporter's token; IpcRefused otherwise (as `open`)."""
        exp = self._find(session_id, handle)
        if not exp.event:
            raise IpcRefused(CUDA_ERROR_INVALID_VALUE,
                             "the CUDA IPC event handle names memory: it was altered")
        return exp.event  # not an importer of memory: an event keeps nothing of the GPU

    def _find(self, session_id: int, handle: IpcHandle) -> _Export:
        if handle.server != self.server_id:
            raise IpcRefused(CUDA_ERROR_INVALID_VALUE,
                             "the CUDA IPC handle was made on another server (or by a previous "
                             "gpupoold); only processes whose GPUs are on the same server can "
                             "share device memory this way")
        token = self._token_of(session_id)
        exp = self._exports.get(handle.handle_id)
        ok = (exp is not None and token is not None
              and hmac.compare_digest(exp.secret, handle.secret)
              and hmac.compare_digest(exp.token.encode(), token.encode()))
        if not ok or exp is None:
            raise IpcRefused(CUDA_ERROR_INVALID_VALUE,
                             "the CUDA IPC handle is not one of this job's open handles: it was "
                             "made by a program of another token, altered, or its process has "
                             "ended")
        return exp

    def session_ended(self, session_id: int) -> set[int]:
        """Close every fd the session exported (call when its lease ends). Answers the other
        sessions that opened any of them: they may still map the memory on the exporter's GPU,
        which the driver keeps for them, so the daemon ends them before it scrubs that GPU
        (docs/multi-gpu.md, "Open point")."""
        importers: set[int] = set()
        self._events_of.pop(session_id, None)
        for handle_id in self._by_session.pop(session_id, set()):
            exp = self._exports.pop(handle_id, None)
            if exp is not None and exp.event:
                self._event_ids.pop((session_id, exp.event), None)
            if exp is not None and exp.fd is not None:
                os.close(exp.fd)
                importers |= exp.importers
        importers.discard(session_id)
        return importers

    def lease_ended(self, lease_id: int) -> None:
        """session_ended for the daemon's LeaseEnded (gpupoold/app.py subscribes it)."""
        importers = self.session_ended(lease_id)
        if importers:
            # docs/multi-gpu.md, "Open point": they may still map memory of the ended lease.
            log.info("lease %d ended while leases %s map its CUDA IPC memory", lease_id,
                     ", ".join(str(i) for i in sorted(importers)))

    def close(self) -> None:
        """Close every fd (the daemon stops)."""
        for session_id in list(self._by_session):
            self.session_ended(session_id)


CUDA_ERROR_NOT_SUPPORTED = 801
_NO_BROKER = ("CUDA IPC is not available on this server (gpupoold runs without its IPC broker)")


# The worker's requests that `answer` answers (the supervisor routes them here).
REQUESTS: tuple[type, ...] = (gp.WorkerIpcExport, gp.WorkerIpcOpen, gp.WorkerIpcExportEvent,
                              gp.WorkerIpcOpenEvent)


def answer(broker: IpcBroker | None, session_id: int | None, ev: Any,
           fds: list[int]) -> tuple[Any, int | None]:
    """The answer to a worker's request of REQUESTS (`ev`, with the fds that came with it, which
    this takes over) for the worker serving `session_id`: the message to send back and the fd to
    send with it (the caller closes it once sent), or None.
    The session is the one gpupoold assigned to that worker, not what the message claims."""
    fd = fds.pop(0) if len(fds) == 1 else None
    for extra in fds:
        os.close(extra)
    fds.clear()
    code, error = 0, ""
    try:
        if broker is None:
            raise IpcRefused(CUDA_ERROR_NOT_SUPPORTED, _NO_BROKER)
        if session_id is None or ev.session_id != session_id:
            raise IpcRefused(CUDA_ERROR_INVALID_VALUE,
                             f"the worker asked for session {ev.session_id}, which it does not "
                             "serve")
        if isinstance(ev, gp.WorkerIpcExport):
            if fd is None:
                raise IpcRefused(CUDA_ERROR_INVALID_VALUE,
                                 "the worker's export came without its memory")
            handle = broker.export(session_id, fd, ev.size, ev.offset)
            fd = None  # the broker owns it now
            return gp.WorkerIpcExported(session_id=ev.session_id, handle=handle.pack()), None
        if isinstance(ev, gp.WorkerIpcExportEvent):
            handle = broker.export_event(session_id, bytes(ev.event))
            return gp.WorkerIpcExported(session_id=ev.session_id, handle=handle.pack()), None
        if isinstance(ev, gp.WorkerIpcOpenEvent):
            event = broker.open_event(session_id, IpcHandle.unpack(ev.handle, event=True))
            return gp.WorkerIpcEventOpened(session_id=ev.session_id, event=event), None
        opened, size = broker.open(session_id, IpcHandle.unpack(ev.handle))
        return gp.WorkerIpcOpened(session_id=ev.session_id, size=size), opened
    except IpcRefused as exc:
        code, error = exc.code, exc.message
    finally:
        if fd is not None:
            os.close(fd)
    if isinstance(ev, (gp.WorkerIpcExport, gp.WorkerIpcExportEvent)):
        return gp.WorkerIpcExported(session_id=ev.session_id, code=code, error=error), None
    if isinstance(ev, gp.WorkerIpcOpenEvent):
        return gp.WorkerIpcEventOpened(session_id=ev.session_id, code=code, error=error), None
    return gp.WorkerIpcOpened(session_id=ev.session_id, code=code, error=error), None
