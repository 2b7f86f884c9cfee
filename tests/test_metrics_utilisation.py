"""The utilisation counters of `GET /metrics` (issue 33, item 4; docs/metrics.md):
`gpupool_gpu_leased_seconds_total`, `gpupool_gpu_busy_seconds_total`,
`gpupool_gpu_reused_seconds_total`, `gpupool_token_busy_seconds_total` and the
`gpupool_gpu_lease_state` code, driven through the real adapter (http/metrics.py: its event
subscriptions, telemetry ticks and scrape) over a fake pool and telemetry on a fake clock.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gpupoold.http.metrics import Collector, DaemonMetrics
from gpupoold.http.utilisation import Observation, UtilisationClock
from gpupoold.pool.counters import Counters
from gpupoold.pool.events import EventBus, LeaseDetached, LeaseEnded, LeaseGranted
from gpupoold.workers.supervisor import WorkerStats

PERIOD = 1.0  # the telemetry interval the fake ticks follow


class FakePool:
    """What the metrics' collector reads of the lease manager (pool/leases.py)."""

    def __init__(self, gpus: int) -> None:
        self.slots = [SimpleNamespace(
            gpu=SimpleNamespace(index=i, uuid=f"GPU-{i}", name="sim", pci_bus_id=None,
                                simulated=True),
            state="free", lease=None, draining=False, stuck=None) for i in range(gpus)]
        self.leases: dict[int, Any] = {}
        self.queue: list[Any] = []
        self.detacher = SimpleNamespace(held_bytes=lambda: 0)
        self.store = SimpleNamespace(server="test")

    def active(self) -> list[Any]:
        return list(self.leases.values())

    def grant(self, lease_id: int, gpu: int, token: str) -> None:
        lease = self.leases.get(lease_id) or SimpleNamespace(
            id=lease_id, token=token, slot=None, home=None, started=0.0,
            worker=SimpleNamespace(stats=WorkerStats()))
        self.leases[lease_id] = lease
        slot = self.slots[gpu]
        slot.lease, slot.state, lease.slot = lease, "leased", slot

    def release(self, lease_id: int, detach: bool = False) -> None:
        lease = self.leases[lease_id]
        slot = lease.slot
        slot.lease, slot.state, lease.slot = None, "free", None
        if detach:
            lease.home = slot.gpu
        else:
            del self.leases[lease_id]


class FakeTelemetry:
    def __init__(self) -> None:
        self.util: dict[int, int] = {}  # percent, as gpu/telemetry.py caches it

    def live(self, index: int) -> dict[str, Any]:
        return {"gpu_util": self.util.get(index, 0)}


class Harness:
    """The adapter wired to the fakes, with a clock the test moves."""

    def __init__(self, gpus: int = 2) -> None:
        self.now = 100.0
        self.pool = FakePool(gpus)
        self.telemetry = FakeTelemetry()
        self.bus = EventBus()
        self.metrics = DaemonMetrics()
        self.metrics.now = lambda: self.now
        self.metrics.subscribe(self.bus)
        self.metrics.collector = Collector(self.metrics, self.pool,  # type: ignore[arg-type]
                                           self.telemetry, Counters())  # type: ignore[arg-type]
        self.metrics.registry.register(self.metrics.collector)
        self.metrics.collector.observe_gpus()  # what attach() does

    def run_until(self, t: float) -> None:
        """Telemetry ticks every PERIOD up to t (each observes the GPUs, as the daemon's)."""
        while self.now + PERIOD <= t + 1e-9:
            self.now += PERIOD
            assert self.metrics.collector is not None
            self.metrics.collector.observe_gpus()
        self.now = t

    def grant(self, lease_id: int, gpu: int, token: str) -> None:
        self.pool.grant(lease_id, gpu, token)
        self.bus.publish(LeaseGranted(lease_id, gpu, token, 0.0))

    def end(self, lease_id: int, gpu: int, token: str) -> None:
        self.pool.release(lease_id)
        self.bus.publish(LeaseEnded(lease_id, gpu, token, "client exit", 1.0, WorkerStats()))

    def detach(self, lease_id: int, gpu: int) -> None:
        self.pool.release(lease_id, detach=True)
        self.bus.publish(LeaseDetached(lease_id, gpu, 0, 0.0))

    def sample(self, name: str, **labels: str) -> float | None:
        """One sample of a scrape taken now (a scrape is an observation too)."""
        return self.metrics.registry.get_sample_value(name, labels)


def test_leased_busy_and_reused_seconds_of_known_spans() -> None:
    """GPU 0: alice from 2 s to 10 s, busy at 100 % until 6 s then idle. GPU 1: bob from 3 s,
    idle, detached at 5 s (in progress in host memory); carol on GPU 1 from 6 s at 50 %, still on
    it at the scrape (12 s). The lease events mark the spans' ends and the utilisation changes at
telemetry ticks, so the counters are exact here (the acceptance allows one sampling period)."""
    h = Harness()
    t0 = h.now
    h.run_until(t0 + 2)
    h.telemetry.util[0] = 100
    h.grant(1, 0, "alice")
    h.run_until(t0 + 3)
    h.grant(2, 1, "bob")
    h.run_until(t0 + 5)
    h.detach(2, 1)
    h.run_until(t0 + 6)
    h.grant(3, 1, "carol")
    # A utilisation sample describes the period before it: GPU 0 idle from 6 s, GPU 1 at 50 %.
    h.telemetry.util[0] = 0
    h.telemetry.util[1] = 50
    h.run_until(t0 + 10)
    h.end(1, 0, "alice")
    h.run_until(t0 + 12)

    def near(name: str, want: float, **labels: str) -> None:
        got = h.sample(name, **labels)
        assert got is not None and abs(got - want) <= 1e-6, (name, labels, got, want)

    near("gpupool_gpu_leased_seconds_total", 8, gpu="0")
    near("gpupool_gpu_busy_seconds_total", 4, gpu="0")
    near("gpupool_gpu_reused_seconds_total", 0, gpu="0")
    near("gpupool_gpu_leased_seconds_total", 2 + 6, gpu="1")  # bob 3-5 s, carol 6-12 s
    near("gpupool_gpu_busy_seconds_total", 0.5 * 6, gpu="1")
    near("gpupool_gpu_reused_seconds_total", 6, gpu="1")  # carol while bob waits detached
    near("gpupool_token_busy_seconds_total", 4, token="alice")
    near("gpupool_token_busy_seconds_total", 0, token="bob")
    near("gpupool_token_busy_seconds_total", 3, token="carol")
    # GPU 0 free again, GPU 1 serving carol while bob's detached lease waits.
    assert h.sample("gpupool_gpu_lease_state", gpu="0") == 0
    assert h.sample("gpupool_gpu_lease_state", gpu="1") == 3


def test_counters_grow_between_scrapes_while_a_lease_is_open_and_never_go_back() -> None:
    """No telemetry tick between the scrapes: the open lease's time still counts up to each
    scrape, and each scrape reads at least what the one before did."""
    h = Harness(gpus=1)
    h.telemetry.util[0] = 100
    h.grant(1, 0, "alice")
    seen: list[tuple[float, float]] = []
    for step in (0.5, 3.0, 0.25, 7.0):
        h.now += step
        leased = h.sample("gpupool_gpu_leased_seconds_total", gpu="0")
        busy = h.sample("gpupool_gpu_busy_seconds_total", gpu="0")
        assert leased is not None and busy is not None
        seen.append((leased, busy))
    assert seen == sorted(seen), seen
    assert seen[-1][0] == pytest.approx(10.75)
    assert seen[-1][1] == pytest.approx(10.75)
    assert h.sample("gpupool_gpu_lease_state", gpu="0") == 2  # leased and busy
    h.telemetry.util[0] = 0
    h.now += 1
    h.sample("gpupool_gpu_leased_seconds_total", gpu="0")  # a scrape observes the idle GPU
    assert h.sample("gpupool_gpu_lease_state", gpu="0") == 1


def test_a_gpu_out_of_service_counts_no_lease_time() -> None:
    h = Harness(gpus=1)
    h.pool.slots[0].state = "quarantined"
    h.run_until(h.now + 5)
    assert h.sample("gpupool_gpu_leased_seconds_total", gpu="0") == 0
    assert h.sample("gpupool_gpu_lease_state", gpu="0") == 4


def test_the_clock_holds_each_observation_until_the_next() -> None:
    """UtilisationClock alone: a span counts as leased as the observation at its start said,
    busy by the utilisation read at its end; an earlier reading than the last counts nothing
    (and does not move the clock back)."""
    clock = UtilisationClock()
    clock.observe(0.0, {0: Observation(token=None)})
    clock.observe(1.0, {0: Observation(token="a", util=0.25)})
    clock.observe(5.0, {0: Observation(token="a", util=2.0, reused=True)})  # 1-5 s, capped at 1
    clock.observe(7.0, {0: Observation(token="a")})  # 5-7 s: reused, idle
    clock.observe(6.5, {0: Observation(token=None)})  # earlier than the last: counts nothing
    clock.observe(8.0, {0: Observation(token=None)})
    t = clock.gpus[0]
    assert (t.leased_s, t.busy_s, t.reused_s) == (6.0, 4.0, 2.0)
    assert clock.token_busy_s == {"a": 4.0}
    assert clock.code(0) == 0 and clock.code(1) is None
