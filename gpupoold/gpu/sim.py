"""Simulated GPUs: one config file per GPU for the simulated device library.

Each simulated GPU is its own `libgpupool-sim.so` device 0, configured through the file named by
GPUPOOL_SIM_CONFIG (`key = value` lines, see worker/sim/README.md). The files live in
`<state_dir>/sim/`; each GPU gets a distinct, stable UUID and PCI bus id, and its device memory
lives in a sparse file (key `memory_file`, see `sim_memory_dir`) that keeps what a tenant wrote
after its process is gone, as a real GPU's memory does, so that the scrub between tenants has
something real to wipe.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
from pathlib import Path

GIB = 1 << 30


def sim_uuid(server: str, index: int) -> bytes:
    """The 16-byte UUID of simulated GPU `index` of the server named `server` (its name among
    the fleet's servers, config/identity.py: the host name and the state directory's path).
    Stable across the server's restarts, so that adopted workers, kept leases and the fleet's
    records still name the same GPU; distinct between two servers, on one host or several, so
    that the fleet never takes one server's GPU for another's."""
    return hashlib.sha256(f"gpupool-simulated/{server}/{index}".encode()).digest()[:16]


def format_uuid(raw: bytes) -> str:
    """'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx', as nvidia-smi prints it."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# Where a simulated GPU sits on PCI: one GPU per bus, 16 buses apart from bus 0x18 (one PCIe
# switch each, as on an 8-GPU H100 server); 15 such buses fit below 0xff, so GPU 15 onward
# go to the next PCI domain, as on machines (and VMs) that give groups of GPUs a domain each.
# GPUs 0..14 keep the addresses earlier versions gave them.
SIM_PCI_FIRST_BUS = 0x18
SIM_PCI_BUS_STEP = 0x10
SIM_GPUS_PER_PCI_DOMAIN = 15
SIM_MAX_GPUS = 1024  # worker/sim/sim_internal.h: SIM_MAX_GPUS (a GPU and its peers)


def sim_pci_address(index: int) -> tuple[int, int, int]:
    """(domain, bus, device) of simulated GPU `index`, each within its PCI range."""
    domain, slot = divmod(index, SIM_GPUS_PER_PCI_DOMAIN)
    return domain, SIM_PCI_FIRST_BUS + SIM_PCI_BUS_STEP * slot, 0


def sim_pci_bus_id(index: int) -> str:
    """The PCI bus id of simulated GPU `index` in NVML's format ("00000001:28:00.0")."""
    domain, bus, device = sim_pci_address(index)
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def _sim_pci(index: int) -> str:
    """The same address as the simulated device's config and cuDeviceGetPCIBusId write it."""
    domain, bus, device = sim_pci_address(index)
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


SHM = Path("/dev/shm")
STATE_DIR_NOTE = "STATE_DIR"
SHM_MIN_FREE = 4 * GIB


def _shm_usable() -> bool:
    """/dev/shm is there, writable, and big enough for what tenants write (containers often
    give it 64 MiB: a tenant writing more would crash its worker with SIGBUS)."""
    if not (SHM.is_dir() and os.access(SHM, os.W_OK | os.X_OK)):
        return False
    try:
        st = os.statvfs(SHM)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= SHM_MIN_FREE


def sim_memory_dir(state_dir: Path) -> Path:
    """Where the simulated GPUs of the daemon with this state dir keep their device memory: in
    /dev/shm when it is there with at least 4 GiB free (memory, like a GPU's: a tenant's writes cause no disk writeback,
    which on a small machine costs the remoting path a third of its copy speed, and they last
    until reboot, as on a real GPU), else `<state_dir>/sim`. One folder per state dir, so two
    daemons on one machine never share simulated memory."""
    state_dir = state_dir.resolve()
    if _shm_usable():
        tag = hashlib.sha256(str(state_dir).encode()).hexdigest()[:16]
        return SHM / f"gpupool-sim-{os.getuid()}-{tag}"
    return state_dir / "sim"


class SimMemoryError(Exception):
    """The simulated GPUs' memory folder cannot be trusted; the message says why and what to do."""


def private_memory_folder(folder: Path) -> None:
    """Make `folder` (mode 0700) for tenants' simulated device memory, or accept the one there
    only if it is a real folder (not a link) of this user, closed to others. /dev/shm is writable
    by every user and the folder's name is predictable: one made in advance by someone else, or
    a link to theirs, would let them read every tenant's memory, or have the daemon and its
    workers write where the link points. SimMemoryError when it is not ours."""
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = folder.lstat()
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder"
    elif st.st_uid != uid:
        problem = f"belongs to uid {st.st_uid}, not to gpupoold's user (uid {uid})"
    else:
        if st.st_mode & 0o077:  # ours, made by an older version or by hand: closed now
            os.chmod(folder, 0o700, follow_symlinks=False)
        return
    raise SimMemoryError(
        f"the simulated GPUs' memory folder {folder} {problem}: someone may have made it to read "
        f"tenants' device memory, so nothing was written there. Check who made it, remove it "
        f"(rm -r {folder}) and start gpupoold again")


def sim_memory_file(state_dir: Path, index: int) -> Path:
    """Where simulated GPU `index` keeps its device memory."""
    return sim_memory_dir(state_dir) / f"gpu{index}.mem"


def sim_config_text(server: str, index: int, name: str, memory_gib: int,
                    memory_file: Path | None = None,
                    peers: list[tuple[int, Path]] | None = None) -> str:
    """The config of simulated GPU `index` of `server`; `peers`: the other simulated GPUs of the
    server (index and memory file), onto which a checkpointed worker may be restored (idle
    detach reattaches a lease on whichever GPU is free)."""
    domain, bus, device = sim_pci_address(index)
    text = (
        f"# written by gpupoold for simulated GPU {index}; rewritten at every start\n"
        f"name = {name}\n"
        f"total_memory = {memory_gib * GIB}\n"
        f"uuid = {sim_uuid(server, index).hex()}\n"
        f"pci_domain = {domain}\n"
        f"pci_bus = {bus}\n"
        f"pci_device = {device}\n"
        "device_count = 1\n"
    )
    if memory_file is not None:
        text += f"memory_file = {memory_file}\n"
    for peer, peer_file in peers or []:
        text += f"peer = {sim_uuid(server, peer).hex()} {_sim_pci(peer)} {peer_file}\n"
    return text


def write_sim_config(state_dir: Path, server: str, index: int, name: str, memory_gib: int,
                     count: int = 1) -> Path:
    """Write the config file of simulated GPU `index` (of `count`) of the server named `server`
    and return its path. Its device memory is `sim_memory_file(state_dir, index)` (created by
    the simulated device on first use); the other GPUs are its peers."""
    if count > SIM_MAX_GPUS:
        raise ValueError(f"{count} simulated GPUs: the simulated device knows at most "
                         f"{SIM_MAX_GPUS} GPUs of a server; set `simulated` to {SIM_MAX_GPUS} "
                         "or fewer")
    folder = state_dir / "sim"
    folder.mkdir(parents=True, exist_ok=True)
    # The sim refuses relative paths: workers and scrubs do not run in the daemon's directory.
    memory_file = sim_memory_file(state_dir.resolve(), index)
    private_memory_folder(memory_file.parent)
    owner = memory_file.parent / STATE_DIR_NOTE
    if not owner.exists():  # says whose memory this is (tests clean up by it)
        owner.write_text(f"{state_dir.resolve()}\n")
    if "#" in str(memory_file) or "\n" in str(memory_file):
        raise ValueError(f"the state directory {state_dir} contains '#' or a newline, which the "
                         "simulated device's config file cannot hold; choose another state_dir")
    path = folder / f"gpu{index}.conf"
    tmp = path.with_suffix(".tmp")
    peers = [(i, sim_memory_file(state_dir.resolve(), i)) for i in range(count) if i != index]
    tmp.write_text(sim_config_text(server, index, name, memory_gib, memory_file, peers))
    tmp.replace(path)
    return path


def remove_sim_memory(state_dir: Path, count: int, kept: frozenset[int] = frozenset()
                      ) -> list[Path]:
    """A clean stop: remove the memory files of the `count` simulated GPUs of the daemon with
    this state dir, except those of the GPUs in `kept` (a lease continues there without
    gpupoold: its worker and the next daemon still use that memory), and their /dev/shm folder
    once nothing of it is left. The paths removed."""
    removed: list[Path] = []
    folder = sim_memory_dir(state_dir)
    for index in range(count):
        if index in kept:
            continue
        path = folder / f"gpu{index}.mem"
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError:  # not ours to remove (another user's file): leave it
            continue
        removed.append(path)
    if folder.parent == SHM and not kept:
        note = folder / STATE_DIR_NOTE
        with contextlib.suppress(OSError):
            if not any(p.name != STATE_DIR_NOTE for p in folder.iterdir()):
                note.unlink(missing_ok=True)
                folder.rmdir()
    return removed


def remove_stale_sim_memory(state_dir: Path) -> list[Path]:
    """At start: remove this user's simulated GPU memory folders in /dev/shm whose state
    directory (named in their STATE_DIR note) no longer exists: left by daemons whose state
    directories were deleted (up to 80 GiB of sparse files each, in RAM until reboot). Only
    real folders owned by this user, never another user's or a link; the folder of `state_dir`
    itself is kept. The folders removed."""
    removed: list[Path] = []
    if not SHM.is_dir():
        return removed
    own = sim_memory_dir(state_dir)
    uid = os.getuid()
    for folder in SHM.glob(f"gpupool-sim-{uid}-*"):
        try:
            st = folder.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or folder == own:
                continue
            owner = Path((folder / STATE_DIR_NOTE).read_text().strip())
        except (OSError, UnicodeDecodeError):
            continue
        if not owner.is_absolute() or owner.exists():
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            removed.append(folder)
    return removed


# ------------------------------------------------------------------------- simulated sensors
# What a simulated GPU's "sensors" read, so that NVML tools (nvidia-smi-like tables, nvitop,
# gpustat, Grafana's panels) show a device that behaves like the H100 SXM it claims to be: from
# idle to full load, temperature, power draw and SM clock follow the simulated utilisation
# linearly, memory clock and power limit are the part's, energy accumulates the power drawn. The
# numbers are a model, not a measurement: every place a simulated GPU is shown says "simulated".
SIM_IDLE_TEMPERATURE_C = 32
SIM_FULL_TEMPERATURE_C = 68
SIM_IDLE_POWER_W = 70.0
SIM_FULL_POWER_W = 650.0
SIM_POWER_LIMIT_W = 700.0
SIM_IDLE_SM_CLOCK_MHZ = 345
SIM_FULL_SM_CLOCK_MHZ = 1980
SIM_MEM_CLOCK_MHZ = 2619


def sim_sensors(util: int) -> dict[str, float | int]:
    """The simulated sensors at `util` percent (0..100) of GPU utilisation."""
    u = max(0, min(100, util)) / 100
    return {
        "temperature_c": round(SIM_IDLE_TEMPERATURE_C
                               + u * (SIM_FULL_TEMPERATURE_C - SIM_IDLE_TEMPERATURE_C)),
        "power_w": round(SIM_IDLE_POWER_W + u * (SIM_FULL_POWER_W - SIM_IDLE_POWER_W), 1),
        "power_limit_w": SIM_POWER_LIMIT_W,
        "sm_clock_mhz": round(SIM_IDLE_SM_CLOCK_MHZ
                              + u * (SIM_FULL_SM_CLOCK_MHZ - SIM_IDLE_SM_CLOCK_MHZ)),
        "mem_clock_mhz": SIM_MEM_CLOCK_MHZ,
    }
