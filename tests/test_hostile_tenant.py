"""An authenticated tenant that sends what no shim would: whatever it sends, its lease ends, the
GPU comes back to the pool (scrubbed) within 3 s, the lease record holds only what really moved,
and the next client is served. Real gpupoold, real worker, simulated GPU (also under ASan/UBSan).
Besides the hand-written cases, the worker fuzz target's regression inputs, seeds and seeded
mutations of them are replayed against the whole server.

The first case is the hole found at 63c994c: a `memcpy_htod` claiming 2^63 bytes, then a closed
connection. The worker reported 2^63 bytes received, the store refused the number, the lease's
task died, and the GPU stayed `leased` with no lease while /healthz said ok.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gpupool_protocol as gp
import pytest
from conftest import GpupoolServer, run_client
from gpupool.wire.frames import read_frame
from test_e2e_leases import MIB, ended_leases, gpu_states, hold_gpu  # noqa: F401 (fixture)

VA_BASE = 0x200000000000
VA_SIZE = 1 << 40


def recv_frame(s: socket.socket) -> tuple[int, bytes]:
    """(op, body) of the next frame that is not a notice."""
    while True:
        f = read_frame(s)
        if f.op != gp.Notice.OP or f.flags & gp.FLAG_REPLY:
            return f.op, f.body


def open_session(server: GpupoolServer) -> socket.socket:
    """A connection that has its lease: hello sent, the worker's hello reply read."""
    s = socket.create_connection((server.host, server.port), timeout=20)
    hello = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=os.getpid(),
                     host="hostile", user="mallory", program="test_hostile_tenant",
                     token=server.token, va_base=VA_BASE, va_size=VA_SIZE)
    s.sendall(gp.encode_frame(hello, 1))
    op, body = recv_frame(s)
    assert op == gp.Hello.OP
    reply = gp.HelloReply.decode(body)
    assert reply.result == 0, reply
    return s


def sequences() -> dict[str, Callable[[socket.socket], None]]:
    def huge_copy_then_close(s: socket.socket) -> None:
        s.sendall(gp.encode_frame(gp.MemcpyHtod(dst=VA_BASE, data=1 << 63), 0))

    def huge_copy_with_some_data(s: socket.socket) -> None:
        s.sendall(gp.encode_frame(gp.MemcpyHtod(dst=VA_BASE, data=(1 << 64) - 1), 0)
                  + b"\xff" * 65536)

    def in_range_copy_cut_short(s: socket.socket) -> None:
        # A plausible size (the data never comes): counted as nothing, not as 1 GiB.
        s.sendall(gp.encode_frame(gp.MemcpyHtod(dst=VA_BASE, data=1 << 30), 0) + b"x" * 4096)

    def huge_module_image_then_close(s: socket.socket) -> None:
        s.sendall(gp.encode_frame(gp.ModuleLoad(module=0x6750030000000001, kind=0,
                                                sha256=hashlib.sha256(b"").digest(),
                                                image_size=1 << 63, data=1 << 63), 7))

    def huge_device_to_host(s: socket.socket) -> None:
        s.sendall(gp.encode_frame(gp.MemcpyDtoh(src=VA_BASE, size=(1 << 64) - 1), 9))
        op, body = recv_frame(s)  # an error reply, no data
        assert op == gp.MemcpyDtoh.OP and gp.MemcpyDtohReply.decode(body).result != 0

    return {f.__name__: f for f in (huge_copy_then_close, huge_copy_with_some_data,
                                   in_range_copy_cut_short, huge_module_image_then_close,
                                   huge_device_to_host)}


# How each lease must end: a length no device range can have is a protocol error at once (its
# bulk is never drained); the rest end when the connection does.
END_REASONS = {"huge_copy_then_close": "protocol error", "huge_copy_with_some_data":
               "protocol error", "in_range_copy_cut_short": "client lost",
               "huge_module_image_then_close": "client lost", "huge_device_to_host": "client lost"}


SEQUENCES = sequences()


def wait_free(server: GpupoolServer, timeout: float) -> float:
    t0 = time.monotonic()
    while gpu_states(server) != ["free"]:
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"GPU not back within {timeout} s: "
                                 f"{server.get_json('/api/v1/gpus')['gpus']}\n"
                                 f"{server.log_text()[-4000:]}")
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.san
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_hostile_frames_leave_the_gpu_back_in_the_pool(plain_server: GpupoolServer,
                                                      hold_gpu: Path, name: str) -> None:  # noqa: F811
    server = plain_server  # plain TCP, said explicitly: the frames are written raw
    wait_free(server, 30)
    s = open_session(server)
    with s:
        SEQUENCES[name](s)
    took = wait_free(server, 3.0)
    records = ended_leases(server)
    assert len(records) == 1, records
    rec: dict[str, Any] = records[0]
    assert rec["scrub_ok"] is True, rec
    assert rec["end_reason"] == END_REASONS[name], rec
    assert rec["bytes_h2d"] <= 65536 and rec["module_bytes"] == 0, rec
    assert server.get_json("/healthz")["ok"] is True
    assert not server.problems(), server.problems()
    ok = run_client([hold_gpu, MIB, 0, 3], env=server.client_env())
    assert ok.returncode == 0, ok.stderr
    print(f"{name}: GPU back in {took * 1000:.0f} ms")


def fuzz_sessions() -> list[tuple[str, bytes]]:
    """What the worker's fuzz target feeds its sessions, for a real daemon: its regression inputs,
    its seeds, and seeded mutations of them (flipped bytes, cut short, spliced): inputs of the
    kind the fuzzer finds, now against the whole server."""
    import random
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "tests" / "fuzz"))
    import seeds

    out = sorted((f"regression-{p.name}", p.read_bytes())
                 for p in (REPO / "tests" / "fuzz" / "regressions" / "fuzz_worker").glob("*"))
    base = list(seeds.worker_sessions())
    out += [(f"seed-{name}", data) for name, data in base]
    rng = random.Random(16)
    for i in range(24):
        name, data = base[i % len(base)]
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        if i % 3 == 1:
            b = b[:rng.randrange(1, len(b))]
        if i % 3 == 2:
            other = base[rng.randrange(len(base))][1]
            b += other[rng.randrange(len(other)):]
        out.append((f"mutant-{i}-{name}", bytes(b)))
    return out


@pytest.mark.san
@pytest.mark.parametrize("name, stream", fuzz_sessions(), ids=lambda v: v if isinstance(v, str) else "")
def test_fuzz_sessions_leave_the_gpu_back_in_the_pool(plain_server: GpupoolServer,
                                                      name: str, stream: bytes) -> None:
    server = plain_server  # plain TCP, said explicitly: the frames are written raw
    wait_free(server, 30)
    s = open_session(server)
    with s:
        s.sendall(stream)
        s.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            while s.recv(65536):  # whatever the worker answers, until it closes
                pass
    wait_free(server, 3.0)
    (rec,) = ended_leases(server)
    assert rec["scrub_ok"] is True, rec
    assert server.get_json("/healthz")["ok"] is True
    assert not server.problems(), server.problems()
