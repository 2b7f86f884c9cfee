"""The utilisation counters of `GET /metrics` (issue 33, item 4; docs/metrics.md):
`gpupool_gpu_leased_seconds_total`, `gpupool_gpu_busy_seconds_total`,
`gpupool_gpu_reused_seconds_total`, `gpupool_token_busy_seconds_total` and the
`gpupool_gpu_lease_state` code, driven through the real adapter (http/metrics.py's scrape) and
the real GPU time accounting that integrates them (pool/usage_recorder.py feeding
pool/usage.py's `UsageMeter`, the one integrator) over a fake pool and telemetry on a fake clock;
and that the counters and the stored minute rows behind `gpupoold report` agree.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpupoold.http import utilisation
from gpupoold.http.metrics import Collector, DaemonMetrics
from gpupoold.pool.counters import Counters
from gpupoold.pool.events import EventBus, LeaseEnded, LeaseGranted
from gpupoold.pool.usage_recorder import UsageRecorder
from gpupoold.store.database import Store
from gpupoold.workers.supervisor import WorkerStats

PERIOD = 1.0  # the telemetry interval the fake ticks follow
T0 = 1_800_000_030.0  # half a minute past a minute boundary: spans cross minutes


class FakePool:
    """What the metrics' collector and the usage recorder read of the lease manager
    (pool/leases.py)."""

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

    def grant(self, lease_id: int, gpu: int, token: str, now: float) -> None:
        lease = self.leases.get(lease_id) or SimpleNamespace(
            id=lease_id, token=token, slot=None, home=None, started=now,
            worker=SimpleNamespace(stats=WorkerStats()))
        self.leases[lease_id] = lease
        slot = self.slots[gpu]
        slot.lease, slot.state, lease.slot = lease, "leased", slot

    def release(self, lease_id: int, detach: bool = False) -> Any:
        lease = self.leases[lease_id]
        slot = lease.slot
        slot.lease, slot.state, lease.slot = None, "free", None
        if detach:
            lease.home = slot.gpu
        else:
            del self.leases[lease_id]
        return lease


class FakeTelemetry:
    def __init__(self) -> None:
        self.util: dict[int, int] = {}  # percent, as gpu/telemetry.py caches it

    def live(self, index: int) -> dict[str, Any]:
        return {"gpu_util": self.util.get(index, 0)}


class NoStore:
    """A store that takes the recorder's writes (at each lease's end) and keeps nothing."""

    async def record_usage(self, delta: Any, prune_before: float | None = None) -> None:
        pass


class Harness:
    """The adapter and the usage recorder wired to the fakes as app.py wires them, with a clock
    the test moves. `counted`: GPUs whose lease worker's busy_ns is the busy time. Made in a
    running event loop: the recorder writes at each lease's end in a task of its own."""

    def __init__(self, gpus: int = 2, store: Store | None = None,
                 counted: tuple[int, ...] = ()) -> None:
        self.now = T0
        self.pool = FakePool(gpus)
        self.telemetry = FakeTelemetry()
        self.bus = EventBus()
        self.recorder = UsageRecorder(store or NoStore(), self.pool,  # type: ignore[arg-type]
                                      self.telemetry,
                                      PERIOD, 90, clock=lambda: self.now, flush_s=1e9,
                                      counted=counted)
        self.bus.subscribe(LeaseEnded, self.recorder.lease_ended)
        self.metrics = DaemonMetrics()
        self.metrics.subscribe(self.bus)
        self.metrics.collector = Collector(self.metrics, self.pool,  # type: ignore[arg-type]
                                           self.telemetry, Counters(),  # type: ignore[arg-type]
                                           self.recorder.meter)
        self.metrics.registry.register(self.metrics.collector)
        self.recorder.observe_all()  # what start() does

    def run_until(self, t: float) -> None:
        """Sampling rounds every PERIOD up to t (the daemon's telemetry interval)."""
        while self.now + PERIOD <= t + 1e-9:
            self.now += PERIOD
            self.recorder.observe_all()
        self.now = t

    def grant(self, lease_id: int, gpu: int, token: str) -> None:
        self.pool.grant(lease_id, gpu, token, self.now)
        self.bus.publish(LeaseGranted(lease_id, gpu, token, 0.0))

    def end(self, lease_id: int, gpu: int, token: str) -> None:
        lease = self.pool.release(lease_id)
        self.bus.publish(LeaseEnded(lease_id, gpu, token, "client exit", 1.0, lease.worker.stats))

    def detach(self, lease_id: int) -> None:
        self.pool.release(lease_id, detach=True)

    def sample(self, name: str, **labels: str) -> float | None:
        """One sample of a scrape taken now."""
        return self.metrics.registry.get_sample_value(name, labels)


async def test_leased_busy_and_reused_seconds_of_known_spans() -> None:
    """GPU 0: alice from 2 s to 10 s, busy at 100 % until 6 s then idle. GPU 1: bob from 3 s,
    idle, detached at 5 s (in progress in host memory); carol on GPU 1 from 6 s at 50 %, still on
    it at the scrape (12 s). A lease counts from its start and until its end (LeaseEnded) and
    the utilisation changes at sampling rounds, so the counters are exact here (the acceptance
    allows one sampling period)."""
    h = Harness()
    h.run_until(T0 + 2)
    h.telemetry.util[0] = 100
    h.grant(1, 0, "alice")
    h.run_until(T0 + 3)
    h.grant(2, 1, "bob")
    h.run_until(T0 + 5)
    h.detach(2)
    h.run_until(T0 + 6)
    h.grant(3, 1, "carol")
    # A utilisation sample describes the period before it: GPU 0 idle from 6 s, GPU 1 at 50 %.
    h.telemetry.util[0] = 0
    h.telemetry.util[1] = 50
    h.run_until(T0 + 10)
    h.end(1, 0, "alice")
    h.run_until(T0 + 12)

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
    assert h.sample("gpupool_gpu_lease_state", gpu="0") == utilisation.FREE
    assert h.sample("gpupool_gpu_lease_state", gpu="1") == utilisation.REUSED


async def test_counters_advance_with_the_sampling_rounds_and_never_go_back() -> None:
    """Between two sampling rounds a scrape reads what the last round counted (an open lease's
    time up to it); each scrape reads at least what the one before did. The state code is the
    GPU's state at the scrape."""
    h = Harness(gpus=1)
    h.telemetry.util[0] = 100
    h.grant(1, 0, "alice")
    seen: list[tuple[float, float]] = []
    for step in (0.5, 3.0, 0.25, 7.0):
        h.run_until(h.now + step)
        leased = h.sample("gpupool_gpu_leased_seconds_total", gpu="0")
        busy = h.sample("gpupool_gpu_busy_seconds_total", gpu="0")
        assert leased is not None and busy is not None
        seen.append((leased, busy))
    assert seen == sorted(seen), seen
    assert seen[0] == (0, 0)  # no round yet: nothing counted
    assert seen[-1][0] == pytest.approx(10.75) and seen[-1][1] == pytest.approx(10.75)
    assert h.sample("gpupool_gpu_lease_state", gpu="0") == utilisation.LEASED_BUSY
    h.telemetry.util[0] = 0
    assert h.sample("gpupool_gpu_lease_state", gpu="0") == utilisation.LEASED_IDLE


async def test_a_gpu_out_of_service_counts_no_lease_time() -> None:
    h = Harness(gpus=1)
    h.pool.slots[0].state = "quarantined"
    h.run_until(h.now + 5)
    assert h.sample("gpupool_gpu_leased_seconds_total", gpu="0") == 0
    assert h.sample("gpupool_gpu_lease_state", gpu="0") == utilisation.OUT_OF_SERVICE


def test_the_lease_state_codes() -> None:
    code = utilisation.lease_state
    assert code(False, 0.7, False, True) == utilisation.FREE
    assert code(False, 0.0, False, False) == utilisation.OUT_OF_SERVICE
    assert code(True, 0.0, False, True) == utilisation.LEASED_IDLE
    assert code(True, 0.01, False, True) == utilisation.LEASED_BUSY
    assert code(True, 0.9, True, True) == utilisation.REUSED  # over idle and busy


async def test_the_counters_and_the_stored_minute_rows_agree(tmp_path: Path) -> None:
    """One integrator: after a made-up day's worth of events (grants, ends, a detach and the
    reuse of its GPU, utilisation changes, a GPU whose busy time is its worker's busy_ns counter,
    spans across minute boundaries and two flushes), each GPU's and each token's counters equal
    the sums of the minute rows written to the store."""
    store = await Store.open(tmp_path / "gpupoold.db", server="s")
    try:
        h = Harness(gpus=3, store=store, counted=(2,))
        h.telemetry.util = {0: 30, 1: 80, 2: 100}
        h.grant(1, 0, "alice")
        h.run_until(T0 + 7.5)
        h.grant(2, 1, "bob")
        h.grant(3, 2, "carol")
        h.run_until(T0 + 41.2)
        h.pool.leases[3].worker.stats = WorkerStats(busy_ns=9 * 10**9)
        h.telemetry.util[0] = 0
        h.run_until(T0 + 50)
        await h.recorder.flush()  # the first flush; the counters go on from where they were
        h.detach(1)
        h.run_until(T0 + 55)
        h.grant(4, 0, "bob")  # bob again, on the GPU alice's detached lease left
        h.telemetry.util[0] = 60
        h.run_until(T0 + 93.6)
        h.pool.leases[3].worker.stats = WorkerStats(busy_ns=31 * 10**9)
        h.end(3, 2, "carol")
        h.end(2, 1, "bob")
        h.run_until(T0 + 130)
        await h.recorder.close()  # the writes at the two ends, and a last one
        rows = await store.usage_minutes(T0 - 60, T0 + 600)
        assert {r["gpu"] for r in rows} == {0, 1, 2}

        def total(key: str, **match: Any) -> float:
            return sum(r[key] for r in rows
                       if all(r[k] == v for k, v in match.items()))

        for gpu in ("0", "1", "2"):
            for kind in ("leased", "busy", "reused"):
                counter = h.sample(f"gpupool_gpu_{kind}_seconds_total", gpu=gpu)
                assert counter == pytest.approx(total(f"{kind}_s", gpu=int(gpu)), abs=1e-6), \
                    (gpu, kind)
        for token in ("alice", "bob", "carol"):
            assert h.sample("gpupool_token_busy_seconds_total", token=token) == \
                pytest.approx(total("busy_s", token=token), abs=1e-6), token
        # The series was not trivial: each figure the comparison covers is there.
        assert total("reused_s", gpu=0) == pytest.approx(130 - 55)  # to close()'s last round
        assert total("busy_s", gpu=2) == pytest.approx(31)  # the worker's counter, not 100 %
        assert total("leased_s", gpu=1) == pytest.approx(93.6 - 7.5)
    finally:
        await store.close()
