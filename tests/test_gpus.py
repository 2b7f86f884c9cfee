"""The GPU inventory (gpupoold/gpu/inventory.py): simulated, real through a fake NVML, and the fallbacks."""

from __future__ import annotations

import logging
from pathlib import Path

import pynvml
import pytest
from fake_nvml import GIB, FakeGpu, FakePynvml, gpus

from gpupoold.config.settings import Settings
from gpupoold.gpu.inventory import Gpu, InventoryError, NoGpuError, build_inventory
from gpupoold.gpu.nvml import Nvml
from gpupoold.gpu.sim import format_uuid, sim_uuid

LOADABLE = "libc.so.6"  # stands in for libcuda.so.1: a library the loader finds
MISSING = "/nonexistent/libcuda.so.1"


def settings(tmp_path: Path, **kw: object) -> Settings:
    return Settings(state_dir=tmp_path, **kw)  # type: ignore[arg-type]


def fake_nvml(n: int = 3) -> tuple[Nvml, FakePynvml]:
    fake = FakePynvml(gpus(n))
    for i, g in enumerate(fake.devices):
        g.name = f"NVIDIA Fake {i}"
        g.memory_total = (40 + i) * GIB
    return Nvml(module=fake), fake


async def test_simulated_gpus_have_memory_and_pci_ids(tmp_path: Path) -> None:
    inv = await build_inventory(settings(tmp_path, simulated=2, sim_memory_gib=24),
                                Path("/lib/sim.so"))
    assert inv.fallback_reason is None and inv.nvml is None
    assert [g.to_json() for g in inv.gpus] == [
        {"index": 0, "name": Settings.sim_name, "uuid": format_uuid(sim_uuid(0)), "simulated": True,
         "memory_total": 24 * GIB, "pci_bus_id": "00000000:18:00.0"},
        {"index": 1, "name": Settings.sim_name, "uuid": format_uuid(sim_uuid(1)), "simulated": True,
         "memory_total": 24 * GIB, "pci_bus_id": "00000000:28:00.0"}]
    assert inv.gpus[1].env["GPUPOOL_SIM_CONFIG"] == str(tmp_path / "sim" / "gpu1.conf")
    assert (tmp_path / "sim" / "gpu1.conf").is_file()


async def test_simulated_mode_does_not_touch_nvml(tmp_path: Path) -> None:
    nvml, fake = fake_nvml()
    await build_inventory(settings(tmp_path, simulated=1), None, nvml)
    assert fake.calls == []


async def test_real_mode_serves_every_nvml_gpu(tmp_path: Path) -> None:
    nvml, fake = fake_nvml(3)
    inv = await build_inventory(settings(tmp_path, driver=LOADABLE), None, nvml)
    assert inv.fallback_reason is None and inv.nvml is nvml
    assert inv.gpus == tuple(
        Gpu(index=i, name=f"NVIDIA Fake {i}", uuid=fake.devices[i].uuid, simulated=False,
            driver=LOADABLE, ordinal=i, memory_total=(40 + i) * GIB,
            pci_bus_id=fake.devices[i].pci_bus_id)
        for i in range(3))


async def test_real_mode_gpus_setting_selects_by_nvml_index(tmp_path: Path) -> None:
    nvml, fake = fake_nvml(4)
    inv = await build_inventory(settings(tmp_path, driver=LOADABLE, gpus=[3, 1]), None, nvml)
    # inventory positions are 0, 1; the worker ordinals are the NVML indices
    assert [(g.index, g.ordinal, g.uuid) for g in inv.gpus] == [
        (0, 3, fake.devices[3].uuid), (1, 1, fake.devices[1].uuid)]


async def test_unknown_gpu_index_is_a_startup_error(tmp_path: Path) -> None:
    nvml, _ = fake_nvml(2)
    with pytest.raises(InventoryError) as err:
        await build_inventory(settings(tmp_path, driver=LOADABLE, gpus=[0, 5]), None, nvml)
    msg = str(err.value)
    assert "setting 'gpus'" in msg and "index 5" in msg
    assert "0 (NVIDIA Fake 0), 1 (NVIDIA Fake 1)" in msg and "nvidia-smi -L" in msg


async def test_nvml_without_loadable_driver_names_the_driver_setting(tmp_path: Path) -> None:
    nvml, _ = fake_nvml(1)
    with pytest.raises(InventoryError, match="setting 'driver'.*/nonexistent/libcuda.so.1"):
        await build_inventory(settings(tmp_path, driver=MISSING), None, nvml)


async def test_no_nvml_but_driver_serves_ordinals_blind(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    nvml, fake = fake_nvml()
    fake.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with caplog.at_level(logging.WARNING, logger="gpupoold.gpus"):
        inv = await build_inventory(settings(tmp_path, driver=LOADABLE), None, nvml)
    assert inv.fallback_reason is None and inv.nvml is None
    assert inv.nvml_reason is not None and "libnvidia-ml.so.1 not found" in inv.nvml_reason
    assert [(g.index, g.ordinal, g.name, g.uuid, g.simulated) for g in inv.gpus] == [
        (0, 0, "GPU 0", "", False)]
    assert "NVML is not available" in caplog.text
    inv = await build_inventory(settings(tmp_path, driver=LOADABLE, gpus=[2, 0]), None, nvml)
    assert [(g.index, g.ordinal) for g in inv.gpus] == [(0, 2), (1, 0)]


async def test_nothing_loads_is_an_error_that_says_what_was_found(tmp_path: Path) -> None:
    """A GPU server whose driver broke (a kernel upgrade) must not lend a simulated GPU on which
    no kernel runs: no fallback unless asked for."""
    nvml, fake = fake_nvml()
    fake.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(NoGpuError) as err:
        await build_inventory(settings(tmp_path, driver=MISSING), Path("/lib/sim.so"), nvml)
    text = str(err.value)
    assert text.startswith("no GPU to serve: no driver:") and MISSING in text
    assert "libnvidia-ml.so.1 not found" in text and "`simulated = N`" in text
    assert "fallback_to_simulated" in text


async def test_nothing_loads_falls_back_to_one_simulated_gpu_when_asked(tmp_path: Path) -> None:
    nvml, fake = fake_nvml()
    fake.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    inv = await build_inventory(settings(tmp_path, driver=MISSING, fallback_to_simulated=True),
                                Path("/lib/sim.so"), nvml)
    assert len(inv.gpus) == 1 and inv.gpus[0].simulated
    assert inv.fallback_reason is not None
    assert MISSING in inv.fallback_reason and "libnvidia-ml.so.1 not found" in inv.fallback_reason


async def test_nvml_with_no_gpu_is_an_error_or_the_fallback_asked_for(tmp_path: Path) -> None:
    fake = FakePynvml([])
    with pytest.raises(NoGpuError, match="no GPU to serve: no device: NVML works but sees no GPU"):
        await build_inventory(settings(tmp_path, driver=MISSING), None, Nvml(module=fake))
    assert not fake.initialized  # the session was released: nothing uses it
    inv = await build_inventory(settings(tmp_path, driver=MISSING, fallback_to_simulated=True),
                                None, Nvml(module=fake))
    assert inv.gpus[0].simulated
    assert inv.fallback_reason is not None and "NVML works but sees no GPU" in inv.fallback_reason
    assert not fake.initialized


@pytest.mark.parametrize("code, words", [
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "the NVIDIA kernel driver is not loaded"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "no permission to use NVML"),
])
async def test_a_broken_driver_with_its_library_still_loadable_serves_nothing(
        tmp_path: Path, code: int, words: str) -> None:
    """libcuda.so.1 loads but NVML says the kernel driver is not there (or not ours to use):
    not the "NVML not installed" case that serves GPUs blind, but a broken driver."""
    nvml, fake = fake_nvml()
    fake.init_error = code
    with pytest.raises(NoGpuError) as err:
        await build_inventory(settings(tmp_path, driver=LOADABLE), None, nvml)
    assert str(err.value).startswith("no GPU to serve: NVML error: ") and words in str(err.value)


async def test_missing_name_field_does_not_break_the_inventory(tmp_path: Path) -> None:
    fake = FakePynvml([FakeGpu(unsupported={"nvmlDeviceGetName", "nvmlDeviceGetMinorNumber"})])
    inv = await build_inventory(settings(tmp_path, driver=LOADABLE), None, Nvml(module=fake))
    assert inv.gpus[0].name == "GPU 0" and inv.gpus[0].uuid == fake.devices[0].uuid
