"""gpupoold/gpu/nvml.py against the fake pynvml (tests/fake_nvml.py); no NVIDIA driver needed."""

from __future__ import annotations

import ctypes.util
import logging
import threading

import pynvml
import pytest
from fake_nvml import GIB, MIB, FakeGpu, FakePynvml, gpus

from gpupoold.gpu.nvml import GpuProcess, HealthReport, Nvml, NvmlUnavailable


def make(n: int = 2) -> tuple[Nvml, FakePynvml]:
    fake = FakePynvml(gpus(n))
    return Nvml(module=fake), fake


def test_init_is_lazy_and_happens_once() -> None:
    nvml, fake = make()
    assert fake.inits == 0
    assert nvml.available() is None
    nvml.devices()
    nvml.sample(0)
    nvml.health(1)
    assert fake.inits == 1
    nvml.shutdown()
    assert fake.shutdowns == 1 and not fake.initialized
    nvml.sample(0)  # initialises again on demand
    assert fake.inits == 2


def test_devices() -> None:
    fake = FakePynvml([FakeGpu(name="NVIDIA A100-SXM4-40GB", uuid="GPU-aaaaaaaa-1111-2222-3333-444444444444",
                               pci_bus_id="00000000:07:00.0", memory_total=40 * GIB, minor=3),
                       FakeGpu(name="NVIDIA H100 80GB HBM3", uuid="GPU-bbbbbbbb-1111-2222-3333-444444444444",
                               pci_bus_id="00000000:0F:00.0", memory_total=80 * GIB, minor=5)])
    devices = Nvml(module=fake).devices()
    assert [(d.index, d.name, d.uuid, d.pci_bus_id, d.memory_total, d.minor_number)
            for d in devices] == [
        (0, "NVIDIA A100-SXM4-40GB", "GPU-aaaaaaaa-1111-2222-3333-444444444444", "00000000:07:00.0",
         40 * GIB, 3),
        (1, "NVIDIA H100 80GB HBM3", "GPU-bbbbbbbb-1111-2222-3333-444444444444", "00000000:0F:00.0",
         80 * GIB, 5)]
    assert fake.registered == {0: pynvml.nvmlEventTypeXidCriticalError,
                               1: pynvml.nvmlEventTypeXidCriticalError}


def test_sample_converts_units() -> None:
    nvml, fake = make()
    g = fake.devices[1]
    g.util_gpu, g.util_memory, g.memory_used, g.temperature = 87, 41, 3 * GIB, 64
    g.power_mw, g.energy_mj, g.sm_clock, g.mem_clock = 312_500, 7_250_000, 1755, 2619
    s = nvml.sample(1)
    assert s.to_json() == {"gpu_util": 87, "memory_util": 41, "memory_used": 3 * GIB,
                           "memory_total": 80 * GIB, "temperature_c": 64, "power_w": 312.5,
                           "energy_j": 7250.0, "sm_clock_mhz": 1755, "mem_clock_mhz": 2619}


def test_unsupported_fields_are_none_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    nvml, fake = make(1)
    fake.devices[0].unsupported = {"nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption",
                                   "nvmlDeviceGetClockInfo"}
    fake.missing = {"nvmlDeviceGetUtilizationRates"}  # an older binding without it
    with caplog.at_level(logging.INFO, logger="gpupoold.nvml"):
        for _ in range(3):
            s = nvml.sample(0)
    assert s.power_w is None and s.energy_j is None
    assert s.sm_clock_mhz is None and s.mem_clock_mhz is None
    assert s.gpu_util is None and s.memory_util is None
    assert s.temperature_c == 35 and s.memory_total == 80 * GIB  # the others still read
    for fn in ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetClockInfo", "nvmlDeviceGetUtilizationRates"):
        assert sum(fn in r.getMessage() for r in caplog.records) == 1, fn


def test_healthy_report() -> None:
    nvml, _ = make()
    r = nvml.health(0)
    assert r == HealthReport(ecc_volatile_uncorrected=0, remapped_rows_pending=False,
                             remapped_rows_failure=False, retired_pages_pending=False,
                             recovery_action=0, xid_errors=(), processes=(), errors=())


def test_health_fields() -> None:
    nvml, fake = make()
    g = fake.devices[1]
    g.ecc_volatile_uncorrected = 2
    g.remapped = (5, 1, 1, 0)
    g.retired_pending = 1
    g.recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    g.compute = [(1234, 550 * MIB), (99, None)]
    r = nvml.health(1)
    assert r.ecc_volatile_uncorrected == 2
    assert r.remapped_rows_pending is True and r.remapped_rows_failure is False
    assert r.retired_pages_pending is True
    assert r.recovery_action == 1
    assert r.processes == (GpuProcess(1234, 550 * MIB), GpuProcess(99, None))
    assert nvml.health(0).processes == ()  # the other GPU is clean


def test_health_unsupported_is_none_not_error() -> None:
    nvml, fake = make(1)
    g = fake.devices[0]
    g.unsupported = {"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows",
                     "nvmlDeviceGetRetiredPagesPendingStatus"}
    g.recovery_action_return = pynvml.NVML_ERROR_NOT_SUPPORTED  # driver before r550
    r = nvml.health(0)
    assert r.ecc_volatile_uncorrected is None
    assert r.remapped_rows_pending is None and r.remapped_rows_failure is None
    assert r.retired_pages_pending is None and r.recovery_action is None
    assert r.errors == ()


def test_health_real_errors_are_reported() -> None:
    nvml, fake = make(1)
    fake.devices[0].failing = {"nvmlDeviceGetRemappedRows": pynvml.NVML_ERROR_GPU_IS_LOST}
    r = nvml.health(0)
    assert r.remapped_rows_pending is None
    assert r.errors == ("nvmlDeviceGetRemappedRows: GPU is lost",)


def test_process_list_falls_back_to_older_versions() -> None:
    nvml, fake = make(1)
    fake.devices[0].compute = [(77, 1 * MIB)]
    fake.missing = {"nvmlDeviceGetComputeRunningProcesses_v3"}
    assert nvml.health(0).processes == (GpuProcess(77, MIB),)
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in fake.calls
    nvml2, fake2 = make(1)
    fake2.devices[0].unsupported = {"nvmlDeviceGetComputeRunningProcesses_v3",
                                    "nvmlDeviceGetComputeRunningProcesses_v2",
                                    "nvmlDeviceGetComputeRunningProcesses"}
    assert nvml2.health(0).processes is None  # unknown, not "none"


def test_processes_with_graphics() -> None:
    nvml, fake = make(1)
    fake.devices[0].compute = [(10, MIB)]
    fake.devices[0].graphics = [(10, MIB), (20, None)]
    assert nvml.processes(0) == (GpuProcess(10, MIB),)
    assert [p.pid for p in nvml.processes(0, graphics=True) or ()] == [10, 20]


def test_xid_errors_are_reported_once_per_gpu() -> None:
    nvml, fake = make(2)
    nvml.devices()  # registers the event set
    fake.inject_xid(1, 79)
    fake.inject_xid(0, 48)
    fake.inject_xid(1, 94)
    assert nvml.health(0).xid_errors == (48,)
    assert nvml.health(0).xid_errors == ()  # seen since the last call only
    assert nvml.health(1).xid_errors == (79, 94)  # drained while checking GPU 0, kept for GPU 1
    assert nvml.health(1).xid_errors == ()


def test_xid_unsupported_gpu_is_not_registered() -> None:
    nvml, fake = make(2)
    fake.devices[0].supported_events = 0
    nvml.health(1)
    assert set(fake.registered) == {1}


def test_pending_xids_survive_shutdown() -> None:
    nvml, fake = make(1)
    nvml.health(0)
    fake.inject_xid(0, 79)
    nvml.shutdown()
    assert fake.event_sets_freed == 1
    assert nvml.health(0).xid_errors == (79,)


def test_index_of_uuid() -> None:
    nvml, fake = make(3)
    assert nvml.index_of_uuid(fake.devices[2].uuid) == 2
    assert nvml.index_of_uuid("GPU-ffffffff-1111-2222-3333-444444444444") is None


def test_persistence_mode() -> None:
    nvml, fake = make(2)
    assert nvml.persistence_mode(1) is False
    assert nvml.set_persistence_mode(1, True) is None
    assert fake.devices[1].persistence == 1 and nvml.persistence_mode(1) is True
    fake.devices[0].failing = {"nvmlDeviceSetPersistenceMode": pynvml.NVML_ERROR_NO_PERMISSION}
    assert nvml.set_persistence_mode(0, True) == "not supported on this GPU"
    fake.devices[0].failing = {"nvmlDeviceSetPersistenceMode": pynvml.NVML_ERROR_UNKNOWN}
    assert nvml.set_persistence_mode(0, True) == "nvmlDeviceSetPersistenceMode: Unknown Error"


def test_init_failure_reasons() -> None:
    fake = FakePynvml()
    fake.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    nvml = Nvml(module=fake)
    reason = nvml.available()
    assert reason is not None and "libnvidia-ml.so.1 not found" in reason
    with pytest.raises(NvmlUnavailable, match="libnvidia-ml.so.1 not found"):
        nvml.devices()
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert "kernel driver is not loaded" in (nvml.available() or "")
    fake.init_error = None  # the driver came up: the next call works
    assert nvml.available() is None


def test_unknown_index() -> None:
    nvml, _ = make(1)
    with pytest.raises(NvmlUnavailable, match="no GPU with index 3"):
        nvml.sample(3)


def test_pause_releases_nvml_until_resume() -> None:
    nvml, fake = make(1)
    nvml.health(0)
    nvml.pause("NVML released for a GPU reset")
    assert not fake.initialized
    with pytest.raises(NvmlUnavailable, match="released for a GPU reset"):
        nvml.sample(0)
    assert nvml.available() == "NVML released for a GPU reset"
    assert not fake.initialized  # nothing re-initialised it meanwhile
    nvml.resume()
    assert nvml.sample(0).temperature_c == 35


def test_concurrent_use_from_threads() -> None:
    nvml, fake = make(2)
    failures: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(50):
                nvml.sample(i % 2)
                nvml.health(i % 2)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and fake.inits == 1


def test_report_json_round_trip() -> None:
    r = HealthReport(ecc_volatile_uncorrected=1, remapped_rows_pending=True, recovery_action=4,
                     xid_errors=(79, 79), processes=(GpuProcess(5, 7), GpuProcess(6, None)),
                     errors=("x: GPU is lost",))
    assert HealthReport.from_json(r.to_json()) == r
    assert HealthReport.from_json({"processes": None}).processes is None
    with pytest.raises(ValueError, match="unknown field"):
        HealthReport.from_json({"ecc": 1})
    with pytest.raises(ValueError, match="xid_errors must be an integer"):
        HealthReport.from_json({"xid_errors": ["79"]})


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None,
                    reason="this machine has NVML: the unavailable path cannot be seen here")
def test_real_pynvml_without_driver_says_why() -> None:
    nvml = Nvml()  # the real nvidia-ml-py binding
    reason = nvml.available()
    assert reason is not None and "libnvidia-ml.so.1 not found" in reason


def test_gpupool_client_nvml_library_is_refused() -> None:
    """A daemon whose LD_LIBRARY_PATH holds the client's lib folder would load our own NVML
    shim through pynvml; that is refused with a reason that says what to fix."""
    class ClientLib:
        def gpupool_shim_version(self) -> bytes:
            return b"0.1.0"

    class Module:
        nvmlLib = ClientLib()
        shut = 0

        def nvmlInit(self) -> None:
            pass

        def nvmlShutdown(self) -> None:
            Module.shut += 1

    why = Nvml(Module()).available()
    assert why is not None and "gpupool's client NVML library" in why
    assert "LD_LIBRARY_PATH" in why and Module.shut == 1
