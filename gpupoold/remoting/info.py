"""The `info` request (protocol 1.1): what this server has, without taking a GPU.

A client sends `info` instead of `hello` as the first frame of a connection (`gpupool status`,
`gpupool smi`, the NVML shim, server selection). gpupoold authenticates it as a hello, answers
with counts for the client's requirements, the server's facts and its views of the GPUs, the
active leases and the queue as records of the spec (protocol/gpupool.toml: info_gpu,
info_lease, info_waiter), and closes the connection (remoting/listener.py does the I/O). The
views are the HTTP API's own (`PoolViews`, pool/views.py), so `info` and `GET /api/v1/gpus`
never disagree. docs/protocol.md, "info", is the reference.

`InfoCache` builds the reply: the views are turned into records and encoded once per change (or
every CACHE_TTL seconds) for every caller; only `you`, each lease's and waiter's `mine`, and
whether its client's command line shows whole or by the program's name only (pool/privacy.py:
the owner's token and admins see the arguments) are per caller. Large snapshots are encoded in
a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gpupool_protocol as gp

from gpupoold import __version__
from gpupoold.config.settings import Settings
from gpupoold.pool.fleet_view import fleet_gpus
from gpupoold.pool.leases import LeaseManager
from gpupoold.pool.privacy import program_name, sees_arguments
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.views import PoolViews
from gpupoold.remoting.handshake import Refusal, clip, parse_first_frame, server_banner

# The spec's limits on the reply's arrays (records:info_gpu:1024 and so on): what is past them is
# left out, and `truncated` says so.
GPU_LIMIT = 1024
LEASE_LIMIT = 4096
QUEUE_LIMIT = 4096
SHARE_LIMIT = 4096  # records:info_share:4096 share_views (protocol 1.7)
LEASE_GPU_LIMIT = 16384  # records:info_lease_gpu:16384 lease_gpus (protocol 1.7)
UNKNOWN = -1  # an integer the server does not know (NaN for a float)


def parse_info(body: bytes) -> gp.Info | Refusal:
    """The decoded request, or the refusal to send back (GP_EVERSION, GP_EPROTO)."""
    result: gp.Info | Refusal = parse_first_frame(body, gp.Info, "info", "gpupool client")
    return result


def refusal(refused: Refusal) -> gp.InfoReply:
    """The reply to a refused info request: counts 0, no views."""
    return gp.InfoReply(result=refused.result, major=gp.MAJOR, minor=gp.MINOR,
                        message=clip(refused.message, 4095), server=clip(server_banner(), 255),
                        cuda_driver_version=UNKNOWN, time=math.nan)


def _mine(view: dict[str, Any], name: str, host: str) -> bool:
    client = view.get("client") or {}
    return bool(host) and view.get("token") == name and client.get("host") == host


# ------------------------------------------------------------------------------ views -> records
def _text(value: Any, limit: int) -> str:
    return clip("" if value is None else str(value), limit)


def _int(value: Any, low: int, high: int) -> int:
    """An integer view value within the field's range, UNKNOWN (or 0 for unsigned fields) when
    it is missing, not a whole number, or out of range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return UNKNOWN if low < 0 else 0
    if isinstance(value, float) and not value.is_integer():
        value = round(value)
    n = int(value)
    return n if low <= n <= high else (UNKNOWN if low < 0 else 0)


def _i32(value: Any) -> int:
    return _int(value, -(1 << 31), (1 << 31) - 1)


def _i64(value: Any) -> int:
    return _int(value, -(1 << 63), (1 << 63) - 1)


def _u32(value: Any) -> int:
    return _int(value, 0, 0xFFFFFFFF)


def _u64(value: Any) -> int:
    return _int(value, 0, (1 << 64) - 1)


def _f64(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def server_view(settings: Settings, views: PoolViews, remoting: str) -> dict[str, Any]:
    """The server's facts the reply carries."""
    telemetry = views.telemetry
    gpus = [s.gpu for s in views.slots]
    return {
        "version": __version__, "host": socket.gethostname(), "remoting": remoting,
        "auth": settings.auth, "simulated": bool(gpus) and all(g.simulated for g in gpus),
        "driver_version": telemetry.driver_version if telemetry is not None else "",
        "cuda_driver_version": telemetry.cuda_driver_version if telemetry is not None else 0,
    }


def gpu_record(view: dict[str, Any]) -> gp.InfoGpu:
    """A GPU view (PoolViews.gpu) as the reply's record."""
    live = view.get("live") or {}
    lease = view.get("lease") or {}
    return gp.InfoGpu(
        index=_u32(view.get("index")), name=_text(view.get("name"), 255),
        uuid=_text(view.get("uuid"), 95), simulated=int(bool(view.get("simulated"))),
        memory_total=_u64(view.get("memory_total")),
        pci_bus_id=_text(view.get("pci_bus_id"), 31), state=_text(view.get("state"), 15),
        since=_f64(view.get("since")), draining=int(bool(view.get("draining"))),
        worker_ready=int(bool(view.get("worker_ready"))), lease_id=_u64(lease.get("id")),
        live_at=_f64(live.get("at")), live_memory_total=_i64(live.get("memory_total")),
        memory_used=_i64(live.get("memory_used")), memory_free=_i64(live.get("memory_free")),
        gpu_util=_i32(live.get("gpu_util")), memory_util=_i32(live.get("memory_util")),
        temperature_c=_i32(live.get("temperature_c")), power_w=_f64(live.get("power_w")),
        power_limit_w=_f64(live.get("power_limit_w")), energy_j=_f64(live.get("energy_j")),
        sm_clock_mhz=_i32(live.get("sm_clock_mhz")),
        mem_clock_mhz=_i32(live.get("mem_clock_mhz")),
        cuda_driver_version=_i32(live.get("cuda_driver_version")))


def _client(view: dict[str, Any], full: bool) -> dict[str, Any]:
    """The client's fields; `full`: its whole command line, else the program's name only
    (pool/privacy.py)."""
    c = view.get("client") or {}
    program = _text(c.get("program"), 1023)
    return {"client_host": _text(c.get("host"), 255), "client_user": _text(c.get("user"), 255),
            "client_pid": _u32(c.get("pid")),
            "client_program": program if full else program_name(program),
            "client_peer": _text(c.get("peer"), 255)}


def _full(view: dict[str, Any], name: str, role: str) -> bool:
    """Whether the caller `name` (`role`) sees the arguments of this lease's or waiter's
    command line: its owner and admins do."""
    return sees_arguments(name, role, str(view.get("token") or ""))


def lease_record(view: dict[str, Any], mine: bool, full: bool = True) -> gp.InfoLease:
    """An active lease view (pool/views.lease_view) as the reply's record; `full`: with the
    client's whole command line, else its program's name only."""
    return gp.InfoLease(
        id=_u64(view.get("id")),
        gpu=gp.GP_INFO_NO_GPU if view.get("gpu") is None else _u32(view.get("gpu")),
        token=_text(view.get("token"), 255),
        **_client(view, full), request=_text(view.get("request"), 1023),
        started=_f64(view.get("started")), duration_s=_f64(view.get("duration_s")),
        queued_s=_f64(view.get("queued_s")), worker_pid=_u32(view.get("worker_pid")),
        bytes_h2d=_u64(view.get("bytes_h2d")), bytes_d2h=_u64(view.get("bytes_d2h")),
        module_bytes=_u64(view.get("module_bytes")), mine=int(mine))


def waiter_record(view: dict[str, Any], mine: bool, full: bool = True) -> gp.InfoWaiter:
    """A queue entry (pool/waitqueue.WaitQueue.view) as the reply's record (`full`: as in
    lease_record)."""
    return gp.InfoWaiter(
        position=_u32(view.get("position")), ticket=_u64(view.get("ticket")),
        token=_text(view.get("token"), 255), **_client(view, full),
        request=_text(view.get("request"), 1023), since=_f64(view.get("since")),
        waiting_s=_f64(view.get("waiting_s")), mine=int(mine))


def _closed_to_shares(view: dict[str, Any], shared: dict[str, Any]) -> bool:
    """Whether a shared GPU takes no new share now, whatever the reason: kept for a whole-GPU
    request (drained of its shares for it), a share's worker died (no new share until its whole
    scrub), or the GPU is drained."""
    return bool(shared.get("closed") or shared.get("kept_for_ticket") is not None
                or view.get("draining") or view.get("state") in ("drained", "quarantined"))


def shared_records(gpu_views: list[dict[str, Any]],
                   ) -> tuple[list[gp.InfoSharedGpu], list[gp.InfoShare]]:
    """The shared GPUs of the GPU views (issue 32) and each share they hold, as the reply's
    records (protocol 1.7). A share names its lease only: the lease views say who holds it, as
    each caller may see it, so the records are the same for every caller."""
    gpus, shares = [], []
    for view in gpu_views[:GPU_LIMIT]:
        shared = view.get("shares")
        if not isinstance(shared, dict):
            continue
        held = [s for s in shared.get("leases") or [] if isinstance(s, dict)]
        index = _u32(view.get("index"))
        gpus.append(gp.InfoSharedGpu(gpu=index, max_shares=_u32(shared.get("max")),
                                     shares=_u32(len(held)),
                                     closed=int(_closed_to_shares(view, shared))))
        for s in held:
            shares.append(gp.InfoShare(
                gpu=index, lease_id=_u64(s.get("id")), memory_quota=_u64(s.get("memory_quota")),
                memory_used=_u64(s.get("memory_used")), busy_s=_f64(s.get("busy_s"))))
    return gpus, shares[:SHARE_LIMIT]


def lease_gpu_records(leases: list[dict[str, Any]]) -> list[gp.InfoLeaseGpu]:
    """Every GPU of every lease of the reply (issue 37), device 0 first (protocol 1.7)."""
    out = [gp.InfoLeaseGpu(lease_id=_u64(v.get("id")), gpu=_u32(g))
           for v in leases[:LEASE_LIMIT] for g in v.get("gpus") or []]
    return out[:LEASE_GPU_LIMIT]


def _over_limits(gpu_views: list[dict[str, Any]], leases: list[dict[str, Any]],
                 queue: list[dict[str, Any]]) -> bool:
    """Whether the reply leaves something out (`truncated`)."""
    shares = sum(len((v.get("shares") or {}).get("leases") or []) for v in gpu_views
                 if isinstance(v.get("shares"), dict))
    lease_gpus = sum(len(v.get("gpus") or []) for v in leases[:LEASE_LIMIT])
    return (len(leases) > LEASE_LIMIT or len(queue) > QUEUE_LIMIT or len(gpu_views) > GPU_LIMIT
            or shares > SHARE_LIMIT or lease_gpus > LEASE_GPU_LIMIT)


def reply(settings: Settings, views: PoolViews, remoting: str, name: str, role: str, host: str,
          counts: Sequence[int] = (0, 0, 0, 0), now: float | None = None,
          fingerprint: str = "") -> gp.InfoReply:
    """The reply (result 0) for the caller `name` (`role`) on client host `host`, with the
    counts (gpus, matching, free_matching, queue) and this server's TLS `fingerprint`. The
    reference: InfoCache gives the same bytes without building the shared parts again for every
    caller (tests/test_info.py compares)."""
    leases, queue = views.active_leases(), views.queue_view()
    gpu_views = views.gpu_views()
    shared_gpus, shares = shared_records(gpu_views)
    srv = server_view(settings, views, remoting)
    return gp.InfoReply(
        result=0, major=gp.MAJOR, minor=gp.MINOR, message="", server=clip(server_banner(), 255),
        gpus=_u32(counts[0]), matching=_u32(counts[1]), free_matching=_u32(counts[2]),
        queue=_u32(counts[3]), version=_text(srv["version"], 63),
        host=_text(srv["host"], 255), remoting=_text(srv["remoting"], 255),
        auth=_text(srv["auth"], 15), simulated=int(srv["simulated"]),
        driver_version=_text(srv["driver_version"], 79),
        cuda_driver_version=_i32(srv["cuda_driver_version"]),
        you_name=_text(name, 255), you_role=_text(role, 15),
        time=time.time() if now is None else now,
        truncated=int(_over_limits(gpu_views, leases, queue)),
        gpu_views=[gpu_record(v) for v in gpu_views[:GPU_LIMIT]],
        lease_views=[lease_record(v, _mine(v, name, host), _full(v, name, role))
                     for v in leases[:LEASE_LIMIT]],
        queue_views=[waiter_record(v, _mine(v, name, host), _full(v, name, role))
                     for v in queue[:QUEUE_LIMIT]],
        fleet_gpus=[fleet_record(g) for g in _fleet(views, remoting)[:FLEET_LIMIT]],
        fingerprint=_text(fingerprint, 63), fleet_servers=fleet_servers(views)[:SERVER_LIMIT],
        shared_gpus=shared_gpus, share_views=shares, lease_gpus=lease_gpu_records(leases))


# ------------------------------------------------------------------------------------ the cache
CACHE_TTL = 0.5  # seconds a snapshot of the views serves while nothing changed
THREAD_ITEMS = 200  # leases + queue entries above which a snapshot is encoded in a thread
THREAD_BYTES = 256 * 1024  # replies larger than this are put together in a thread
_MINE = (0).to_bytes(4, "little"), (1).to_bytes(4, "little")


@dataclass(frozen=True)
class _Entry:
    """A lease or waiter record, encoded with mine = 0. `mine` is the record's last field (a
    u32), so a caller's copy differs in the last 4 bytes only. `body` carries the client's whole
    command line, for its owner and admins; `private` the program's name only, for everyone
    else (None: the two are the same)."""

    body: bytes
    token: object
    host: object
    private: bytes | None = None

    def for_caller(self, name: str, role: str) -> bytes:
        if self.private is None or sees_arguments(name, role, str(self.token or "")):
            return self.body
        return self.private


@dataclass(frozen=True)
class _Snapshot:
    """The caller-independent parts of the reply, encoded once."""

    key: tuple[Any, ...]
    made: float  # loop time
    server: dict[str, Any]
    time: float
    gpus: bytes  # the gpu_views array: count, then the records
    leases: tuple[_Entry, ...]
    queue: tuple[_Entry, ...]
    truncated: bool
    size: int  # bytes of the encoded parts
    fleet: bytes = b"\0\0\0\0"  # the fleet_gpus array
    # fingerprint and the fleet_servers array (protocol 1.4), the shared_gpus, share_views and
    # lease_gpus arrays (protocol 1.7)
    tail: bytes = b"\0" * 20

    def compose(self, name: str, role: str, host: str, counts: Sequence[int]) -> bytes:
        """The reply body for one caller: exactly reply(...).encode() at `time`."""
        def part(entries: tuple[_Entry, ...]) -> bytes:
            out = [len(entries).to_bytes(4, "little")]
            for e in entries:
                body = e.for_caller(name, role)
                out.append(body[:-4] + _MINE[1] if bool(host) and e.token == name
                           and e.host == host else body)
            return b"".join(out)

        srv = self.server
        head = gp.InfoReply(
            result=0, major=gp.MAJOR, minor=gp.MINOR, message="",
            server=clip(server_banner(), 255), gpus=_u32(counts[0]), matching=_u32(counts[1]),
            free_matching=_u32(counts[2]), queue=_u32(counts[3]),
            version=_text(srv["version"], 63), host=_text(srv["host"], 255),
            remoting=_text(srv["remoting"], 255), auth=_text(srv["auth"], 15),
            simulated=int(srv["simulated"]), driver_version=_text(srv["driver_version"], 79),
            cuda_driver_version=_i32(srv["cuda_driver_version"]), you_name=_text(name, 255),
            you_role=_text(role, 15), time=self.time, truncated=int(self.truncated)).encode()
        # The four arrays, the fingerprint and the four arrays after it come last in the
        # reply: the empty ones (4 x u32 0, an empty string's u32 0, 4 x u32 0) are replaced
        # by them.
        return (head[:-len(_EMPTY_END)] + self.gpus + part(self.leases) + part(self.queue)
                + self.fleet + self.tail)


def _entries(make: Any, views: list[dict[str, Any]]) -> tuple[_Entry, ...]:
    """The views as entries; `make(view, mine, full)` gives a view's record."""
    out = []
    for view in views:
        client = view.get("client") or {}
        body = _encode_record(make(view, False, True))
        program = str(client.get("program") or "")
        private = (None if program_name(program) == program
                   else _encode_record(make(view, False, False)))
        out.append(_Entry(body, view.get("token"), client.get("host"), private))
    return tuple(out)


def _encode_record(record: Any) -> bytes:
    w = gp.Writer()
    record._put(w)
    return w.getvalue()


def _encode_lists(leases: list[dict[str, Any]], queue: list[dict[str, Any]],
                  ) -> tuple[tuple[_Entry, ...], tuple[_Entry, ...]]:
    """The lease and queue views as encoded records (mine = 0), within the limits."""
    leases, queue = leases[:LEASE_LIMIT], queue[:QUEUE_LIMIT]
    return _entries(lease_record, leases), _entries(waiter_record, queue)


FLEET_LIMIT = 4096  # the spec's limit on fleet_gpus


def fleet_record(g: dict[str, Any]) -> gp.InfoFleetGpu:
    """A fleet GPU (pool/fleet_view.fleet_gpus) as the reply's record."""
    return gp.InfoFleetGpu(
        server=_text(g["server"], 255), address=_text(g["address"], 255),
        server_state=_text(g["server_state"], 15), this=int(bool(g["this"])),
        index=_u32(g["index"]), name=_text(g["name"], 255), uuid=_text(g["uuid"], 95),
        memory_total=_u64(g["memory_total"]), state=_text(g["state"], 15),
        available=int(bool(g["available"])), lease_id=_u64(g["lease_id"] or 0),
        token=_text(g["token"], 255))


SERVER_LIMIT = 256  # the spec's limit on fleet_servers
_EMPTY_END = b"\0" * (4 * 4 + 4 + 4 * 4)


def fleet_servers(views: PoolViews) -> list[gp.InfoFleetServer]:
    """Every server of the fleet as the last sync of the fleet queue saw it (name order), with
    the remoting address clients are sent to and the fingerprint it registered: what a client
    pins for a redirect, learnt over the channel it already trusts (none without a shared
    store)."""
    fleet = views.fleet
    if fleet is None or fleet.last is None:
        return []
    return [gp.InfoFleetServer(
        server=_text(name, 255), address=_text(s.get("remoting", ""), 255),
        server_state=_text(s.get("state", ""), 15), this=int(name == fleet.server),
        fingerprint=_text(s.get("fingerprint", ""), 63))
        for name, s in sorted(fleet.last.servers.items())]


def _encode_tail(fingerprint: str, servers: list[gp.InfoFleetServer],
                 gpu_views: list[dict[str, Any]], leases: list[dict[str, Any]]) -> bytes:
    w = gp.Writer()
    w.string(_text(fingerprint, 63), 63)
    w.records(servers[:SERVER_LIMIT], SERVER_LIMIT)
    shared_gpus, shares = shared_records(gpu_views)
    w.records(shared_gpus, GPU_LIMIT)
    w.records(shares, SHARE_LIMIT)
    w.records(lease_gpu_records(leases), LEASE_GPU_LIMIT)
    return w.getvalue()


def _fleet(views: PoolViews, remoting: str) -> list[dict[str, Any]]:
    """The fleet's GPUs (none without a shared store: the GPUs above are all there is)."""
    fleet = views.fleet
    return [] if fleet is None else fleet_gpus(fleet, views, fleet.server, remoting)


def _encode_fleet(views: PoolViews, remoting: str) -> bytes:
    w = gp.Writer()
    w.records([fleet_record(g) for g in _fleet(views, remoting)[:FLEET_LIMIT]], FLEET_LIMIT)
    return w.getvalue()


def _encode_gpus(views: list[dict[str, Any]]) -> bytes:
    w = gp.Writer()
    w.records([gpu_record(v) for v in views[:GPU_LIMIT]], GPU_LIMIT)
    return w.getvalue()


class EncodedInfoReply:
    """An info reply whose body is encoded already (InfoCache): sent by the listener like any
    generated message (gp.encode_frame reads OP, IS_REPLY and encode())."""

    OP = gp.InfoReply.OP
    IS_REPLY = True

    def __init__(self, body: bytes, counts: Sequence[int]) -> None:
        self.body = body
        self.gpus, self.matching, self.free_matching, self.queue = (_u32(n) for n in counts)

    def encode(self) -> bytes:
        return self.body


class InfoCache:
    """Answers info requests from a snapshot of the views that is shared by every caller and
    rebuilt when the lease manager's state or the live values change (`PoolViews.view_key`,
    `Telemetry.samples`), or after CACHE_TTL seconds (running durations). Only `you` and each
    entry's `mine` are per caller. Large snapshots are encoded and put together in a thread, so
    that a reply of megabytes never holds up the event loop."""

    def __init__(self, settings: Settings, views: PoolViews, leases: LeaseManager) -> None:
        self.settings = settings
        self.views = views
        self.leases = leases  # the counts for the caller's requirements
        self._snapshot: _Snapshot | None = None
        self._lock = asyncio.Lock()
        self.builds = 0  # snapshots built (tests)
        # This server's remoting TLS identity ("" on plain TCP): set once it is known (app.py).
        self.fingerprint = ""

    def _key(self, remoting: str) -> tuple[Any, ...]:
        telemetry = self.views.telemetry
        fleet = self.views.fleet
        return (remoting, telemetry.samples if telemetry is not None else 0,
                self.views.view_key(), fleet.syncs if fleet is not None else 0)

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
            gpu_views = self.views.gpu_views()
            server = server_view(self.settings, self.views, remoting)
            gpus = _encode_gpus(gpu_views)
            if len(leases) + len(queue) > THREAD_ITEMS:
                lease_entries, queue_entries = await asyncio.to_thread(_encode_lists, leases,
                                                                       queue)
            else:
                lease_entries, queue_entries = _encode_lists(leases, queue)
            truncated = _over_limits(gpu_views, leases, queue)
            size = len(gpus) + sum(len(e.body) for e in lease_entries + queue_entries)
            fleet = _encode_fleet(self.views, remoting)
            tail = _encode_tail(self.fingerprint, fleet_servers(self.views), gpu_views, leases)
            snap = _Snapshot(key, made, server, now, gpus, lease_entries, queue_entries,
                             truncated, size + len(fleet) + len(tail), fleet, tail)
            self._snapshot = snap
            self.builds += 1
            return snap

    async def answer(self, request: gp.Info, name: str, role: str,
                     remoting: str) -> EncodedInfoReply:
        """The reply to an authenticated info request."""
        snap = await self.snapshot(remoting)
        req = Requirements.from_hello(request)
        counts = self.leases.counts(req, name)
        host = request.host.strip()
        if snap.size > THREAD_BYTES:
            body = await asyncio.to_thread(snap.compose, name, role, host, counts)
        else:
            body = snap.compose(name, role, host, counts)
        return EncodedInfoReply(body, counts)
