"""The GPUs this daemon serves: simulated ones, or the real GPUs of the driver.

Real-GPU inventory through NVML (names, UUIDs, health) comes with the lease work (issue 4); for
now real mode serves the ordinals of the `gpus` setting through the `driver` library.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpupoold.settings import Settings
from gpupoold.sim import format_uuid, sim_uuid, write_sim_config

log = logging.getLogger("gpupoold.gpus")


@dataclass(frozen=True)
class Gpu:
    index: int  # position in this daemon's inventory (what the API shows)
    name: str
    uuid: str  # "GPU-..." or "" when not known yet
    simulated: bool
    driver: str  # the library the worker loads ("" when it was not found)
    ordinal: int  # the device ordinal inside that library
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for its workers

    def to_json(self) -> dict[str, object]:
        return {"index": self.index, "name": self.name, "uuid": self.uuid,
                "simulated": self.simulated}


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[Gpu, ...]
    fallback_reason: str | None = None  # why real mode fell back to a simulated GPU

    def get(self, index: int) -> Gpu:
        return self.gpus[index]


def probe_driver(driver: str) -> str | None:
    """None when the driver library loads, else the loader's reason."""
    try:
        ctypes.CDLL(driver)
    except OSError as exc:
        return str(exc)
    return None


def simulated_gpus(settings: Settings, count: int, sim_lib: Path | None) -> tuple[Gpu, ...]:
    gpus = []
    for i in range(count):
        conf = write_sim_config(settings.state_dir, i, settings.sim_name, settings.sim_memory_gib)
        gpus.append(Gpu(index=i, name=settings.sim_name, uuid=format_uuid(sim_uuid(i)),
                        simulated=True, driver=str(sim_lib) if sim_lib else "", ordinal=0,
                        env={"GPUPOOL_SIM_CONFIG": str(conf)}))
    return tuple(gpus)


async def build_inventory(settings: Settings, sim_lib: Path | None) -> Inventory:
    """The GPUs to serve. Without --simulated and without a loadable driver: 1 simulated GPU."""
    if settings.simulated > 0:
        gpus = await asyncio.to_thread(simulated_gpus, settings, settings.simulated, sim_lib)
        return Inventory(gpus)
    why = await asyncio.to_thread(probe_driver, settings.driver)
    if why is None:
        return Inventory(tuple(
            Gpu(index=i, name=f"GPU {ordinal}", uuid="", simulated=False,
                driver=settings.driver, ordinal=ordinal)
            for i, ordinal in enumerate(settings.gpus)))
    reason = f"the NVIDIA driver {settings.driver} cannot be loaded ({why})"
    gpus = await asyncio.to_thread(simulated_gpus, settings, 1, sim_lib)
    return Inventory(gpus, fallback_reason=reason)
