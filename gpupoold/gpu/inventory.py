"""The GPUs this daemon serves: simulated ones, or the real GPUs of the driver.

Real mode takes the inventory from NVML (`gpupoold/gpu/nvml.py`): every GPU, or those whose NVML
indices are in the `gpus` setting, with their real names, UUIDs, PCI bus ids and memory sizes.
Workers load the `driver` library with device ordinal = NVML index; they run with
CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA numbers the GPUs as NVML (and nvidia-smi) do.

Without NVML but with a loadable driver, gpupoold serves the `gpus` ordinals (or 0) blind: no
names, UUIDs or health checks, and says so. With no GPU to serve (no driver, NVML sees no GPU)
it refuses to start (`NoGpuError`, exit 78) unless `fallback_to_simulated` asks for one
simulated GPU instead.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpupoold.config.identity import server_name
from gpupoold.config.settings import Settings
from gpupoold.gpu.nvml import Nvml, NvmlDevice, NvmlUnavailable
from gpupoold.gpu.sim import (
    SimMemoryError,
    format_uuid,
    sim_memory_dir,
    sim_pci_bus_id,
    sim_uuid,
    write_sim_config,
)

log = logging.getLogger("gpupoold.gpus")


class InventoryError(Exception):
    """The configured GPUs cannot be served; the message names the setting and what to do."""


class NoGpuError(InventoryError):
    """Real mode found no GPU to serve (no driver, no device, an NVML error) and may not fall
    back to a simulated one: `gpupoold serve` exits 78 (EX_CONFIG) with what it found."""


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
    # Folders its workers write besides their cache (the simulated GPU's memory) and files they
    # read (its config): the worker's sandbox allows them (worker/sandbox.c, --sandbox-rw/-ro).
    writable: tuple[str, ...] = ()
    readable: tuple[str, ...] = ()

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


# How NVML's reasons begin when its library or Python package is not installed (nvml.py): only
# then are real GPUs served without it ("blind"). Any other NVML failure (the kernel driver not
# loaded, no permission, a version mismatch) means the driver is broken: no GPU is served.
NVML_ABSENT = ("libnvidia-ml.so.1 not found", "the Python package nvidia-ml-py is not installed")


def probe_driver(driver: str) -> str | None:
    """None when the driver library loads, else the loader's reason."""
    try:
        ctypes.CDLL(driver)
    except OSError as exc:
        return str(exc)
    return None


def simulated_gpus(settings: Settings, count: int, sim_lib: Path | None) -> tuple[Gpu, ...]:
    gpus = []
    # The server's name (as the fleet knows it) makes its GPUs' UUIDs its own.
    server = server_name(settings.state_dir)
    for i in range(count):
        try:
            conf = write_sim_config(settings.state_dir, server, i, settings.sim_name,
                                    settings.sim_memory_gib, count)
        except (SimMemoryError, ValueError) as exc:  # the message says what to do
            raise InventoryError(str(exc)) from None
        gpus.append(Gpu(index=i, name=settings.sim_name, uuid=format_uuid(sim_uuid(server, i)),
                        simulated=True, driver=str(sim_lib) if sim_lib else "", ordinal=0,
                        env={"GPUPOOL_SIM_CONFIG": str(conf)},
                        writable=(str(sim_memory_dir(settings.state_dir)),),
                        readable=(str(conf.resolve()),),
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
    when NVML is missing; with no GPU at all, NoGpuError, or 1 simulated GPU when
    `fallback_to_simulated` is set."""
    if settings.simulated > 0:
        gpus = await asyncio.to_thread(simulated_gpus, settings, settings.simulated, sim_lib)
        return Inventory(gpus)
    nvml = nvml if nvml is not None else Nvml()
    nvml_why = await asyncio.to_thread(nvml.available)
    driver_why = await asyncio.to_thread(probe_driver, settings.driver)
    no_device = False  # NVML works and sees no GPU
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
            no_device = True
    # Drop the session: nothing will use it, and a reset needs every NVML client gone.
    await asyncio.to_thread(nvml.shutdown)
    if driver_why is None and not no_device and nvml_why.startswith(NVML_ABSENT):
        ordinals = settings.gpus or [0]
        log.warning("NVML is not available (%s): serving device(s) %s of %s without names, "
                    "UUIDs or health checks; install the driver's NVML (libnvidia-ml.so.1) to "
                    "get them", nvml_why, ", ".join(map(str, ordinals)), settings.driver)
        return Inventory(tuple(
            Gpu(index=i, name=f"GPU {ordinal}", uuid="", simulated=False,
                driver=settings.driver, ordinal=ordinal)
            for i, ordinal in enumerate(ordinals)), nvml_reason=nvml_why)
    reason = no_gpu_reason(settings.driver, driver_why, nvml_why, no_device)
    if not settings.fallback_to_simulated:
        raise NoGpuError(
            f"no GPU to serve: {reason}. Repair the NVIDIA driver (`nvidia-smi` must list the "
            "GPUs) or point `driver` at its libcuda.so.1; to serve simulated GPUs instead, set "
            "`simulated = N` (or `fallback_to_simulated = true` on a machine meant to have no GPU)")
    gpus = await asyncio.to_thread(simulated_gpus, settings, 1, sim_lib)
    return Inventory(gpus, fallback_reason=reason, nvml_reason=nvml_why)


def no_gpu_reason(driver: str, driver_why: str | None, nvml_why: str, no_device: bool) -> str:
    """What real mode found instead of a GPU: 'no device: ...', 'no driver: ...' or
    'NVML error: ...', with the loader's and NVML's own words."""
    driver_text = (f"the driver library {driver} loads" if driver_why is None
                   else f"the driver library {driver} cannot be loaded ({driver_why})")
    if no_device:
        return f"no device: NVML works but sees no GPU on this machine; {driver_text}"
    if driver_why is not None:
        return f"no driver: {driver_text}; NVML: {nvml_why}"
    return f"NVML error: {nvml_why}; {driver_text}"
