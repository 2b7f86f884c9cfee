"""What the lease logic tells the rest of the daemon, without knowing who listens.

The pool's transitions (pool/state.py) publish these events on an `EventBus`; adapters subscribe:
the Prometheus registry (http/metrics.py) observes grants, ends and scrubs, the web dashboard
(dashboard/live.py) pushes a GPU's new state to open pages. The domain code therefore imports none
of them (no import of aiohttp or prometheus_client, no import cycle through the HTTP layer).

Delivery is synchronous, in the publisher's event-loop step: a lease's end is counted by the
metrics in the same step that removes it from the active leases, so a scrape never counts it
twice or not at all. A subscriber that raises is logged and skipped; the publisher never sees it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from gpupoold.workers.supervisor import WorkerStats

log = logging.getLogger("gpupoold.events")


@dataclass(frozen=True)
class GpuChanged:
    """A GPU's state, lease, quarantine or stuck mark changed."""
    index: int


@dataclass(frozen=True)
class LeaseGranted:
    """A waiting client got its GPU after `queued_s` seconds in the queue."""
    lease_id: int
    gpu: int
    token: str
    queued_s: float


@dataclass(frozen=True)
class LeaseEnded:
    """A lease ended; `stats` is its worker's final account. `gpus`: every GPU it was on, a
    lease of several GPUs (issue 37; `gpu` is its device 0); () for a lease of one GPU."""
    lease_id: int
    gpu: int
    token: str
    reason: str
    duration_s: float
    stats: WorkerStats
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class LeaseDetached:
    """An idle lease gave its GPU back (pool/detach.py): `saved_bytes` of device memory now wait
    in host memory; the detach (lock and checkpoint) took `seconds`."""

    lease_id: int
    gpu: int
    saved_bytes: int
    seconds: float


@dataclass(frozen=True)
class LeaseAttached:
    """A detached lease is on a GPU again, `latency_s` after its client's call asked for one
    (queueing included); `moved`: another GPU than the one it left."""

    lease_id: int
    gpu: int
    moved: bool
    latency_s: float
    saved_bytes: int


@dataclass(frozen=True)
class GpuCleaned:
    """A GPU was scrubbed (and reset when `reset` is not None), successfully or not."""
    gpu: int
    ok: bool
    duration_s: float
    reset: dict[str, Any] | None


E = TypeVar("E")


class EventBus:
    """Subscribers by event type; `publish` calls those of the event's exact type in order."""

    def __init__(self) -> None:
        self._subscribers: dict[type, list[Callable[[Any], None]]] = {}

    def subscribe(self, kind: type[E], fn: Callable[[E], None]) -> Callable[[], None]:
        """Call `fn(event)` for each published event of type `kind`; returns the unsubscribe."""
        self._subscribers.setdefault(kind, []).append(fn)

        def unsubscribe() -> None:
            subs = self._subscribers.get(kind, [])
            if fn in subs:
                subs.remove(fn)
        return unsubscribe

    def publish(self, event: object) -> None:
        for fn in list(self._subscribers.get(type(event), ())):
            try:
                fn(event)
            except Exception:
                log.exception("a subscriber to %s failed", type(event).__name__)

    def subscribers(self, kind: type) -> int:
        return len(self._subscribers.get(kind, ()))
