"""GPU time accounting at its edges (issue 33; found by bench/pool_day.py's replayed day, whose
report disagreed with the benchmark's own figures): a lease's stretch on a GPU closes at its
idle detach and opens at its return, not at the sampling rounds around them; a report whose
period starts inside a minute counts that minute's row."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gpupoold.http import api
from gpupoold.http.keys import INVENTORY, STORE
from gpupoold.pool.events import EventBus, LeaseAttached, LeaseDetached, LeaseEnded
from gpupoold.pool.report import first_row
from gpupoold.pool.usage import Observation, UsageMeter
from gpupoold.pool.usage_recorder import UsageRecorder
from gpupoold.store.database import NewLease, Store
from gpupoold.workers.supervisor import WorkerStats

T0 = 1_800_000_000.0  # a minute boundary (divisible by 60)


def test_a_report_counts_rows_from_the_minute_its_period_starts_in() -> None:
    assert first_row(T0) == T0
    assert first_row(T0 + 59.9) == T0
    assert first_row(T0 - 0.1) == T0 - 60


@dataclass
class FakeGpu:
    index: int


async def test_a_report_from_inside_a_minute_counts_that_minutes_row(tmp_path: Path) -> None:
    """GET /api/v1/report?from= a time inside the minute of a lease's usage: the minute's row
    is counted (it was left out whole, and a replay's report read 0 GPU-hours); the row of the
    minute the period ends before is not."""
    store = await Store.open(tmp_path / "gpupoold.db", server="s")
    try:
        meter = UsageMeter()
        meter.observe(T0 + 10, 0, Observation(1, "alice", 100))
        meter.observe(T0 + 40, 0, Observation(1, "alice", 50))
        meter.observe(T0 + 60, 0, Observation(1, "alice", 50))
        meter.observe(T0 + 70, 0, Observation(1, "alice", 50))  # the next minute: 10 s
        await store.record_usage(meter.take())
        app = web.Application()
        app[STORE] = store
        app[INVENTORY] = type("Inv", (), {"gpus": [FakeGpu(0), FakeGpu(1)]})()  # type: ignore[assignment]
        app.router.add_get("/api/v1/report", api.report)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get(f"/api/v1/report?from={T0 + 30:.0f}&to={T0 + 45:.0f}")
            assert resp.status == 200, await resp.text()
            report = (await resp.json())["report"]
        assert (report["from"], report["to"]) == (T0 + 30, T0 + 45)  # the period as asked
        assert report["leased_gpu_hours"] * 3600 == pytest.approx(50)  # T0 + 10 .. T0 + 60
        assert report["busy_gpu_hours"] * 3600 == pytest.approx(25)
    finally:
        await store.close()


# ------------------------------------------------------------- the recorder and idle detach
@dataclass
class FakeWorker:
    stats: WorkerStats = field(default_factory=WorkerStats)


@dataclass
class FakeLease:
    id: int
    token: str
    started: float
    worker: FakeWorker
    home: FakeGpu | None = None  # the GPU it detached from
    slot: object | None = None


@dataclass
class FakeSlot:
    lease: FakeLease | None = None


@dataclass
class FakeLeases:
    slots: list[FakeSlot]
    detached: list[FakeLease] = field(default_factory=list)

    def active(self) -> list[FakeLease]:
        return [s.lease for s in self.slots if s.lease is not None] + self.detached


class FakeTelemetry:
    def live(self, index: int) -> dict[str, Any]:
        return {"gpu_util": 0}


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


async def test_a_detached_lease_counts_to_the_instant_it_left_and_from_its_return(
        tmp_path: Path) -> None:
    """The pool's LeaseDetached and LeaseAttached close and open a lease's stretch on a GPU at
    their instants, not at the sampling rounds around them (each detach and return lost up to
    a round: 10 % of the leased time of a replayed day with many detaches); the busy counter's
    late report of work done before the detach is still credited after the return."""
    store = await Store.open(tmp_path / "gpupoold.db", server="s")
    lease_id = await store.lease_started(NewLease(
        gpu_index=0, gpu_uuid="", gpu_name="sim", simulated=True, token_name="alice",
        client_host="h", client_user="u", client_pid=1, program="p", peer="",
        request="any GPU", queued_s=0.0, started=T0))
    worker = FakeWorker()
    lease = FakeLease(lease_id, "alice", started=T0, worker=worker)
    leases = FakeLeases([FakeSlot(lease), FakeSlot()])
    lease.slot = leases.slots[0]
    clock, events = Clock(), EventBus()
    rec = UsageRecorder(store, leases, FakeTelemetry(), 1.0, 90, clock=clock,
                        flush_s=1e9, counted=[0, 1])
    unsubscribe = rec.subscribe(events)

    def at(seconds: float, busy_s: float) -> None:
        clock.now = T0 + seconds
        worker.stats.busy_ns = int(busy_s * 1e9)
        rec.observe_all()

    for second, busy in ((0, 0.0), (1, 1.0), (2, 2.0), (3, 2.0), (4, 2.0)):
        at(second, busy)
    clock.now = T0 + 4.6  # detached; 0.3 s of its work is not reported yet (2.3 s in all)
    leases.slots[0].lease, lease.home, lease.slot = None, FakeGpu(0), None
    leases.detached = [lease]
    events.publish(LeaseDetached(lease_id, 0, 0, 0.1))
    at(5, 2.0)
    at(6, 2.0)
    clock.now = T0 + 6.3  # back, on GPU 1; the late report arrives
    worker.stats.busy_ns = int(2.3e9)
    leases.detached, leases.slots[1].lease, lease.slot = [], lease, leases.slots[1]
    events.publish(LeaseAttached(lease_id, 1, True, 0.05, 0))
    at(7, 2.8)
    clock.now = T0 + 7.5
    leases.slots[1].lease = None
    events.publish(LeaseEnded(lease_id, 1, "alice", "client closed", 7.5,
                              WorkerStats(busy_ns=3_300_000_000)))
    unsubscribe()
    events.publish(LeaseAttached(lease_id, 0, False, 0.05, 0))  # unsubscribed: not heard
    at(8, 3.3)
    await rec.close()  # the last round and flush (after the one the lease's end asked for)
    record = await store.get_lease(lease_id)
    rows = await store.usage_minutes(T0, T0 + 60)
    await store.close()
    assert record is not None
    assert record.leased_s == pytest.approx(4.6 + 1.2)  # 0..4.6 s and 6.3..7.5 s
    assert record.busy_s == pytest.approx(3.3)  # the counter's whole, none lost
    assert {r["gpu"]: r["leased_s"] for r in rows} == {0: pytest.approx(4.6),
                                                      1: pytest.approx(1.2)}
