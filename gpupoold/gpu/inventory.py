"""The GPUs this daemon serves: simulated ones, or the real GPUs of the driver.

Real mode takes the inventory from NVML (`gpupoold/gpu/nvml.py`): every GPU, or those whose NVML
indices are in the `gpus` setting, with their real names, UUIDs, PCI bus ids and memory sizes.
Workers load the `driver` library with device ordinal = NVML index; they run with
CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA numbers the GPUs as NVML (and nvidia-smi) do.

Without NVML but with a loadable driver, gpupoold serves the `gpus` ordinals (or 0) blind: no
names, UUIDs or health checks, and says so. Without a driver it serves one simulated GPU.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpupoold.config.settings import Settings
from gpupoold.gpu.nvml import Nvml, NvmlDevice, NvmlUnavailable
from gpupoold.gpu.sim import format_uuid, sim_pci_bus, sim_uuid, write_sim_config

log = logging.getLogger("gpupoold.gpus")


class InventoryError(Exception):
    """The configured GPUs cannot be served; the message names the setting and what to do."""


@dataclass(frozen=True)
class Gpu:
    index: int  # position in this daemon's inventory (what the API shows)
    name: str
    uuid: str  # "GPU-..." or "" when not known (real GPUs without NVML)
    simulated: bool
    driver: str  # the library the worker loads ("" when it was not found)
    ordinal: int  # the device ordinal inside that library (real GPUs: the NVML index)
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for its workers
    memory_total: int = 0  # bytes; 0 when not known (real GPUs without NVML)
    pci_bus_id: str = ""  # "00000000:18:00.0"; "" when not known

    def to_json(self) -> dict[str, object]:
        return {"index": self.index, "name": self.name, "uuid": self.uuid,
                "simulated": self.simulated, "memory_total": self.memory_total,
                "pci_bus_id": self.pci_bus_id}


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[Gpu, ...]
    fallback_reason: str | None = None  # why real mode fell back to a simulated GPU
    # The NVML session the inventory came from: use it for health checks and metrics. None for
    # simulated GPUs, and for real GPUs served without NVML (`nvml_reason` says why).
    nvml: Nvml | None = None
    nvml_reason: str | None = None

    def get(self, index: int) -> Gpu:
        return self.gpus[index]


def probe_driver(driver: str) -> str | None:
    """None when the driver library loads, else the loader's reason."""
    try:
        ctypes.CDLL(driver)
    except OSError as exc:
        return str(exc)
    return None


def sim_pci_bus_id(index: int) -> str:
    """The PCI bus id simulated GPU `index` reports, in NVML's format."""
    return f"00000000:{sim_pci_bus(index):02X}:00.0"


def simulated_gpus(settings: Settings, count: int, sim_lib: Path | None) -> tuple[Gpu, ...]:
    gpus = []
    for i in range(count):
        conf = write_sim_config(settings.state_dir, i, settings.sim_name, settings.sim_memory_gib,
                                count)
        gpus.append(Gpu(index=i, name=settings.sim_name, uuid=format_uuid(sim_uuid(i)),
                        simulated=True, driver=str(sim_lib) if sim_lib else "", ordinal=0,
                        env={"GPUPOOL_SIM_CONFIG": str(conf)},
                        memory_total=settings.sim_memory_gib << 30, pci_bus_id=sim_pci_bus_id(i)))
    return tuple(gpus)


def select_devices(devices: list[NvmlDevice], wanted: list[int]) -> list[NvmlDevice]:
    """The devices whose NVML index is in `wanted` (in that order), or all of them when empty.
    InventoryError names the `gpus` setting for an index this machine does not have."""
    if not wanted:
        return list(devices)
    by_index = {d.index: d for d in devices}
    unknown = [i for i in wanted if i not in by_index]
    if unknown:
        have = ", ".join(f"{d.index} ({d.name})" for d in devices) or "none"
        raise InventoryError(
            f"setting 'gpus': no GPU with index {', '.join(map(str, unknown))} on this machine "
            f"(NVML sees {len(devices)}: {have}); use the indices `nvidia-smi -L` prints, "
            "or leave `gpus` empty to serve them all")
    return [by_index[i] for i in wanted]


def nvml_gpus(settings: Settings, devices: list[NvmlDevice]) -> tuple[Gpu, ...]:
    return tuple(
        Gpu(index=pos, name=d.name, uuid=d.uuid, simulated=False, driver=settings.driver,
            ordinal=d.index, memory_total=d.memory_total, pci_bus_id=d.pci_bus_id)
        for pos, d in enumerate(select_devices(devices, settings.gpus)))


async def build_inventory(settings: Settings, sim_lib: Path | None,
                          nvml: Nvml | None = None) -> Inventory:
    """The GPUs to serve. `nvml`: the NVML session to use (default: a new one).

    Simulated when `simulated` > 0. Real mode: the NVML inventory; the driver-only fallback
    when NVML is missing; 1 simulated GPU when no driver loads either."""
    if settings.simulated > 0:
        gpus = await asyncio.to_thread(simulated_gpus, settings, settings.simulated, sim_lib)
        return Inventory(gpus)
    nvml = nvml if nvml is not None else Nvml()
    nvml_why = await asyncio.to_thread(nvml.available)
    driver_why = await asyncio.to_thread(probe_driver, settings.driver)
    if nvml_why is None:
        try:
            devices = await asyncio.to_thread(nvml.devices)
        except NvmlUnavailable as exc:
            nvml_why = str(exc)
        else:
            if devices:
                gpus = nvml_gpus(settings, devices)
                if driver_why is not None:
                    raise InventoryError(
                        f"setting 'driver': NVML sees {len(devices)} GPU(s) but the driver "
                        f"library {settings.driver} cannot be loaded ({driver_why}); point "
                        "`driver` at libcuda.so.1 of the installed NVIDIA driver")
                return Inventory(gpus, nvml=nvml)
            nvml_why = "NVML sees no GPU on this machine"
    # Drop the session: nothing will use it, and a reset needs every NVML client gone.
    await asyncio.to_thread(nvml.shutdown)
    if driver_why is None:
        ordinals = settings.gpus or [0]
        log.warning("NVML is not available (%s): serving device(s) %s of %s without names, "
                    "UUIDs or health checks; install the driver's NVML (libnvidia-ml.so.1) to "
                    "get them", nvml_why, ", ".join(map(str, ordinals)), settings.driver)
        return Inventory(tuple(
            Gpu(index=i, name=f"GPU {ordinal}", uuid="", simulated=False,
                driver=settings.driver, ordinal=ordinal)
            for i, ordinal in enumerate(ordinals)), nvml_reason=nvml_why)
    reason = (f"the NVIDIA driver {settings.driver} cannot be loaded ({driver_why}); "
              f"NVML: {nvml_why}")
    gpus = await asyncio.to_thread(simulated_gpus, settings, 1, sim_lib)
    return Inventory(gpus, fallback_reason=reason, nvml_reason=nvml_why)
