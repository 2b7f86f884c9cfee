"""The fleet as one view: every server with its GPUs, the leases running anywhere and the one
queue, for `GET /api/v1/fleet`, the dashboard's Fleet page and the info reply (`gpupool status`,
`gpupool smi`). On a shared store the GPUs and the queue are those the fleet queue's last sync saw
(pool/fleet.py, at most a second old); on a single server (SQLite), this server's own."""

from __future__ import annotations

from typing import Any

from gpupoold.pool.fleet import FleetQueue
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.slots import DRAINED, QUARANTINED
from gpupoold.pool.views import PoolViews
from gpupoold.store.database import Store

OUT_OF_SERVICE = (QUARANTINED, DRAINED, "draining")


def fleet_gpus(fleet: FleetQueue | None, views: PoolViews, this: str, address: str,
               states: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every GPU of the fleet, grouped by server (in name order), each with its server's name,
    address and state (`states`: fresher than the last sync's); `available`: its server is up
    and the GPU in service."""
    if fleet is None or fleet.last is None:
        return [{"server": this, "address": address, "server_state": "up", "this": True,
                 "index": g["index"], "name": g["name"], "uuid": g["uuid"],
                 "simulated": g["simulated"], "memory_total": g["memory_total"],
                 "state": g["state"], "available": g["state"] not in OUT_OF_SERVICE
                 and not g["draining"],
                 "lease_id": g["lease"]["id"] if g["lease"] else None,
                 "token": g["lease"]["token"] if g["lease"] else "", "held": False}
                for g in views.gpu_views()]
    res = fleet.last
    out = []
    for g in res.gpus:
        srv = res.servers.get(g.server, {})
        state = (states or {}).get(g.server) or srv.get("state", "unknown")
        up = state == "up"
        out.append({"server": g.server, "address": srv.get("remoting", ""),
                    "server_state": state, "this": g.server == this,
                    "index": g.index, "name": g.name, "uuid": g.uuid, "simulated": g.simulated,
                    "memory_total": g.memory_total,
                    "state": g.state if up else "unavailable",
                    "available": up and g.state not in OUT_OF_SERVICE,
                    "lease_id": g.lease_id, "token": g.token or g.holder_token,
                    "held": g.holder is not None and g.lease_id is None})
    return out


def fleet_queue(fleet: FleetQueue | None, views: PoolViews, this: str) -> list[dict[str, Any]]:
    """The clients waiting anywhere, in the order they will be served."""
    if fleet is None or fleet.last is None:
        return [{**w, "server": this} for w in views.queue_view()]
    waiting = [q for q in fleet.last.queue if q.state == "waiting"]
    return [{"position": n + 1, "ticket": q.ticket, "server": q.server, "token": q.token,
             "client": q.client, "request": Requirements(**q.request, gpus=q.gpus,
                                                            spread=q.spread).describe(),
             "since": q.joined} for n, q in enumerate(waiting)]


def sync_ms(fleet: FleetQueue | None) -> dict[str, float] | None:
    """How long this server's last syncs took (up to 1000 of them), in ms: p50, p99, max and
    their number; None on a single server or before the first sync."""
    took = sorted(fleet.sync_seconds) if fleet is not None else []
    if not took:
        return None

    def at(p: float) -> float:
        return round(took[min(len(took) - 1, int(p * len(took)))] * 1000, 2)

    return {"p50": at(0.5), "p99": at(0.99), "max": at(1.0), "n": len(took)}


async def fleet_view(views: PoolViews, store: Store, address: str) -> dict[str, Any]:
    fleet: FleetQueue | None = views.fleet
    this = store.server
    registered = await store.servers()
    gpus = fleet_gpus(fleet, views, this, address, {s["name"]: s["state"] for s in registered})
    servers = []
    for s in registered:
        if fleet is None and s["name"] != this:
            continue  # a SQLite file names no other server
        servers.append({**s, "this": s["name"] == this,
                        "gpus": [g for g in gpus if g["server"] == s["name"]]})
    if not servers:  # not registered yet (starting)
        servers.append({"name": this, "remoting": address, "state": "up", "this": True,
                        "gpus": gpus})
    leases = [r.to_json() for r in await store.leases("active", 1000)]
    return {"this": this, "shared": fleet is not None,
            "synced": fleet.last_ok if fleet is not None else None,
            "store_error": fleet.error if fleet is not None else None,
            "syncs": fleet.syncs if fleet is not None else 0,
            "sync_ms": sync_ms(fleet),
            "servers": servers, "leases": leases,
            "queue": fleet_queue(fleet, views, this)}
