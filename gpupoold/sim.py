"""Simulated GPUs: one config file per GPU for the simulated device library.

Each simulated GPU is its own `libgpupool-sim.so` device 0, configured through the file named by
GPUPOOL_SIM_CONFIG (`key = value` lines, see worker/sim/README.md). The files live in
`<state_dir>/sim/`; each GPU gets a distinct, stable UUID and PCI bus id.
"""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

GIB = 1 << 30


def sim_uuid(index: int, host: str | None = None) -> bytes:
    """A stable 16-byte UUID for simulated GPU `index` on this host."""
    host = host if host is not None else socket.gethostname()
    return hashlib.sha256(f"gpupool-simulated/{host}/{index}".encode()).digest()[:16]


def format_uuid(raw: bytes) -> str:
    """'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx', as nvidia-smi prints it."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def sim_pci_bus(index: int) -> int:
    return 0x18 + 0x10 * index


def sim_config_text(index: int, name: str, memory_gib: int) -> str:
    return (
        f"# written by gpupoold for simulated GPU {index}; rewritten at every start\n"
        f"name = {name}\n"
        f"total_memory = {memory_gib * GIB}\n"
        f"uuid = {sim_uuid(index).hex()}\n"
        f"pci_bus = {sim_pci_bus(index)}\n"
        "device_count = 1\n"
    )


def write_sim_config(state_dir: Path, index: int, name: str, memory_gib: int) -> Path:
    """Write the config file of simulated GPU `index` and return its path."""
    folder = state_dir / "sim"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"gpu{index}.conf"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(sim_config_text(index, name, memory_gib))
    tmp.replace(path)
    return path
