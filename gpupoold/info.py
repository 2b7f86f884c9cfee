"""The `info` request (protocol 1.1): what this server has, without taking a GPU.

A client sends `info` instead of `hello` as the first frame of a connection (`gpupool status`,
`gpupool smi`, the NVML shim, server selection). gpupoold authenticates it as a hello, answers
with counts for the client's requirements and one JSON document (schema 1), and closes the
connection (remoting.py does the I/O). The document's views are the HTTP API's own (the lease
manager's `gpu_views`, `active_leases`, `queue_view`), so `info` and `GET /api/v1/gpus` never
disagree. docs/protocol.md, "info", is the reference.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

import gpupool_protocol as gp

from gpupoold import __version__
from gpupoold.handshake import Refusal, clip, server_name, version_refusal
from gpupoold.leases import LeaseManager
from gpupoold.requirements import Requirements
from gpupoold.settings import Settings

SCHEMA = 1
JSON_LIMIT = 4194304  # bytes: the reply's json field
_PREFIX = struct.Struct("<IHH")


def parse_info(body: bytes) -> gp.Info | Refusal:
    """The decoded request, or the refusal to send back (GP_EVERSION, GP_EPROTO)."""
    if len(body) < _PREFIX.size:
        return Refusal(gp.GP_EPROTO, f"malformed info: {len(body)} bytes is too short")
    magic, major, minor = _PREFIX.unpack_from(body)
    if magic != gp.MAGIC:
        return Refusal(gp.GP_EVERSION,
                       f"not a gpupool client: info magic is 0x{magic:08x}, expected "
                       f"0x{gp.MAGIC:08x} (protocol {gp.MAJOR}.{gp.MINOR}); use the gpupool "
                       "client that matches this server")
    if major != gp.MAJOR:
        return version_refusal(major, minor)
    try:
        return gp.Info.decode(body)
    except gp.ProtocolError as exc:
        if minor > gp.MINOR:
            return Refusal(gp.GP_EVERSION,
                           f"client speaks protocol {major}.{minor}, this server speaks "
                           f"{gp.MAJOR}.{gp.MINOR} and cannot read its info request ({exc}); "
                           "upgrade gpupoold on this server")
        return Refusal(gp.GP_EPROTO, f"malformed info: {exc}")


def refusal(refused: Refusal) -> gp.InfoReply:
    """The reply to a refused info request: counts 0, json ""."""
    return gp.InfoReply(result=refused.result, major=gp.MAJOR, minor=gp.MINOR,
                        message=clip(refused.message, 4095), server=clip(server_name(), 255))


def _mine(view: dict[str, Any], name: str, host: str) -> dict[str, Any]:
    client = view.get("client") or {}
    return {**view, "mine": bool(host) and view.get("token") == name
            and client.get("host") == host}


def document(settings: Settings, leases: LeaseManager, remoting: str, name: str, role: str,
             host: str) -> dict[str, Any]:
    """The info json (schema 1) for the caller `name` (`role`) on client host `host`."""
    telemetry = leases.telemetry
    gpus = [s.gpu for s in leases.slots]
    return {
        "schema": SCHEMA,
        "server": {
            "version": __version__, "host": socket.gethostname(), "remoting": remoting,
            "protocol": f"{gp.MAJOR}.{gp.MINOR}", "auth": settings.auth,
            "simulated": bool(gpus) and all(g.simulated for g in gpus),
            "driver_version": telemetry.driver_version if telemetry is not None else "",
            "cuda_driver_version": (telemetry.cuda_driver_version if telemetry is not None
                                    else 0),
        },
        "you": {"name": name, "role": role},
        "time": time.time(),
        "gpus": leases.gpu_views(),
        "leases": [_mine(v, name, host) for v in leases.active_leases()],
        "queue": [_mine(v, name, host) for v in leases.queue_view()],
    }


def encode_document(doc: dict[str, Any]) -> str:
    """The document as JSON within the reply's limit: when it does not fit (thousands of
    leases), the queue and then the leases are left out and `"truncated": true` says so."""
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    if len(text.encode()) <= JSON_LIMIT:
        return text
    for key in ("queue", "leases"):
        doc = {**doc, key: [], "truncated": True}
        text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
        if len(text.encode()) <= JSON_LIMIT:
            return text
    doc = {**doc, "gpus": []}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


def _u32(n: int) -> int:
    return max(0, min(n, 0xFFFFFFFF))


def answer(settings: Settings, leases: LeaseManager, remoting: str, request: gp.Info,
           name: str, role: str) -> gp.InfoReply:
    """The reply to an authenticated info request."""
    req = Requirements.from_hello(request)
    gpus, matching, free, queue = leases.counts(req, name)
    doc = document(settings, leases, remoting, name, role, request.host.strip())
    return gp.InfoReply(result=0, major=gp.MAJOR, minor=gp.MINOR, message="",
                        server=clip(server_name(), 255), gpus=_u32(gpus),
                        matching=_u32(matching), free_matching=_u32(free), queue=_u32(queue),
                        json=encode_document(doc))
