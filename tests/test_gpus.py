"""The GPU inventory (gpupoold/gpu/inventory.py): simulated, real through a fake NVML, and the fallbacks."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest
from conftest import SAN
from fake_nvml import GIB, FakeGpu, FakePynvml, gpus

from gpupoold.config.identity import server_name
from gpupoold.config.settings import Settings
from gpupoold.gpu.inventory import Gpu, InventoryError, NoGpuError, build_inventory
from gpupoold.gpu.nvml import Nvml
from gpupoold.gpu.sim import format_uuid, sim_pci_bus_id, sim_uuid, write_sim_config

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
    server = server_name(tmp_path)
    assert [g.to_json() for g in inv.gpus] == [
        {"index": 0, "name": Settings.sim_name, "uuid": format_uuid(sim_uuid(server, 0)),
         "simulated": True, "memory_total": 24 * GIB, "pci_bus_id": "00000000:18:00.0"},
        {"index": 1, "name": Settings.sim_name, "uuid": format_uuid(sim_uuid(server, 1)),
         "simulated": True, "memory_total": 24 * GIB, "pci_bus_id": "00000000:28:00.0"}]
    assert inv.gpus[1].env["GPUPOOL_SIM_CONFIG"] == str(tmp_path / "sim" / "gpu1.conf")
    assert (tmp_path / "sim" / "gpu1.conf").is_file()


PCI_BUS_ID = re.compile(r"^([0-9A-F]{8}):([0-9A-F]{2}):([0-9A-F]{2})\.0$")


def valid_pci_bus_id(bus_id: str) -> tuple[int, int, int]:
    """(domain, bus, device) of an NVML-format PCI bus id, each within its PCI range."""
    m = PCI_BUS_ID.match(bus_id)
    assert m, bus_id
    domain, bus, device = (int(x, 16) for x in m.groups())
    assert domain <= 0xFFFF and bus <= 0xFF and device <= 0x1F, bus_id
    return domain, bus, device


async def test_64_simulated_gpus_have_valid_distinct_addresses_and_uuids(tmp_path: Path) -> None:
    # 16 and more used to give bus 0x108 and up, which the simulated device refuses.
    inv = await build_inventory(settings(tmp_path / "a", simulated=64), Path("/lib/sim.so"))
    addresses = [valid_pci_bus_id(g.pci_bus_id) for g in inv.gpus]
    assert len(set(addresses)) == 64
    assert addresses[:2] == [(0, 0x18, 0), (0, 0x28, 0)]  # as earlier versions gave them
    uuids = [g.uuid for g in inv.gpus]
    assert len(set(uuids)) == 64 and all(re.fullmatch(
        r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", u) for u in uuids)
    # Each GPU's config file says the same, and names all the 63 others as peers (a detached
    # lease may come back on any of them), each with its own address.
    conf = (tmp_path / "a" / "sim" / "gpu40.conf").read_text()
    domain, bus, device = addresses[40]
    assert f"uuid = {uuids[40][4:].replace('-', '')}\n" in conf
    assert f"pci_domain = {domain}\npci_bus = {bus}\npci_device = {device}\n" in conf
    peers = re.findall(r"^peer = ([0-9a-f]{32}) (\S+) (\S+)$", conf, re.M)
    assert len(peers) == 63
    assert {p[0] for p in peers} == {u[4:].replace("-", "") for u in uuids} - {
        uuids[40][4:].replace("-", "")}
    assert {p[1] for p in peers} == {f"{d:04x}:{b:02x}:{v:02x}.0"
                                     for i, (d, b, v) in enumerate(addresses) if i != 40}
    # Another server on this host (another state dir): other UUIDs, the same addresses (each
    # server is its own machine's PCI tree).
    other = await build_inventory(settings(tmp_path / "b", simulated=64), Path("/lib/sim.so"))
    assert not set(uuids) & {g.uuid for g in other.gpus}
    # The same server started again: the same UUIDs (adopted workers, kept leases and the
    # fleet's records name its GPUs by them).
    again = await build_inventory(settings(tmp_path / "a", simulated=64), Path("/lib/sim.so"))
    assert [g.uuid for g in again.gpus] == uuids
    assert [g.pci_bus_id for g in again.gpus] == [g.pci_bus_id for g in inv.gpus]


# Loads the simulated device with one GPU's config file, as a worker does, and prints what the
# driver API reports for it (a process of its own: cuInit reads the configuration once).
SIM_PROBE = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
rc = lib.cuInit(0)
if rc != 0:
    sys.exit(f"cuInit failed ({rc})")
bus, uuid, count = ctypes.create_string_buffer(32), ctypes.create_string_buffer(16), ctypes.c_int()
assert lib.cuDeviceGetCount(ctypes.byref(count)) == 0
assert lib.cuDeviceGetPCIBusId(bus, 32, 0) == 0 and lib.cuDeviceGetUuid(uuid, 0) == 0
print(count.value, bus.value.decode(), uuid.raw.hex())
"""


def test_the_simulated_device_takes_the_64th_gpus_config(native_build: Path, tmp_path: Path
                                                         ) -> None:
    if SAN:
        pytest.skip("an ASan-instrumented library cannot be loaded into an uninstrumented Python")
    conf = write_sim_config(tmp_path, "test-server", 63, Settings.sim_name, 1, count=64)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_SIM_")}
    proc = subprocess.run([sys.executable, "-c", SIM_PROBE, str(native_build / "libgpupool-sim.so")],
                          env={**env, "GPUPOOL_SIM_CONFIG": str(conf)}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "0004:48:00.0", sim_uuid("test-server", 63).hex()]
    assert proc.stdout.split()[1].upper() == sim_pci_bus_id(63)[4:]


async def test_simulated_uuids_differ_between_hosts(tmp_path: Path) -> None:
    # Two servers whose state dirs have the same path on two hosts (the fleet's usual case).
    assert sim_uuid(server_name(tmp_path, host="gpu-a"), 0) != sim_uuid(
        server_name(tmp_path, host="gpu-b"), 0)


async def test_too_many_simulated_gpus_is_refused_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="at most 1024 GPUs"):
        await build_inventory(settings(tmp_path, simulated=1025), Path("/lib/sim.so"))


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
