"""The pool as JSON: what `/api/v1`, the dashboard and the info reply show of the lease manager.

The pool's state (pool/state.py, moved by the lease manager's policies) is only read here,
with the telemetry cache's live values (gpu/telemetry.py), to build the dicts the adapters
serialise. One
place decides what a GPU, a lease and the queue look like, so the API, the dashboard and
`gpupool status` always agree.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from gpupoold.gpu.telemetry import unknown_live
from gpupoold.pool.detach import detach_view
from gpupoold.pool.fleet import FleetQueue
from gpupoold.pool.leases import LeaseManager
from gpupoold.pool.slots import DRAINED, FREE, LEASED, QUARANTINED, SCRUBBING, Lease, Slot

if TYPE_CHECKING:
    from gpupoold.gpu.telemetry import Telemetry


def lease_view(lease: Lease) -> dict[str, Any]:
    s = lease.worker.stats
    on = lease.slot.gpu if lease.slot is not None else lease.home  # detached: the GPU it left
    # gpu: the GPU it is on (a lease of several GPUs: its device 0); detached, None (and
    # `detach` says which one it left). gpus: every GPU it is on, program order (issue 37).
    return {"id": lease.id, "gpu": lease.slot.gpu.index if lease.slot is not None else None,
            "gpus": [s.gpu.index for s in lease.slots()],
            "detach": {**detach_view(lease),
                       "left_gpu": lease.home.index if lease.home is not None else None},
            "token": lease.token,
            "client": lease.client.to_json(), "request": lease.req.describe(),
            "started": lease.started, "duration_s": round(time.time() - lease.started, 3),
            "queued_s": round(lease.queued_s, 3), "worker_pid": lease.worker.pid,
            "bytes_h2d": s.bytes_h2d, "bytes_d2h": s.bytes_d2h,
            "module_bytes": s.module_bytes, "calls": dict(s.calls),
            "memory_used": s.mem_used,  # device memory the lease's allocations hold now
            # its worker's quota (GPUPOOL_MEMORY, at most the GPU's memory; 0: no quota), kept
            # while detached (a detached share comes back with it)
            "memory_quota": lease.req.quota(on) if on is not None else 0,
            # a part of a lease spread over several servers (issue 37, item 3): the group its
            # parts share, which part and how many (0, 0, 0 otherwise), as in its record
            "spread_group": lease.req.spread_group, "part": lease.req.part,
            "parts": lease.req.parts}


def shares_view(slot: Slot, shared: bool, share: int) -> dict[str, Any] | None:
    """A shared GPU's shares (issue 32): each with its holder, quota and use; None when the GPU
    is not shared."""
    if not shared:
        return None
    return {"max": share, "closed": slot.share_closed, "kept_for_ticket": slot.kept_for,
            "granted": len(slot.share_grants),
            "leases": [{"id": le.id, "token": le.token, "client": le.client.to_json(),
                        "memory_quota": le.req.quota(slot.gpu),
                        "memory_used": le.worker.stats.mem_used,
                        # GPU time the share had (simulated GPUs; 0 on real ones, not measured)
                        "busy_s": le.worker.stats.busy_ns / 1e9} for le in slot.shares]}


class PoolViews:
    """Views of one lease manager's GPUs, leases and queue. `telemetry` is set while the live
    values are followed (app.py); without it every live value is unknown."""

    def __init__(self, leases: LeaseManager) -> None:
        self.leases = leases
        self.telemetry: Telemetry | None = None

    @property
    def slots(self) -> list[Slot]:
        return self.leases.slots

    @property
    def fleet(self) -> FleetQueue | None:
        """The fleet queue (pool/fleet.py) of a server on a shared store, else None."""
        return self.leases.fleet

    def gpu(self, slot: Slot) -> dict[str, Any]:
        g = slot.gpu
        return {"index": g.index, "name": g.name, "uuid": g.uuid, "simulated": g.simulated,
                "memory_total": g.memory_total, "pci_bus_id": g.pci_bus_id,
                "state": slot.state, "since": slot.since, "draining": slot.draining,
                "lease": lease_view(slot.lease) if slot.lease is not None else None,
                "shares": shares_view(slot, self.leases.share_settings().shared(g.index),
                                      self.leases.settings.share),
                "quarantine": slot.quarantine, "last_scrub": slot.last_scrub,
                "stuck": slot.stuck,
                "worker_ready": slot.idle_worker is not None,
                "live": (self.telemetry.live(g.index) if self.telemetry is not None
                         else unknown_live(g))}

    def lease(self, lease: Lease) -> dict[str, Any]:
        return lease_view(lease)

    def gpu_views(self) -> list[dict[str, Any]]:
        return [self.gpu(s) for s in self.leases.slots]

    def gpu_view(self, index: int) -> dict[str, Any]:
        """One GPU; LeaseError (404) when there is no GPU `index`."""
        return self.gpu(self.leases.slot(index))

    def active_leases(self) -> list[dict[str, Any]]:
        return [lease_view(lease) for lease in sorted(self.leases.active(), key=lambda x: x.id)]

    def queue_view(self) -> list[dict[str, Any]]:
        return self.leases.queue.view()

    def view_key(self) -> tuple[Any, ...]:
        """A value that changes whenever the views above would, except for what moves by itself
        (running durations, waiting times) and the live values (Telemetry.samples): the info
        reply's cache (remoting/info.py) is rebuilt when it changes."""
        slots = tuple((s.state, s.since, s.draining, s.lease,
                       s.lease.worker.stats if s.lease is not None else None,
                       s.quarantine, s.last_scrub, s.idle_worker is not None,
                       s.stuck is not None, tuple(s.shares), len(s.share_grants), s.kept_for,
                       s.share_closed) for s in self.leases.slots)
        leases = tuple((lease, lease.worker.stats, lease.state, lease.keep_gpu)
                       for lease in self.leases.active())
        return slots, leases, tuple(w.ticket for w in self.leases.queue)

    def summary(self) -> dict[str, Any]:
        states = {st: 0 for st in (FREE, LEASED, SCRUBBING, QUARANTINED, DRAINED)}
        for s in self.leases.slots:
            states[s.state] += 1
        stuck = [{"gpu": s.gpu.index, "state": s.state, **s.stuck}
                 for s in self.leases.slots if s.stuck is not None]
        return {"gpus": len(self.leases.slots), "states": states,
                "leases": len(self.leases.active()), "queue": len(self.leases.queue),
                "detached": sum(1 for lease in self.leases.active() if lease.slot is None),
                "detached_bytes": self.leases.detacher.held_bytes(),
                "stuck": stuck}
