"""Health between tenants (gpupoold/gpu/health.py): the messages, NVML GPUs, simulated fault files."""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
from fake_nvml import MIB, FakePynvml, gpus

from gpupoold.gpu.health import check_gpu, evaluate, fault_file
from gpupoold.gpu.inventory import Gpu
from gpupoold.gpu.nvml import GpuProcess, HealthReport, Nvml


def real_gpu(index: int = 0, ordinal: int = 0) -> Gpu:
    return Gpu(index=index, name="NVIDIA H100", uuid="GPU-x", simulated=False,
               driver="libcuda.so.1", ordinal=ordinal)


def sim_gpu(index: int = 0) -> Gpu:
    return Gpu(index=index, name="H100 (gpupool simulated)", uuid="GPU-s", simulated=True,
               driver="/lib/sim.so", ordinal=0)


def test_healthy_report_has_no_problem() -> None:
    assert evaluate(HealthReport()) == []
    assert evaluate(HealthReport(ecc_volatile_uncorrected=0, remapped_rows_pending=False,
                                 remapped_rows_failure=False, retired_pages_pending=False,
                                 recovery_action=0, processes=None)) == []


def test_each_field_gives_its_message() -> None:
    assert evaluate(HealthReport(ecc_volatile_uncorrected=2)) == [
        "2 volatile uncorrectable ECC errors since the driver was loaded"]
    assert evaluate(HealthReport(ecc_volatile_uncorrected=1)) == [
        "1 volatile uncorrectable ECC error since the driver was loaded"]
    assert evaluate(HealthReport(remapped_rows_pending=True)) == [
        "remapped rows pending (a reset is needed)"]
    assert evaluate(HealthReport(remapped_rows_failure=True)) == [
        "row remapping failed (the GPU needs service)"]
    assert evaluate(HealthReport(retired_pages_pending=True)) == [
        "retired pages pending (a reset is needed)"]
    assert evaluate(HealthReport(recovery_action=pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)) == [
        "recovery action: reset"]
    assert evaluate(HealthReport(recovery_action=pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)) == [
        "recovery action: node reboot"]
    assert evaluate(HealthReport(recovery_action=42)) == ["recovery action: unknown action 42"]
    assert evaluate(HealthReport(xid_errors=(79,))) == ["XID 79: GPU fell off the bus"]
    assert evaluate(HealthReport(xid_errors=(48, 48, 1000))) == [
        "XID 48: double-bit ECC error (2 times)", "XID 1000"]
    assert evaluate(HealthReport(processes=(GpuProcess(1234, 550 * MIB), GpuProcess(9, None)))) == [
        "leftover process pid 1234 (550 MiB) still on the GPU",
        "leftover process pid 9 still on the GPU"]
    assert evaluate(HealthReport(errors=("nvmlDeviceGetRemappedRows: GPU is lost",))) == [
        "NVML error: nvmlDeviceGetRemappedRows: GPU is lost"]


def test_application_xids_do_not_quarantine() -> None:
    assert evaluate(HealthReport(xid_errors=(13, 31, 43, 45))) == []
    assert evaluate(HealthReport(xid_errors=(31, 79))) == ["XID 79: GPU fell off the bus"]


async def test_simulated_gpu_without_fault_file_is_healthy(tmp_path: Path) -> None:
    r = await check_gpu(sim_gpu(), None, tmp_path)
    assert r.ok and r.problems == [] and r.details["source"] == "simulated"


async def test_simulated_fault_file_drives_problems(tmp_path: Path) -> None:
    path = fault_file(tmp_path, 1)
    assert path == tmp_path / "sim" / "gpu1.health"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"xid_errors": [79], "remapped_rows_pending": True,
                                "processes": [{"pid": 1234, "used_memory": 550 * MIB}]}))
    r = await check_gpu(sim_gpu(1), None, tmp_path)
    assert not r.ok
    assert r.problems == ["remapped rows pending (a reset is needed)",
                          "XID 79: GPU fell off the bus",
                          "leftover process pid 1234 (550 MiB) still on the GPU"]
    assert r.details["source"] == "fault file" and r.details["xid_errors"] == [79]
    assert (await check_gpu(sim_gpu(0), None, tmp_path)).ok  # only GPU 1 has a fault file
    assert path.exists()  # read, not consumed: the fault stays until someone removes it
    path.unlink()
    assert (await check_gpu(sim_gpu(1), None, tmp_path)).ok


async def test_broken_fault_file_is_a_problem(tmp_path: Path) -> None:
    path = fault_file(tmp_path, 0)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    r = await check_gpu(sim_gpu(), None, tmp_path)
    assert not r.ok and str(path) in r.problems[0] and "fix or delete it" in r.problems[0]
    path.write_text(json.dumps({"ecc": 3}))
    r = await check_gpu(sim_gpu(), None, tmp_path)
    assert not r.ok and "unknown field(s) ecc" in r.problems[0]


async def test_real_gpu_health_comes_from_nvml_by_ordinal(tmp_path: Path) -> None:
    fake = FakePynvml(gpus(2))
    fake.devices[1].compute = [(1234, 550 * MIB)]
    nvml = Nvml(module=fake)
    # inventory position 0 serving NVML GPU 1 (gpus = [1])
    r = await check_gpu(real_gpu(index=0, ordinal=1), nvml, tmp_path)
    assert not r.ok
    assert r.problems == ["leftover process pid 1234 (550 MiB) still on the GPU"]
    assert r.details["source"] == "nvml"
    assert r.details["processes"] == [{"pid": 1234, "used_memory": 550 * MIB}]
    assert (await check_gpu(real_gpu(index=1, ordinal=0), nvml, tmp_path)).ok


async def test_real_gpu_xid_between_checks(tmp_path: Path) -> None:
    fake = FakePynvml(gpus(1))
    nvml = Nvml(module=fake)
    assert (await check_gpu(real_gpu(), nvml, tmp_path)).ok
    fake.inject_xid(0, 79)
    r = await check_gpu(real_gpu(), nvml, tmp_path)
    assert r.problems == ["XID 79: GPU fell off the bus"]
    assert (await check_gpu(real_gpu(), nvml, tmp_path)).ok


async def test_real_gpu_without_nvml_is_not_checked(tmp_path: Path) -> None:
    r = await check_gpu(real_gpu(), None, tmp_path)
    assert r.ok and r.details["checked"] is False and "NVML is not available" in r.details["note"]
    # served blind (driver-only inventory: no UUID), even with an Nvml object that cannot work
    fake = FakePynvml(gpus(1))
    fake.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    blind = Gpu(index=0, name="GPU 0", uuid="", simulated=False, driver="libcuda.so.1", ordinal=0)
    r = await check_gpu(blind, Nvml(module=fake), tmp_path)
    assert r.ok and r.details["checked"] is False
    assert fake.calls == []


async def test_nvml_failing_at_check_time_is_a_problem(tmp_path: Path) -> None:
    fake = FakePynvml(gpus(1))
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    r = await check_gpu(real_gpu(), Nvml(module=fake), tmp_path)
    assert not r.ok and r.problems[0].startswith("NVML cannot check the GPU: ")
    assert "kernel driver is not loaded" in r.problems[0]


async def test_lost_gpu_is_a_problem(tmp_path: Path) -> None:
    fake = FakePynvml(gpus(1))
    fake.devices[0].failing = {"nvmlDeviceGetTotalEccErrors": pynvml.NVML_ERROR_GPU_IS_LOST}
    r = await check_gpu(real_gpu(), Nvml(module=fake), tmp_path)
    assert r.problems == ["NVML error: nvmlDeviceGetTotalEccErrors: GPU is lost"]
