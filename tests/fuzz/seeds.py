"""Seed inputs of the fuzz targets (tests/fuzz/README.md), made from the sources they describe so
that they never go stale: the protocol's golden samples, sessions written with the generated
protocol module, the example client configuration, an info reply of the shape gpupoold
sends. The fuzzer starts from these and mutates them; without seeds it would spend most of its
time learning the frame header.

    python tests/fuzz/seeds.py OUT_DIR      writes OUT_DIR/<target>/<name> for every target
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "protocol" / "python"))
sys.path.insert(0, str(REPO / "tests"))

import gpupool_protocol as gp  # noqa: E402
from client_config_example import EXAMPLE  # noqa: E402
from sim_images import NOOP_PTX  # noqa: E402

TAG = 0x6750000000000000
CTX, STREAM, EVENT, MODULE, FUNC = 1, 2, 3, 4, 6
GRAPH, GRAPH_EXEC, MEMHANDLE = 16, 17, 18
PRIMARY = TAG | (CTX << 40) | 1
VA = 0x200000000000  # the fuzz worker's hello window: its first allocation lands here


def handle(kind: int, n: int) -> int:
    return TAG | (kind << 40) | n


def frame(msg: object, req: int = 0, bulk: bytes = b"") -> bytes:
    return gp.encode_frame(msg, req) + bulk


# ------------------------------------------------------------------------------- protocol
def sample_order() -> list[str]:
    """The names of gp_samples[] in order (the generated C table the target indexes)."""
    text = (REPO / "protocol" / "generated" / "gp_protocol.c").read_text()
    table = text[text.index("const gp_sample_entry gp_samples[] = {"):]
    names = []
    for line in table.splitlines()[1:]:
        line = line.strip()
        if line.startswith("};"):
            break
        if line.startswith('{"'):
            names.append(line[2:line.index('"', 2)])
    return names


def protocol_seeds() -> Iterator[tuple[str, bytes]]:
    order = {name: i for i, name in enumerate(sample_order())}
    for line in (REPO / "protocol" / "golden" / "samples.hex").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, hexbody = line.split(" ", 1)
        yield name, bytes([order[name]]) + bytes.fromhex(hexbody.strip())


# --------------------------------------------------------------------------------- worker
def worker_sessions() -> Iterator[tuple[str, bytes]]:
    """Client byte streams after the hello, each a plausible session."""
    mib = 1 << 20
    alloc = frame(gp.MemAlloc(size=mib, stream=0, flags=0), 1)
    data = bytes(range(256)) * 16
    yield "copies", b"".join([
        alloc,
        frame(gp.MemcpyHtod(dst=VA, stream=0, is_async=0, data=len(data)), 0, data),
        frame(gp.MemcpyDtoh(src=VA, size=len(data), stream=0, is_async=0), 2),
        frame(gp.MemcpyDtod(dst=VA + 8192, src=VA, size=4096, stream=0, is_async=1), 0),
        frame(gp.Memset(dst=VA, value=0x5A, elem_size=1, count=4096, stream=0, is_async=1), 0),
        frame(gp.CtxSynchronize(), 3),
        frame(gp.MemFree(dptr=VA, stream=0), 4),
        frame(gp.Goodbye(), 0),
    ])
    s, e = handle(STREAM, 1), handle(EVENT, 1)
    yield "streams_events", b"".join([
        frame(gp.StreamCreate(stream=s, flags=1, priority=0), 0),
        frame(gp.EventCreate(event=e, flags=0), 0),
        alloc,
        frame(gp.Memset(dst=VA, value=1, elem_size=4, count=256, stream=s, is_async=1), 0),
        frame(gp.EventRecord(event=e, stream=s, flags=0), 0),
        frame(gp.EventQuery(event=e), 2),
        frame(gp.EventSynchronize(event=e), 3),
        frame(gp.StreamSynchronize(stream=s), 4),
        frame(gp.Ping(token=7), 5),
        frame(gp.MemGetInfo(), 6),
    ])
    m, f = handle(MODULE, 1), handle(FUNC, 1)
    sha = hashlib.sha256(NOOP_PTX).digest()
    yield "module_launch", b"".join([
        frame(gp.ModuleLoad(module=m, kind=0, sha256=sha, image_size=len(NOOP_PTX),
                            data=len(NOOP_PTX)), 1, NOOP_PTX),
        frame(gp.GetFunction(module=m, kind=0, func=f, name="gp_test_noop"), 2),
        frame(gp.Launch(func=f, grid_x=1, grid_y=1, grid_z=1, block_x=32, block_y=1, block_z=1,
                        shared_mem=0, stream=0, params=b"", attrs=b""), 0),
        frame(gp.CtxSynchronize(), 3),
        frame(gp.ModuleUnload(module=m, kind=0), 4),
    ])
    c = handle(CTX, 2)
    yield "contexts", b"".join([
        frame(gp.CtxCreate(ctx=c, flags=0), 1),
        frame(gp.CtxSetCurrent(ctx=c), 0),
        alloc,
        frame(gp.CtxSetCurrent(ctx=PRIMARY), 0),
        frame(gp.CtxDestroy(ctx=c), 2),
        frame(gp.CtxSynchronize(), 3),
    ])
    h = handle(MEMHANDLE, 1)
    two = 2 * mib
    yield "vmm", b"".join([
        frame(gp.VmmReserve(size=2 * two, alignment=0, addr=0), 1),
        frame(gp.VmmCreate(handle=h, size=two, handle_types=0, alloc_flags=0), 2),
        frame(gp.VmmMap(ptr=VA, size=two, offset=0, handle=h), 3),
        frame(gp.VmmSetAccess(ptr=VA, size=two, flags=3), 4),
        frame(gp.MemcpyHtod(dst=VA, stream=0, is_async=0, data=16), 0, b"x" * 16),
        frame(gp.VmmUnmap(ptr=VA, size=two), 5),
        frame(gp.VmmRelease(handle=h), 6),
        frame(gp.VmmAddressFree(ptr=VA, size=2 * two), 7),
    ])
    g, x = handle(GRAPH, 1), handle(GRAPH_EXEC, 1)
    yield "graph", b"".join([
        frame(gp.StreamCreate(stream=s, flags=1, priority=0), 0),
        alloc,
        frame(gp.StreamBeginCapture(stream=s, mode=0), 2),
        frame(gp.Memset(dst=VA, value=3, elem_size=1, count=64, stream=s, is_async=1), 0),
        frame(gp.StreamEndCapture(stream=s, graph=g, invalidated=0), 3),
        frame(gp.GraphInstantiate(graph=g, exec=x, flags=0), 4),
        frame(gp.GraphLaunch(exec=x, stream=s, upload=0), 0),
        frame(gp.StreamSynchronize(stream=s), 5),
    ])


# ----------------------------------------------------------------------------- shim replies
def shim_streams() -> Iterator[tuple[str, bytes]]:
    """Mode byte, then what a server sends: replies to requests 1-6 (1-4 callers, 5-6 detached
    copies), notices, a reply to nobody."""
    data = bytes(range(256)) * 4
    notice = frame(gp.Notice(code=700, op=gp.Launch.OP, text="launch failed: illegal address"))
    working = frame(gp.Notice(code=gp.GP_INFO_WORKING, op=0, text=""))
    yield "replies", b"\0" + b"".join([
        frame(gp.PingReply(result=0, token=1), 1),
        working,
        frame(gp.MemAllocReply(result=0, dptr=VA, mapped_size=1 << 21), 2),
        notice,
        frame(gp.MemcpyDtohReply(result=0, data=len(data)), 3, data),
        frame(gp.MemcpyDtohReply(result=0, data=len(data)), 5, data),
        frame(gp.MemcpyDtohReply(result=2, data=0), 6),
        frame(gp.CtxSynchronizeReply(result=0), 99),
        frame(gp.CtxSynchronizeReply(result=0), 4),
    ])
    raw = bytes(range(256)) * 16
    block = struct.pack("<II", len(raw), len(raw)) + raw  # a block stored raw
    yield "lz4_copy", b"\1" + frame(gp.MemcpyDtohReply(result=0, data=len(raw)), 1, block)


# --------------------------------------------------------------------------- config, info
def config_files() -> Iterator[tuple[str, bytes]]:
    yield "example", EXAMPLE.encode()
    yield "minimal", b'servers = ["gpu1:7070"]\ntoken = "gpt_x"\n'
    yield "compression", (b'compression = "lz4"\n[[servers]]\naddress = "a"\n'
                          b'compression = "off"\n')


def info_replies() -> Iterator[tuple[str, bytes]]:
    gpu = gp.InfoGpu(index=0, name="NVIDIA H100 80GB HBM3",
                     uuid="GPU-0a1b2c3d-0000-1111-2222-333344445555", memory_total=85520809984,
                     pci_bus_id="00000000:18:00.0", state="leased", since=1767225600.0,
                     lease_id=7, live_at=1767225600.0, live_memory_total=85520809984,
                     memory_used=1073741824, memory_free=84447068160, gpu_util=38,
                     memory_util=5, temperature_c=41, power_w=123.4, power_limit_w=700.0,
                     energy_j=5000.25, sm_clock_mhz=1980, mem_clock_mhz=2619,
                     cuda_driver_version=13000)
    sim = gp.InfoGpu(index=1, name="Simulated GPU", uuid="GPU-5e00", simulated=1,
                     memory_total=17179869184, state="free", live_at=float("nan"),
                     live_memory_total=-1, memory_used=-1, memory_free=-1, gpu_util=-1,
                     memory_util=-1, temperature_c=-1, power_w=float("nan"),
                     power_limit_w=float("nan"), energy_j=float("nan"), sm_clock_mhz=-1,
                     mem_clock_mhz=-1, cuda_driver_version=13000)
    reply = gp.InfoReply(
        result=0, major=gp.MAJOR, minor=gp.MINOR, server="gpupoold 0.1.0 on gpu-box", gpus=2,
        matching=2, free_matching=1, version="0.1.0", host="gpu-box", remoting="0.0.0.0:7070",
        auth="token", driver_version="580.65.06", cuda_driver_version=13000, you_name="alice",
        you_role="user", time=1767225600.1, gpu_views=[gpu, sim],
        lease_views=[gp.InfoLease(id=7, gpu=0, client_host="laptop", client_pid=4242, mine=1),
                     gp.InfoLease(id=8, gpu=1, client_host="x", client_pid=9)])
    yield "reply", reply.encode()
    yield "empty", gp.InfoReply(result=0).encode()


TARGETS: dict[str, Callable[[], Iterator[tuple[str, bytes]]]] = {
    "fuzz_protocol": protocol_seeds, "fuzz_worker": worker_sessions,
    "fuzz_shim_replies": shim_streams, "fuzz_client_config": config_files,
    "fuzz_info": info_replies,
}


def write(out: Path) -> dict[str, int]:
    """Every target's seeds into out/<target>/; the number written per target."""
    counts = {}
    for target, make in TARGETS.items():
        folder = out / target
        folder.mkdir(parents=True, exist_ok=True)
        n = 0
        for name, data in make():
            (folder / name).write_bytes(data)
            n += 1
        counts[target] = n
    return counts


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: seeds.py OUT_DIR")
    for target, n in write(Path(sys.argv[1])).items():
        print(f"seeds: {n:3d} for {target}")
