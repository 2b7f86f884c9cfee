"""Live GPU values (gpupoold/gpu/telemetry.py, docs/api.md "GPU view"): a real gpupoold on a simulated
GPU whose lease allocates memory, and the sampler itself against the fake pynvml (real-GPU mode)
and against stand-in workers (simulated mode)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import GpupoolServer
from fake_nvml import GIB, FakePynvml, gpus
from test_info import MIB, Tenant, wait_until

from gpupoold.config.settings import Settings
from gpupoold.gpu import telemetry as telemetry_module
from gpupoold.gpu.inventory import Gpu, Inventory, nvml_gpus
from gpupoold.gpu.nvml import Nvml
from gpupoold.gpu.telemetry import LIVE_FIELDS, Telemetry, unknown_live
from gpupoold.workers.supervisor import WorkerStats


def live(server: GpupoolServer, index: int = 0) -> dict[str, Any]:
    return server.get_json("/api/v1/gpus", token=server.token)["gpus"][index]["live"]


# ------------------------------------------------------------------------- a real daemon
# Tenant (tests/test_info.py) speaks the protocol on its own socket, hello then driver calls: in
# plain TCP, to a daemon with `--tls off` (plain_server). The live values are what is tested.
def test_a_lease_that_allocates_shows_its_memory(plain_server: GpupoolServer) -> None:
    server = plain_server
    before = live(server)
    assert list(before) == list(LIVE_FIELDS)
    assert before["memory_used"] == 0 and before["memory_free"] == before["memory_total"] == 80 * GIB
    assert before["gpu_util"] == 0 and before["memory_util"] == 0
    assert before["cuda_driver_version"] == 13000
    # The simulated sensors, idle (gpupoold/gpu/sim.py); energy adds up from the daemon's start.
    assert (before["temperature_c"], before["power_w"], before["power_limit_w"]) == (32, 70.0,
                                                                                    700.0)
    assert (before["sm_clock_mhz"], before["mem_clock_mhz"]) == (345, 2619)
    assert before["energy_j"] >= 0
    later = wait_until("energy accumulating", lambda: (v := live(server))["energy_j"] >
                       before["energy_j"] and v, timeout=10)
    assert later["energy_j"] - before["energy_j"] <= 70.0 * (later["at"] - before["at"]) + 1
    assert server.get_json("/api/v1/gpus/0", token=server.token)["live"]["memory_total"] == 80 * GIB

    tenant = Tenant(server, server.token)
    try:
        t0 = time.monotonic()
        tenant.alloc(256 * MIB)
        tenant.alloc(32 * MIB)
        now = wait_until("the allocations in the live values",
                         lambda: (v := live(server))["memory_used"] == 288 * MIB and v, timeout=10)
        assert time.monotonic() - t0 < 4, "live values took longer than ~3 s"
        assert now["memory_free"] == 80 * GIB - 288 * MIB
        assert now["at"] > before["at"]
        assert 0 <= now["gpu_util"] <= 100
    finally:
        tenant.close()
    wait_until("memory_used back to 0 after the lease", lambda: live(server)["memory_used"] == 0,
               timeout=10)


def test_a_free_shows_in_the_live_values(plain_server: GpupoolServer) -> None:
    server = plain_server  # plain TCP for Tenant, as above
    tenant = Tenant(server, server.token)
    try:
        keep = tenant.alloc(64 * MIB)
        gone = tenant.alloc(128 * MIB)
        wait_until("both allocations", lambda: live(server)["memory_used"] == 192 * MIB, timeout=10)
        tenant.free(gone)
        wait_until("the free", lambda: live(server)["memory_used"] == 64 * MIB, timeout=10)
        tenant.free(keep)
        wait_until("nothing held", lambda: live(server)["memory_used"] == 0, timeout=10)
    finally:
        tenant.close()


# ------------------------------------------------------------------------- real GPUs (fake NVML)
class MeteredNvml(FakePynvml):
    """The fake pynvml plus the functions only telemetry uses, recording which threads call."""

    def __init__(self, n: int) -> None:
        super().__init__(gpus(n))
        self.power_limit_mw = 700_000
        self.threads: set[str] = set()

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        self.threads.add(threading.current_thread().name)
        return super().nvmlDeviceGetUtilizationRates(h)

    def nvmlDeviceGetEnforcedPowerLimit(self, h: Any) -> int:
        self._check("nvmlDeviceGetEnforcedPowerLimit", h)
        return self.power_limit_mw

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return "580.65.06"

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._check("nvmlSystemGetCudaDriverVersion_v2")
        return 13000


def real_inventory(fake: FakePynvml) -> Inventory:
    nvml = Nvml(module=fake)
    return Inventory(nvml_gpus(Settings(), nvml.devices()), nvml=nvml)


async def test_real_gpus_are_read_from_nvml_in_a_thread() -> None:
    fake = MeteredNvml(2)
    g = fake.devices[1]
    g.util_gpu, g.util_memory, g.memory_used, g.temperature = 87, 41, 3 * GIB, 64
    g.power_mw, g.energy_mj, g.sm_clock, g.mem_clock = 312_500, 7_250_000, 1755, 2619
    tel = Telemetry(real_inventory(fake), None, Settings(telemetry_interval=0.05))
    await tel.start()
    try:
        assert (tel.driver_version, tel.cuda_driver_version) == ("580.65.06", 13000)
        got = tel.live(1)
        assert {k: v for k, v in got.items() if k != "at"} == {
            "memory_total": 80 * GIB, "memory_used": 3 * GIB, "memory_free": 77 * GIB,
            "gpu_util": 87, "memory_util": 41, "temperature_c": 64, "power_w": 312.5,
            "power_limit_w": 700.0, "energy_j": 7250.0, "sm_clock_mhz": 1755,
            "mem_clock_mhz": 2619, "cuda_driver_version": 13000, "ecc_uncorrected": 0,
            "xid_errors": 0, "remapped_rows_pending": False, "remapped_rows_failure": False}
        assert abs(got["at"] - time.time()) < 30
        assert tel.live(0)["memory_used"] == 0 and tel.live(0)["temperature_c"] == 35
        # Never on the event loop's thread.
        assert fake.threads and threading.current_thread().name not in fake.threads
        # It keeps sampling.
        g.memory_used, g.util_gpu = 5 * GIB, 12
        rounds = tel.samples
        while tel.samples < rounds + 2:
            await asyncio.sleep(0.02)
        assert (tel.live(1)["memory_used"], tel.live(1)["gpu_util"]) == (5 * GIB, 12)
        assert tel.live(1)["memory_free"] == 75 * GIB
    finally:
        await tel.close()
    rounds = tel.samples
    await asyncio.sleep(0.2)
    assert tel.samples == rounds, "the sampler still runs after close()"


async def test_health_meters_count_xids_without_taking_them_from_the_health_check() -> None:
    """ECC, remapped rows and an XID total come with every sample; the XIDs stay for the next
    health check (the scrub's), which must still see them."""
    fake = MeteredNvml(1)
    fake.devices[0].ecc_volatile_uncorrected = 3
    fake.devices[0].remapped = (0, 1, 1, 0)
    inventory = real_inventory(fake)
    assert inventory.nvml is not None
    tel = Telemetry(inventory, None, Settings())
    await tel.start()
    try:
        fake.inject_xid(0, 79)
        fake.inject_xid(0, 48)
        await tel.sample_once()
        got = tel.live(0)
        assert (got["ecc_uncorrected"], got["xid_errors"]) == (3, 2)
        assert (got["remapped_rows_pending"], got["remapped_rows_failure"]) == (True, False)
        report = await asyncio.to_thread(inventory.nvml.health, 0)
        assert report.xid_errors == (79, 48)  # not taken by the telemetry
        await tel.sample_once()
        assert tel.live(0)["xid_errors"] == 2  # a running total
    finally:
        await tel.close()


async def test_what_a_gpu_does_not_report_is_null() -> None:
    fake = MeteredNvml(1)
    fake.devices[0].unsupported = {"nvmlDeviceGetPowerUsage", "nvmlDeviceGetClockInfo",
                                   "nvmlDeviceGetTemperature", "nvmlDeviceGetEnforcedPowerLimit"}
    fake.missing = {"nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetDriverVersion"}
    tel = Telemetry(real_inventory(fake), None, Settings())
    await tel.start()
    try:
        got = tel.live(0)
        assert got["power_w"] is None and got["power_limit_w"] is None
        assert got["temperature_c"] is None
        assert got["sm_clock_mhz"] is None and got["mem_clock_mhz"] is None
        assert got["memory_total"] == 80 * GIB and got["energy_j"] == 1000.0
        assert (tel.driver_version, tel.cuda_driver_version) == ("", 0)
        assert got["cuda_driver_version"] == 0
    finally:
        await tel.close()


async def test_nvml_paused_for_a_reset_reads_nothing() -> None:
    fake = MeteredNvml(1)
    inventory = real_inventory(fake)
    assert inventory.nvml is not None
    tel = Telemetry(inventory, None, Settings())
    await tel.start()
    try:
        assert tel.live(0)["temperature_c"] == 35
        inventory.nvml.pause("a GPU reset is running")
        calls = len(fake.calls)
        await tel.sample_once()
        assert len(fake.calls) == calls, "NVML was used while paused"
        got = tel.live(0)
        assert got["temperature_c"] is None and got["memory_used"] is None
        assert got["memory_total"] == 80 * GIB  # from the inventory
        inventory.nvml.resume()
        await tel.sample_once()
        assert tel.live(0)["temperature_c"] == 35
    finally:
        await tel.close()


async def test_real_gpus_without_nvml_report_only_what_is_known() -> None:
    gpu = Gpu(index=0, name="GPU 0", uuid="", simulated=False, driver="libcuda.so.1", ordinal=0)
    tel = Telemetry(Inventory((gpu,), nvml_reason="no NVML"), None, Settings())
    await tel.start()
    try:
        got = tel.live(0)
        assert got["at"] is not None
        assert {k: v for k, v in got.items() if k != "at"} == {
            **dict.fromkeys(f for f in LIVE_FIELDS if f != "at"), "cuda_driver_version": 0}
    finally:
        await tel.close()


def test_unknown_live() -> None:
    gpu = Gpu(index=0, name="x (simulated)", uuid="", simulated=True, driver="", ordinal=0,
              memory_total=GIB)
    assert unknown_live(gpu, 13000) == {**dict.fromkeys(LIVE_FIELDS), "memory_total": GIB,
                                        "cuda_driver_version": 13000}


# ------------------------------------------------------------------------- simulated GPUs
@dataclass(eq=False)
class StandInWorker:
    stats: WorkerStats = field(default_factory=WorkerStats)


class Leases:
    """What Telemetry reads of the lease manager: slots[i].lease.worker.stats."""

    def __init__(self, n: int) -> None:
        self.slots = [SimpleNamespace(lease=None) for _ in range(n)]

    def hold(self, index: int, worker: StandInWorker | None) -> None:
        self.slots[index].lease = SimpleNamespace(worker=worker) if worker else None


def sim_inventory(n: int) -> Inventory:
    return Inventory(tuple(Gpu(index=i, name="H100 (gpupool simulated)", uuid=f"GPU-{i}",
                               simulated=True, driver="sim.so", ordinal=0, memory_total=80 * GIB,
                               pci_bus_id=f"00000000:{0x18 + i:02X}:00.0") for i in range(n)))


async def test_simulated_gpus_follow_their_lease_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry_module, "IDLE_AFTER", 0.3)
    leases = Leases(2)
    tel = Telemetry(sim_inventory(2), lambda: leases, Settings(telemetry_interval=0.01))
    await tel.sample_once()
    assert tel.live(0)["memory_used"] == 0 and tel.live(0)["gpu_util"] == 0
    assert tel.cuda_driver_version == 13000 and tel.driver_version == "580.00.00"

    w = StandInWorker(WorkerStats(duration_s=2.0, busy_ns=500_000_000, mem_used=3 * GIB))
    leases.hold(1, w)
    await tel.sample_once()
    got = tel.live(1)
    assert (got["memory_used"], got["memory_free"]) == (3 * GIB, 77 * GIB)
    assert got["gpu_util"] == 25  # 0.5 s busy in the first 2 s of the session
    assert got["memory_util"] == 0
    # The sensors follow the utilisation (gpupoold/gpu/sim.py): 25 % of the way from idle.
    assert (got["temperature_c"], got["power_w"], got["sm_clock_mhz"]) == (41, 215.0, 754)
    assert (got["power_limit_w"], got["mem_clock_mhz"]) == (700.0, 2619)
    assert tel.live(0)["temperature_c"] == 32 and tel.live(0)["power_w"] == 70.0  # idle
    assert tel.live(0)["memory_used"] == 0  # the other GPU has no lease

    # The next stats event: 0.9 s busy in 1 s.
    w.stats = WorkerStats(duration_s=3.0, busy_ns=1_400_000_000, mem_used=4 * GIB)
    await tel.sample_once()
    assert (tel.live(1)["gpu_util"], tel.live(1)["memory_used"]) == (90, 4 * GIB)
    # No new event for a while: the worker reports only changes, so nothing ran.
    await tel.sample_once()
    assert tel.live(1)["gpu_util"] == 90
    await asyncio.sleep(0.35)
    await tel.sample_once()
    assert (tel.live(1)["gpu_util"], tel.live(1)["memory_used"]) == (0, 4 * GIB)
    # A bogus reading never leaves 0..100.
    w.stats = WorkerStats(duration_s=3.1, busy_ns=9_000_000_000, mem_used=4 * GIB)
    await tel.sample_once()
    assert tel.live(1)["gpu_util"] == 100

    leases.hold(1, None)  # the lease ended
    await tel.sample_once()
    assert (tel.live(1)["memory_used"], tel.live(1)["gpu_util"]) == (0, 0)
    # A new lease starts from its own numbers, not the last one's.
    leases.hold(1, StandInWorker(WorkerStats(duration_s=1.0, busy_ns=0, mem_used=MIB)))
    await tel.sample_once()
    assert (tel.live(1)["memory_used"], tel.live(1)["gpu_util"]) == (MIB, 0)


async def test_the_background_sampler_runs_every_interval() -> None:
    leases = Leases(1)
    tel = Telemetry(sim_inventory(1), leases, Settings(telemetry_interval=0.05))  # type: ignore[arg-type]
    await tel.start()
    try:
        first = tel.live(0)["at"]
        leases.hold(0, StandInWorker(WorkerStats(duration_s=1.0, mem_used=7 * MIB)))
        deadline = time.monotonic() + 5
        while tel.live(0)["memory_used"] != 7 * MIB and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert tel.live(0)["memory_used"] == 7 * MIB
        assert tel.live(0)["at"] > first
    finally:
        await tel.close()


class BrokenNvml(MeteredNvml):
    """pynvml raising what it never should (not an NVMLError): a driver or binding bug."""

    broken = True

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        if self.broken:
            raise RuntimeError("a binding bug")
        return super().nvmlDeviceGetUtilizationRates(h)

    def nvmlSystemGetDriverVersion(self) -> str:
        raise RuntimeError("another binding bug")


async def test_a_failing_first_reading_does_not_stop_the_start(
        caplog: pytest.LogCaptureFixture) -> None:
    fake = BrokenNvml(1)
    tel = Telemetry(real_inventory(fake), None, Settings(telemetry_interval=0.05))
    with caplog.at_level("INFO", logger="gpupoold.telemetry"):
        await tel.start()  # must not raise: the daemon starts with unknown values
    try:
        assert tel._task is not None and not tel._task.done()
        assert (tel.driver_version, tel.cuda_driver_version) == ("", 0)
        got = tel.live(0)
        assert got["at"] is None and got["memory_used"] is None and got["temperature_c"] is None
        assert got["memory_total"] == 80 * GIB  # from the inventory
        messages = [r.getMessage() for r in caplog.records]
        assert any("driver versions failed" in m for m in messages), messages
        assert sum("live values failed" in m for m in messages) == 1, messages
        # The background sampler keeps trying, and reads once the GPU answers again.
        rounds = tel.samples
        await asyncio.sleep(0.2)
        assert tel.samples == rounds and tel.live(0)["at"] is None
        fake.broken = False
        deadline = time.monotonic() + 5
        while tel.live(0)["temperature_c"] is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert tel.live(0)["temperature_c"] == 35 and tel.samples > rounds
        assert sum("live values failed" in r.getMessage() for r in caplog.records) == 1
    finally:
        await tel.close()


async def test_a_failing_simulated_reading_does_not_stop_the_start() -> None:
    def broken_leases() -> Any:
        raise RuntimeError("a lease manager bug")

    tel = Telemetry(sim_inventory(1), broken_leases, Settings(telemetry_interval=0.05))
    await tel.start()
    try:
        assert tel.live(0)["at"] is None and tel.live(0)["memory_total"] == 80 * GIB
        assert tel.cuda_driver_version == 13000 and tel.live(0)["cuda_driver_version"] == 13000
    finally:
        await tel.close()
