"""The lease manager's event bus (gpupoold/pool/events.py) and the metrics that follow it."""

from __future__ import annotations

import logging

import pytest

from gpupoold.http.metrics import DaemonMetrics
from gpupoold.pool.events import EventBus, GpuChanged, GpuCleaned, LeaseEnded, LeaseGranted
from gpupoold.workers.supervisor import WorkerStats


def test_subscribers_get_their_type_in_order_and_can_leave() -> None:
    bus = EventBus()
    seen: list[tuple[str, object]] = []
    stop_a = bus.subscribe(GpuChanged, lambda e: seen.append(("a", e)))
    bus.subscribe(GpuChanged, lambda e: seen.append(("b", e)))
    bus.subscribe(LeaseGranted, lambda e: seen.append(("granted", e)))
    bus.publish(GpuChanged(3))
    assert seen == [("a", GpuChanged(3)), ("b", GpuChanged(3))]
    stop_a()
    stop_a()  # twice is harmless
    seen.clear()
    bus.publish(GpuChanged(1))
    assert seen == [("b", GpuChanged(1))]
    assert bus.subscribers(GpuChanged) == 1 and bus.subscribers(LeaseEnded) == 0


def test_a_failing_subscriber_is_logged_and_the_others_still_run(
        caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    seen: list[int] = []

    def broken(_e: GpuChanged) -> None:
        raise RuntimeError("subscriber bug")

    bus.subscribe(GpuChanged, broken)
    bus.subscribe(GpuChanged, lambda e: seen.append(e.index))
    with caplog.at_level(logging.ERROR, logger="gpupoold.events"):
        bus.publish(GpuChanged(0))  # the publisher (the lease manager) never sees the error
    assert seen == [0]
    assert "a subscriber to GpuChanged failed" in caplog.text and "subscriber bug" in caplog.text


def test_the_metrics_observe_what_the_lease_manager_publishes() -> None:
    bus = EventBus()
    metrics = DaemonMetrics()
    unsubscribe = metrics.subscribe(bus)

    def sample(name: str, **labels: str) -> float:
        value = metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    stats = WorkerStats(bytes_h2d=100, bytes_d2h=7)
    bus.publish(LeaseGranted(1, 0, "alice", 2.5))
    bus.publish(LeaseEnded(1, 0, "alice", "client exit", 60.0, stats))
    bus.publish(GpuCleaned(0, True, 0.25, {"ok": True, "duration_s": 1.5}))
    bus.publish(GpuCleaned(0, False, -1.0, None))  # a negative duration counts as 0
    assert sample("gpupool_queue_wait_seconds_count") == 1
    assert sample("gpupool_queue_wait_seconds_sum") == 2.5
    assert sample("gpupool_lease_duration_seconds_sum") == 60.0
    assert sample("gpupool_scrub_duration_seconds_count") == 2
    assert sample("gpupool_scrub_duration_seconds_sum") == 0.25
    assert sample("gpupool_reset_duration_seconds_sum") == 1.5
    assert metrics.ended.bytes_h2d == 100 and metrics.ended.bytes_d2h == 7
    assert metrics.ended.gpu_seconds == {"alice": 60.0}
    for stop in unsubscribe:
        stop()
    bus.publish(LeaseGranted(2, 0, "bob", 1.0))
    assert sample("gpupool_queue_wait_seconds_count") == 1
