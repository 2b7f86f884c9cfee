"""The `info` request (protocol 1.1): what this server has, without taking a GPU.

A client sends `info` instead of `hello` as the first frame of a connection (`gpupool status`,
`gpupool smi`, the NVML shim, server selection). gpupoold authenticates it as a hello, answers
with counts for the client's requirements and one JSON document (schema 1), and closes the
connection (remoting/listener.py does the I/O). The document's views are the HTTP API's own
(`PoolViews`, pool/views.py), so `info` and `GET /api/v1/gpus` never disagree. docs/protocol.md,
"info", is the reference.

`InfoCache` builds the document: the views are encoded once per change (or every CACHE_TTL
seconds) for every caller, and large documents are encoded in a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass
from typing import Any

import gpupool_protocol as gp

from gpupoold import __version__
from gpupoold.config.settings import Settings
from gpupoold.pool.leases import LeaseManager
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.views import PoolViews
from gpupoold.remoting.handshake import Refusal, clip, parse_first_frame, server_name

SCHEMA = 1
JSON_LIMIT = 4194304  # bytes: the reply's json field


def parse_info(body: bytes) -> gp.Info | Refusal:
    """The decoded request, or the refusal to send back (GP_EVERSION, GP_EPROTO)."""
    result: gp.Info | Refusal = parse_first_frame(body, gp.Info, "info", "gpupool client")
    return result


def refusal(refused: Refusal) -> gp.InfoReply:
    """The reply to a refused info request: counts 0, json ""."""
    return gp.InfoReply(result=refused.result, major=gp.MAJOR, minor=gp.MINOR,
                        message=clip(refused.message, 4095), server=clip(server_name(), 255))


def _mine(view: dict[str, Any], name: str, host: str) -> dict[str, Any]:
    client = view.get("client") or {}
    return {**view, "mine": bool(host) and view.get("token") == name
            and client.get("host") == host}


def server_view(settings: Settings, views: PoolViews, remoting: str) -> dict[str, Any]:
    """The document's "server" object."""
    telemetry = views.telemetry
    gpus = [s.gpu for s in views.slots]
    return {
        "version": __version__, "host": socket.gethostname(), "remoting": remoting,
        "protocol": f"{gp.MAJOR}.{gp.MINOR}", "auth": settings.auth,
        "simulated": bool(gpus) and all(g.simulated for g in gpus),
        "driver_version": telemetry.driver_version if telemetry is not None else "",
        "cuda_driver_version": telemetry.cuda_driver_version if telemetry is not None else 0,
    }


def document(settings: Settings, views: PoolViews, remoting: str, name: str, role: str,
             host: str, now: float | None = None) -> dict[str, Any]:
    """The info json (schema 1) for the caller `name` (`role`) on client host `host`."""
    return {
        "schema": SCHEMA,
        "server": server_view(settings, views, remoting),
        "you": {"name": name, "role": role},
        "time": time.time() if now is None else now,
        "gpus": views.gpu_views(),
        "leases": [_mine(v, name, host) for v in views.active_leases()],
        "queue": [_mine(v, name, host) for v in views.queue_view()],
    }


def encode_document(doc: dict[str, Any]) -> str:
    """The document as JSON within the reply's limit: when it does not fit (thousands of
    leases), the queue and then the leases are left out and `"truncated": true` says so.
    The reference encoding: InfoCache produces the same text without encoding the shared parts
    again for every caller (tests/test_info.py compares the two)."""
    text = _dumps(doc)
    if _size(text) <= JSON_LIMIT:
        return text
    for key in ("queue", "leases"):
        doc = {**doc, key: [], "truncated": True}
        text = _dumps(doc)
        if _size(text) <= JSON_LIMIT:
            return text
    doc = {**doc, "gpus": []}
    return _dumps(doc)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _size(text: str) -> int:
    """UTF-8 bytes of `text`."""
    return len(text) if text.isascii() else len(text.encode())


# ------------------------------------------------------------------------------------ the cache
CACHE_TTL = 0.5  # seconds a snapshot of the views serves while nothing changed
THREAD_ITEMS = 200  # leases + queue entries above which a snapshot is encoded in a thread
THREAD_BYTES = 256 * 1024  # snapshots larger than this are put together in a thread
_MINE = (',"mine":false}', ',"mine":true}')


@dataclass(frozen=True)
class _Entry:
    """A lease or queue view, encoded without its closing brace (its "mine" is per caller)."""

    head: str
    token: object
    host: object


@dataclass(frozen=True)
class _Snapshot:
    """The caller-independent parts of the info document, encoded once."""

    key: tuple[Any, ...]
    made: float  # loop time
    server: str
    time: str
    gpus: str
    leases: tuple[_Entry, ...]
    queue: tuple[_Entry, ...]
    size: int  # characters of the parts, roughly the document's size

    def compose(self, name: str, role: str, host: str) -> str:
        """The document for one caller: exactly encode_document(document(...)) at `time`."""
        def part(entries: tuple[_Entry, ...]) -> str:
            return "[" + ",".join(
                e.head + _MINE[bool(host) and e.token == name and e.host == host]
                for e in entries) + "]"

        you = _dumps({"name": name, "role": role})
        leases, queue = part(self.leases), part(self.queue)
        head = f'{{"schema":{SCHEMA},"server":{self.server},"you":{you},"time":{self.time},'
        text = f'{head}"gpus":{self.gpus},"leases":{leases},"queue":{queue}}}'
        if _size(text) <= JSON_LIMIT:
            return text
        text = f'{head}"gpus":{self.gpus},"leases":{leases},"queue":[],"truncated":true}}'
        if _size(text) <= JSON_LIMIT:
            return text
        text = f'{head}"gpus":{self.gpus},"leases":[],"queue":[],"truncated":true}}'
        if _size(text) <= JSON_LIMIT:
            return text
        return f'{head}"gpus":[],"leases":[],"queue":[],"truncated":true}}'


def _entries(views: list[dict[str, Any]]) -> tuple[_Entry, ...]:
    """Each view encoded as `{...` (views are never empty, so `,"mine":...}` completes it)."""
    out = []
    for view in views:
        assert view, "an empty view"
        client = view.get("client") or {}
        out.append(_Entry(_dumps(view)[:-1], view.get("token"), client.get("host")))
    return tuple(out)


def _encode_lists(leases: list[dict[str, Any]], queue: list[dict[str, Any]],
                  ) -> tuple[tuple[_Entry, ...], tuple[_Entry, ...]]:
    return _entries(leases), _entries(queue)


class InfoCache:
    """Answers info requests from a snapshot of the views that is shared by every caller and
    rebuilt when the lease manager's state or the live values change (`PoolViews.view_key`,
    `Telemetry.samples`), or after CACHE_TTL seconds (running durations). Only `you` and each
    entry's `mine` are per caller. Large snapshots are encoded and put together in a thread, so
    that a document of megabytes never holds up the event loop."""

    def __init__(self, settings: Settings, views: PoolViews, leases: LeaseManager) -> None:
        self.settings = settings
        self.views = views
        self.leases = leases  # the counts for the caller's requirements
        self._snapshot: _Snapshot | None = None
        self._lock = asyncio.Lock()
        self.builds = 0  # snapshots built (tests)

    def _key(self, remoting: str) -> tuple[Any, ...]:
        telemetry = self.views.telemetry
        return (remoting, telemetry.samples if telemetry is not None else 0,
                self.views.view_key())

    async def snapshot(self, remoting: str) -> _Snapshot:
        async with self._lock:
            loop = asyncio.get_running_loop()
            key = self._key(remoting)
            snap = self._snapshot
            if snap is not None and snap.key == key and loop.time() - snap.made < CACHE_TTL:
                return snap
            # The views are taken here, on the loop, in one go; only their encoding may move.
            made, now = loop.time(), time.time()
            leases, queue = self.views.active_leases(), self.views.queue_view()
            server = _dumps(server_view(self.settings, self.views, remoting))
            gpus = _dumps(self.views.gpu_views())
            if len(leases) + len(queue) > THREAD_ITEMS:
                lease_entries, queue_entries = await asyncio.to_thread(_encode_lists, leases,
                                                                       queue)
            else:
                lease_entries, queue_entries = _encode_lists(leases, queue)
            size = len(server) + len(gpus) + sum(len(e.head) + 14 for e in lease_entries) + \
                sum(len(e.head) + 14 for e in queue_entries)
            snap = _Snapshot(key, made, server, _dumps(now), gpus, lease_entries,
                             queue_entries, size)
            self._snapshot = snap
            self.builds += 1
            return snap

    async def answer(self, request: gp.Info, name: str, role: str,
                     remoting: str) -> gp.InfoReply:
        """The reply to an authenticated info request."""
        snap = await self.snapshot(remoting)
        req = Requirements.from_hello(request)
        gpus, matching, free, queue = self.leases.counts(req, name)
        host = request.host.strip()
        if snap.size > THREAD_BYTES:
            text = await asyncio.to_thread(snap.compose, name, role, host)
        else:
            text = snap.compose(name, role, host)
        return gp.InfoReply(result=0, major=gp.MAJOR, minor=gp.MINOR, message="",
                            server=clip(server_name(), 255), gpus=_u32(gpus),
                            matching=_u32(matching), free_matching=_u32(free),
                            queue=_u32(queue), json=text)


def _u32(n: int) -> int:
    return max(0, min(n, 0xFFFFFFFF))
