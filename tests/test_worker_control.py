"""gpupool-worker's control mode (--control-fd) and gpupoold/workers/supervisor.py, on the simulated device.

The tests play the daemon (WorkerSupervisor, or the control socket by hand for what the
supervisor never does) and the client (a TCP connection, frames from the generated protocol).
Under the sanitizer build (GPUPOOL_SAN=1 GPUPOOL_BUILD_DIR=...-asan) every worker's output is
checked for sanitizer reports.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import gpupool_protocol as gp
import pytest
from conftest import BUILD_DIR, SANITIZER_MARKS, require
from gpupool.wire.frames import read_exactly
from sim_images import NOOP_PTX
from worker_client import next_frame

from gpupoold.gpu.environment import driver_environment
from gpupoold.gpu.inventory import Gpu
from gpupoold.workers import control
from gpupoold.workers.supervisor import (
    LATENCY_BUCKETS,
    Worker,
    WorkerExit,
    WorkerStartError,
    WorkerStats,
    WorkerSupervisor,
    describe_exit,
)

pytestmark = pytest.mark.san  # quick: scripts/test.sh runs them against the sanitizer build too

WORKER = BUILD_DIR / "gpupool-worker"
SIM = BUILD_DIR / "libgpupool-sim.so"
VA_BASE = 0x200000000000
VA_SIZE = 1 << 40
PRIMARY_CTX = 0x6750000000000000 | (1 << 40) | 1
H_MODULE, H_FUNC = 4, 6
CUDA_ERROR_DEVICE_UNAVAILABLE = 46
HELLO_REQ = 7


def handle(kind: int, n: int) -> int:
    return 0x6750000000000000 | (kind << 40) | n


# ---------------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def built(native_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require(WORKER.exists(), "gpupool-worker is not built")
    require(SIM.exists(), "the simulated device (libgpupool-sim.so) is not built")
    monkeypatch.delenv("GPUPOOL_SIM_CONFIG", raising=False)  # the sim's defaults


@pytest.fixture(autouse=True)
def worker_output(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Everything the workers printed (through the supervisor's log); no sanitizer reports."""
    caplog.set_level(logging.INFO, logger="gpupoold")
    yield caplog
    lines = [r.getMessage() for r in caplog.records if r.name == "gpupoold.worker"]
    for bad in (*SANITIZER_MARKS, "Segmentation", "Aborted"):
        assert not any(bad in line for line in lines), "\n".join(lines)


@pytest.fixture
def gpu() -> Gpu:
    return Gpu(index=0, name="simulated", uuid="", simulated=True, driver=str(SIM), ordinal=0)


@pytest.fixture
async def supervisor(tmp_path: Path) -> AsyncIterator[WorkerSupervisor]:
    sup = WorkerSupervisor(WORKER, tmp_path / "cache")
    yield sup
    await sup.stop_all(grace=10)
    assert not sup.workers


# ---------------------------------------------------------------------------------- the client
class Client:
    """The client end of a TCP connection whose server end is handed to a worker (blocking; the
    tests run it in a thread so that the event loop keeps reading the control socket)."""

    def __init__(self) -> None:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            self.sock = socket.create_connection(listener.getsockname())
            self.server_side, _ = listener.accept()
        self.sock.settimeout(60)
        self.notices: list[gp.Notice] = []
        self._req = 100

    def hand_over(self) -> int:
        """The server end's descriptor, for Worker.assign (close_server_side() afterwards)."""
        return self.server_side.fileno()

    def close_server_side(self) -> None:
        self.server_side.close()

    def close(self) -> None:
        self.sock.close()
        self.server_side.close()

    def _exact(self, n: int) -> bytes:
        return read_exactly(self.sock, n)

    def frame(self) -> tuple[int, int, bytes]:
        """The next frame that is not a notice (notices are kept in self.notices)."""
        return next_frame(self.sock, self.notices)

    def hello_reply(self) -> gp.HelloReply:
        op, req, body = self.frame()
        assert (op, req) == (gp.Hello.OP, HELLO_REQ)
        return gp.HelloReply.decode(body)

    def post(self, msg: object, bulk: bytes = b"") -> None:
        self.sock.sendall(gp.encode_frame(msg, 0) + bulk)

    def call(self, msg: object, bulk: bytes = b"") -> tuple[object, bytes]:
        self._req += 1
        self.sock.sendall(gp.encode_frame(msg, self._req) + bulk)
        op, req, body = self.frame()
        assert (op, req) == (msg.OP, self._req)  # type: ignore[attr-defined]
        reply = gp.REPLIES[op].decode(body)
        data = self._exact(reply.data) if isinstance(reply, gp.MemcpyDtohReply) else b""
        return reply, data

    def wait_closed(self) -> None:
        """Reads until the worker closes the connection (collecting notices)."""
        while True:
            try:
                self.frame()
            except (EOFError, ConnectionError):
                return


def hello_body(va_base: int = VA_BASE, va_size: int = VA_SIZE) -> bytes:
    return gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=os.getpid(),
                    host="testhost", user="tester", program="test_worker_control",
                    va_base=va_base, va_size=va_size).encode()


async def start_session(worker: Worker, session_id: int, client: Client,
                        body: bytes | None = None) -> bool:
    await worker.assign(session_id, client.hand_over(), body or hello_body(), HELLO_REQ)
    client.close_server_side()
    return await worker.wait_started(60)


def some_work(c: Client, size: int) -> bytes:
    """alloc, H2D, D2H, a module with a kernel launched twice, a sync. Returns the data read."""
    r, _ = c.call(gp.MemAlloc(size=size, stream=0, flags=0))
    assert r.result == 0  # type: ignore[attr-defined]
    ptr = r.dptr  # type: ignore[attr-defined]
    data = os.urandom(size)
    c.post(gp.MemcpyHtod(dst=ptr, stream=0, is_async=0, data=len(data)), data)
    r, back = c.call(gp.MemcpyDtoh(src=ptr, size=size, stream=0, is_async=0))
    assert r.result == 0  # type: ignore[attr-defined]
    mod, func = handle(H_MODULE, 1), handle(H_FUNC, 1)
    r, _ = c.call(gp.ModuleLoad(module=mod, kind=0, sha256=hashlib.sha256(NOOP_PTX).digest(),
                                image_size=len(NOOP_PTX), data=len(NOOP_PTX)), NOOP_PTX)
    assert r.result == 0, r  # type: ignore[attr-defined]
    r, _ = c.call(gp.GetFunction(module=mod, kind=0, func=func, name="gp_test_noop"))
    assert r.result == 0, r  # type: ignore[attr-defined]
    for _ in range(2):
        c.post(gp.Launch(func=func, grid_x=1, grid_y=1, grid_z=1, block_x=1, block_y=1,
                         block_z=1, shared_mem=0, stream=0, params=b"", attrs=b""))
    c.post(gp.MemFree(dptr=ptr, stream=0))
    r, _ = c.call(gp.CtxSynchronize())  # also the result of the posted calls
    assert r.result == 0  # type: ignore[attr-defined]
    assert back == data
    return back


def check_latency(stats: WorkerStats, in_progress: int = 0) -> int:
    """The latency histogram is consistent with the calls: every call that is over is counted in
    exactly one bucket (`in_progress`: how many counted calls may still be running, whose time is
    not known yet), and sum_ns lies within what the buckets' bounds allow. Returns the count."""
    counts = stats.latency_counts
    assert len(counts) == len(LATENCY_BUCKETS) + 1 == 18, counts
    assert all(n >= 0 for n in counts), counts
    calls = sum(stats.calls.values())
    assert calls - in_progress <= sum(counts) <= calls, (counts, stats.calls)
    bounds_ns = [round(b * 1e9) for b in LATENCY_BUCKETS]
    lower = sum(n * b for n, b in zip(counts[1:], bounds_ns))
    assert stats.latency_sum_ns >= lower, (stats.latency_sum_ns, counts)
    if counts[-1] == 0:
        upper = sum(n * b for n, b in zip(counts, bounds_ns))
        assert stats.latency_sum_ns <= upper, (stats.latency_sum_ns, counts)
    assert (stats.latency_sum_ns > 0) == (sum(counts) > 0), (stats.latency_sum_ns, counts)
    return sum(counts)


async def exited(worker: Worker, timeout: float = 60) -> WorkerExit:
    return await asyncio.wait_for(asyncio.shield(worker.exited), timeout)


# ---------------------------------------------------------------------------------- pre-start
async def test_ready_then_end_before_any_session(supervisor: WorkerSupervisor, gpu: Gpu,
                                                 worker_output: pytest.LogCaptureFixture) -> None:
    w = await supervisor.spawn(gpu)
    assert w.init_ms > 0 and w.spawn_ms > 0
    assert "simulated" in w.device
    assert w.uuid.startswith("GPU-") and w.total_memory > 0
    assert w.session_id is None and not w.exited.done()
    os.kill(w.pid, 0)  # alive, waiting for a session
    assert w in supervisor.workers
    await w.end("retired", gp.GP_EREFUSED)
    ex = await exited(w)
    assert (ex.reason, ex.exit_code) == ("server ended", 0), ex
    assert ex.stats == WorkerStats()
    assert w not in supervisor.workers
    lines = [r.getMessage() for r in worker_output.records if r.name == "gpupoold.worker"]
    assert any(line.startswith("[GPU 0 prestart] ") and "ready on" in line for line in lines), lines


async def test_setup_failure_is_a_start_error(supervisor: WorkerSupervisor, tmp_path: Path) -> None:
    bad = Gpu(index=3, name="x", uuid="", simulated=True, driver=str(tmp_path / "nope.so"),
              ordinal=0)
    with pytest.raises(WorkerStartError, match=r"GPU 3 failed to start: cannot load the driver"):
        await supervisor.spawn(bad)
    assert not supervisor.workers  # reaped


async def test_no_binary_or_driver(tmp_path: Path, gpu: Gpu) -> None:
    with pytest.raises(WorkerStartError, match="no gpupool-worker binary"):
        await WorkerSupervisor(None, tmp_path).spawn(gpu)
    nodrv = Gpu(index=1, name="x", uuid="", simulated=True, driver="", ordinal=0)
    with pytest.raises(WorkerStartError, match="GPU 1 has no driver library"):
        await WorkerSupervisor(WORKER, tmp_path).spawn(nodrv)


def test_an_older_workers_adopted_message_without_its_memory_quota_reads_as_no_quota() -> None:
    """A session that outlived a package upgrade: its worker (an older build) ends
    worker_adopted before flags (1.7 before them: nothing said, so gpupoold guesses a share from
    the quota) or before memory_quota too; the new gpupoold must still take it over."""
    said = gp.GP_ADOPTED_SAID | gp.GP_ADOPTED_SHARE | gp.GP_ADOPTED_KEEP_GPU
    msg = gp.WorkerAdopted(session_id=7, pid=42, control=gp.GP_WORKER_CONTROL_VERSION, device=0,
                           uuid="GPU-1", orphaned_s=1.5, gpu="", model="", min_memory=0,
                           counters=gp.WorkerCounters(), memory_quota=8 << 30, flags=said)
    packet = control.encode(msg)
    got = control.decode(packet)
    assert (got.memory_quota, got.flags) == (8 << 30, said)
    header = gp.parse_header(packet[:gp.HEADER_SIZE], gp.MAX_BODY)

    def sent_without(tail: int) -> bytes:
        body = packet[gp.HEADER_SIZE:len(packet) - tail]
        return gp.HEADER.pack(len(body), *header[1:]) + body

    got = control.decode(sent_without(4))  # no flags
    assert (got.session_id, got.uuid, got.memory_quota, got.flags) == (7, "GPU-1", 8 << 30, 0)
    got = control.decode(sent_without(12))  # no memory_quota either
    assert (got.session_id, got.uuid, got.memory_quota, got.flags) == (7, "GPU-1", 0, 0)
    for tail in (5, 13):  # anything else is still garbage
        with pytest.raises(gp.ProtocolError):
            control.decode(sent_without(tail))


def test_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/lib/evil.so")
    monkeypatch.setenv("GPUPOOL_TEST_MARK", "daemon")
    g = Gpu(index=0, name="x", uuid="", simulated=True, driver="d", ordinal=0,
            env={"GPUPOOL_SIM_CONFIG": "/c.conf", "GPUPOOL_TEST_MARK": "gpu"})
    env = driver_environment(g)
    assert "LD_PRELOAD" not in env
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["GPUPOOL_SIM_CONFIG"] == "/c.conf" and env["GPUPOOL_TEST_MARK"] == "gpu"
    assert env["PATH"] == os.environ["PATH"]


def test_worker_stats_latency_parsing() -> None:
    counters = gp.WorkerCounters(calls_launch=3, calls_other=1, duration_s=1.5,
                                 latency_counts=[2, 1, 0, 0, 1] + [0] * 13,
                                 latency_sum_ns=1_234_567)
    st = WorkerStats.from_counters(counters)
    assert st.latency_counts == [2, 1, 0, 0, 1] + [0] * 13 and st.latency_sum_ns == 1_234_567
    assert st.calls == {"launch": 3, "copy": 0, "alloc": 0, "sync": 0, "other": 1}
    out = st.to_json()
    assert out["latency"] == {"counts": st.latency_counts, "sum_ns": 1_234_567}
    # Through a packet, as a worker sends them.
    packet = control.encode(gp.WorkerStats(session_id=5, counters=counters))
    assert WorkerStats.from_counters(control.decode(packet).counters) == st
    # A worker built with another histogram: no calls timed, the rest as sent.
    for counts in ([], [1, 2], [1] * 19):
        other = WorkerStats.from_counters(gp.WorkerCounters(calls_launch=3,
                                                            latency_counts=counts))
        assert other.latency_counts == [0] * 18 and other.latency_sum_ns == 0
        assert other.calls["launch"] == 3
    assert WorkerStats().latency_counts == [0] * 18 and WorkerStats().latency_sum_ns == 0


def test_worker_stats_refuse_numbers_that_do_not_fit() -> None:
    """Counters from a worker are input: beyond int64 (what the store holds) they read 0, and
    so does a duration that is negative or not a number."""
    counters = gp.WorkerCounters(bytes_h2d=1 << 63, bytes_d2h=(1 << 64) - 1, module_bytes=5,
                                 calls_copy=1 << 63, calls_launch=7, duration_s=float("nan"),
                                 latency_counts=[1 << 63] + [1] * 17,
                                 latency_sum_ns=(1 << 63) - 1)
    st = WorkerStats.from_counters(counters)
    assert (st.bytes_h2d, st.bytes_d2h, st.module_bytes, st.duration_s) == (0, 0, 5, 0.0)
    assert st.calls["copy"] == 0 and st.calls["launch"] == 7
    assert st.latency_counts == [0] + [1] * 17 and st.latency_sum_ns == (1 << 63) - 1
    assert WorkerStats.from_counters(gp.WorkerCounters(duration_s=-2.0)).duration_s == 0.0


def test_control_packets_are_checked() -> None:
    """A packet that is not one whole frame of a message a worker sends is refused, saying
    what it is."""
    good = control.encode(gp.WorkerStarted(session_id=3, adoptable=1))
    assert control.decode(good) == gp.WorkerStarted(session_id=3, adoptable=1)
    for bad, words in ((good[:10], "10 bytes"), (good + b"x", "in a packet of"),
                       (control.encode(gp.WorkerEnd(code=1, text="x")), "not a message a worker"),
                       (b"{\"event\": \"ready\"}", "exceeds the limit")):  # a JSON event
        with pytest.raises(gp.ProtocolError, match=words):
            control.decode(bad)


def test_latency_bounds_agree_with_the_worker() -> None:
    """gpupoold's LATENCY_BUCKETS are the worker's WK_LAT_BOUNDS_NS (worker/worker.h)."""
    header = (Path(__file__).resolve().parents[1] / "worker" / "worker.h").read_text()
    m = re.search(r"#define WK_LAT_BOUNDS_NS\s*\\\s*\{([^}]*)\}", header)
    assert m, "WK_LAT_BOUNDS_NS not found in worker/worker.h"
    c_bounds = [int(x.strip().rstrip("ul")) for x in m.group(1).replace("\\", "").split(",")]
    assert c_bounds == [round(b * 1e9) for b in LATENCY_BUCKETS]
    assert list(LATENCY_BUCKETS) == sorted(set(LATENCY_BUCKETS)) and len(LATENCY_BUCKETS) == 17
    assert re.search(r"#define WK_LAT_BUCKETS 18\b", header)


def test_describe_exit() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(0).startswith("exit code 0")
    assert describe_exit(-200) == "killed by signal 200"


# ---------------------------------------------------------------------------------- sessions
async def test_session_goodbye(supervisor: WorkerSupervisor, gpu: Gpu,
                               worker_output: pytest.LogCaptureFixture) -> None:
    w = await supervisor.spawn(gpu)
    c = Client()
    try:
        assert await start_session(w, 41, c)
        assert w.session_id == 41 and w.start_ms > 0
        reply = await asyncio.to_thread(c.hello_reply)
        assert reply.result == 0 and reply.session_id == 41 and reply.simulated == 1
        assert (reply.va_base, reply.va_size) == (VA_BASE, VA_SIZE)
        assert "simulated" in reply.name and len(reply.attributes) > 100
        size = 3 << 20
        await asyncio.to_thread(some_work, c, size)
        c.post(gp.Goodbye())
        ex = await exited(w)
    finally:
        c.close()
    assert (ex.reason, ex.exit_code) == ("client exit", 0), ex
    assert ex.stats.bytes_h2d == size and ex.stats.bytes_d2h == size
    assert ex.stats.module_bytes == len(NOOP_PTX)
    assert ex.stats.calls == {"launch": 2, "copy": 2, "alloc": 2, "sync": 1, "other": 2}
    assert ex.stats.duration_s > 0
    assert check_latency(ex.stats) == 9  # the end: every call is over and timed
    assert ex.stats.latency_sum_ns < ex.stats.duration_s * 1e9
    assert w.stats == ex.stats
    lines = [r.getMessage() for r in worker_output.records if r.name == "gpupoold.worker"]
    assert any(line.startswith("[session 41] ") and "goodbye" in line for line in lines), lines


async def test_client_lost(supervisor: WorkerSupervisor, gpu: Gpu) -> None:
    w = await supervisor.spawn(gpu)
    c = Client()
    assert await start_session(w, 2, c)
    assert (await asyncio.to_thread(c.hello_reply)).result == 0
    c.close()  # no goodbye
    ex = await exited(w)
    assert (ex.reason, ex.exit_code) == ("client lost", 0), ex
    assert "without goodbye" in ex.detail


async def test_protocol_error(supervisor: WorkerSupervisor, gpu: Gpu) -> None:
    w = await supervisor.spawn(gpu)
    c = Client()
    try:
        assert await start_session(w, 12, c)
        assert (await asyncio.to_thread(c.hello_reply)).result == 0
        c.sock.sendall(gp.HEADER.pack(0, gp.Ping.OP, gp.FLAG_REPLY, 5))  # a reply, from a client
        await asyncio.to_thread(c.wait_closed)
        ex = await exited(w)
    finally:
        c.close()
    assert [n.code for n in c.notices] == [gp.GP_EPROTO]
    assert (ex.reason, ex.detail, ex.exit_code) == ("protocol error", c.notices[0].text, 0), ex
    assert ex.stats.calls == dict.fromkeys(("launch", "copy", "alloc", "sync", "other"), 0)
    assert check_latency(ex.stats) == 0 and ex.stats.latency_sum_ns == 0


async def test_server_ends_the_session(supervisor: WorkerSupervisor, gpu: Gpu) -> None:
    w = await supervisor.spawn(gpu)
    c = Client()
    try:
        assert await start_session(w, 3, c)
        assert (await asyncio.to_thread(c.hello_reply)).result == 0
        r, _ = await asyncio.to_thread(c.call, gp.MemAlloc(size=1 << 20, stream=0, flags=0))
        assert r.result == 0  # type: ignore[attr-defined]
        text = "the operator ended this lease; run the program again"
        await w.end(text, gp.GP_EREFUSED)
        await asyncio.to_thread(c.wait_closed)
        ex = await exited(w)
    finally:
        c.close()
    assert [(n.code, n.op, n.text) for n in c.notices] == [(gp.GP_EREFUSED, 0, text)]
    assert (ex.reason, ex.detail, ex.exit_code) == ("server ended", text, 0), ex
    assert ex.stats.calls["alloc"] == 1
    assert check_latency(ex.stats) == 1


async def test_end_while_the_client_does_not_read(supervisor: WorkerSupervisor, gpu: Gpu) -> None:
    """A worker stuck writing to a client that does not read still sees END and ends."""
    w = await supervisor.spawn(gpu)
    c = Client()
    size = 256 << 20  # far more than the socket buffers hold
    try:
        assert await start_session(w, 10, c)
        assert (await asyncio.to_thread(c.hello_reply)).result == 0
        r, _ = await asyncio.to_thread(c.call, gp.MemAlloc(size=size, stream=0, flags=0))
        assert r.result == 0  # type: ignore[attr-defined]
        c.post(gp.MemcpyDtoh(src=r.dptr, size=size, stream=0, is_async=0), b"")  # type: ignore[attr-defined]
        deadline = time.monotonic() + 60
        # The copy has started: the worker is stuck writing, and still sends stats from there.
        while w.stats.bytes_d2h != size and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert w.stats.bytes_d2h == size
        await w.end("ended while you were not reading", gp.GP_EREFUSED)
        ex = await exited(w)
    finally:
        c.close()
    assert (ex.reason, ex.exit_code) == ("server ended", 0), ex
    assert ex.stats.bytes_d2h == size


async def test_worker_killed(supervisor: WorkerSupervisor, gpu: Gpu) -> None:
    w = await supervisor.spawn(gpu)
    c = Client()
    try:
        assert await start_session(w, 4, c)
        os.kill(w.pid, signal.SIGKILL)
        ex = await exited(w)
    finally:
        c.close()
    assert (ex.reason, ex.detail, ex.exit_code) == ("worker crashed", "killed by SIGKILL", -9)


async def test_kill_by_the_daemon(supervisor: WorkerSupervisor, gpu: Gpu) -> None:
    w = await supervisor.spawn(gpu)
    w.kill()
    ex = await exited(w)
    assert ex.reason == "worker crashed" and "killed by gpupoold" in ex.detail
    with pytest.raises(WorkerStartError, match="has exited"):
        await w.assign(9, 0, hello_body(), HELLO_REQ)
    await w.end("gone anyway", 0)  # no-op


async def test_refused_hello(supervisor: WorkerSupervisor, gpu: Gpu) -> None:
    w = await supervisor.spawn(gpu)
    c = Client()
    try:
        # Not aligned to the granularity: the worker cannot reserve this window.
        assert not await start_session(w, 5, c, hello_body(va_base=VA_BASE + 0x1000))
        reply = await asyncio.to_thread(c.hello_reply)
        ex = await exited(w)
    finally:
        c.close()
    assert reply.result == gp.GP_EVAWINDOW and "VA window" in reply.message
    assert w.refusal is not None and w.refusal[0] == gp.GP_EVAWINDOW
    assert w.refusal[1] == reply.message
    assert (ex.reason, ex.exit_code) == ("refused", 1), ex


async def test_stats_during_a_long_transfer(tmp_path: Path, gpu: Gpu) -> None:
    events: list[WorkerStats] = []
    sup = WorkerSupervisor(WORKER, tmp_path / "cache", on_stats=lambda w: events.append(w.stats))
    w = await sup.spawn(gpu)
    c = Client()
    chunk = 8 << 20
    try:
        assert await start_session(w, 6, c)
        assert (await asyncio.to_thread(c.hello_reply)).result == 0
        r, _ = await asyncio.to_thread(c.call, gp.MemAlloc(size=chunk, stream=0, flags=0))
        ptr = r.dptr  # type: ignore[attr-defined]
        data = bytes(chunk)
        sent = 0
        deadline = time.monotonic() + 120
        # Copy until two stats events have come during the transfer (the worker sends one a
        # second at most), however long that takes on this machine.
        while len(events) < 2 and time.monotonic() < deadline:
            await asyncio.to_thread(c.post, gp.MemcpyHtod(dst=ptr, stream=0, is_async=0,
                                                          data=chunk), data)
            sent += chunk
        assert len(events) >= 2
        await asyncio.to_thread(c.call, gp.CtxSynchronize())
        # The last change (the sync) is reported too, then nothing while nothing changes.
        while events[-1].calls["sync"] != 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert events[-1].bytes_h2d == sent and events[-1].calls["sync"] == 1
        quiet = len(events)
        await asyncio.sleep(1.5)
        assert len(events) == quiet
        c.post(gp.Goodbye())
        ex = await exited(w)
    finally:
        c.close()
        await sup.stop_all(grace=10)
    values = [e.bytes_h2d for e in events]
    assert values == sorted(values)
    assert all(a.calls != b.calls for a, b in zip(events, events[1:])), events  # on a change
    assert all(e.calls["copy"] >= 1 for e in events)
    assert ex.reason == "client exit" and ex.stats.bytes_h2d == sent
    # A stats event during a copy counts that copy in `calls` before its time is known.
    for e in events:
        check_latency(e, in_progress=1)
    for a, b in zip(events, events[1:]):
        assert all(x <= y for x, y in zip(a.latency_counts, b.latency_counts)), (a, b)
        assert a.latency_sum_ns <= b.latency_sum_ns
    assert check_latency(events[-1]) == sum(events[-1].calls.values())  # after the sync
    assert check_latency(ex.stats) == sum(ex.stats.calls.values())
    assert ex.stats.latency_counts == events[-1].latency_counts  # no call after the last event


async def test_stats_report_memory_held_and_busy_time(tmp_path: Path, gpu: Gpu) -> None:
    """mem_used follows allocations and frees (a change makes a stats event due); busy_ns counts
    the simulated device's time in launches, copies and memsets."""
    events: list[WorkerStats] = []
    sup = WorkerSupervisor(WORKER, tmp_path / "cache", on_stats=lambda w: events.append(w.stats))
    w = await sup.spawn(gpu)
    c = Client()

    async def reported(what: str, check: object) -> WorkerStats:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if events and check(events[-1]):  # type: ignore[operator]
                return events[-1]
            await asyncio.sleep(0.05)
        raise AssertionError(f"no stats event with {what}: {events[-3:]}")

    try:
        assert await start_session(w, 8, c)
        assert (await asyncio.to_thread(c.hello_reply)).result == 0
        r, _ = await asyncio.to_thread(c.call, gp.MemAlloc(size=3 << 20, stream=0, flags=0))
        a = r.dptr  # type: ignore[attr-defined]
        mapped_a = r.mapped_size  # type: ignore[attr-defined]
        assert mapped_a >= 3 << 20
        r, _ = await asyncio.to_thread(c.call, gp.MemAlloc(size=1 << 20, stream=0, flags=0))
        b, mapped_b = r.dptr, r.mapped_size  # type: ignore[attr-defined]
        await reported("both allocations", lambda e: e.mem_used == mapped_a + mapped_b)
        # Device work: memsets and a device-to-device copy of 3 MiB.
        for _ in range(4):
            c.post(gp.Memset(dst=a, value=0x5A, elem_size=1, count=3 << 20, stream=0, is_async=0))
        c.post(gp.MemcpyDtod(dst=b, src=a, size=1 << 20, stream=0, is_async=0))
        c.post(gp.MemFree(dptr=b, stream=0))
        r, _ = await asyncio.to_thread(c.call, gp.CtxSynchronize())
        assert r.result == 0  # type: ignore[attr-defined]
        after_free = await reported("the free", lambda e: e.mem_used == mapped_a)
        assert after_free.busy_ns > 0
        busy = after_free.busy_ns
        # Time spent waiting for the client is not device time.
        await asyncio.sleep(1.2)
        c.post(gp.Goodbye())
        ex = await exited(w)
    finally:
        c.close()
        await sup.stop_all(grace=10)
    assert ex.reason == "client exit"
    assert ex.stats.busy_ns == busy  # nothing ran after the last event
    assert ex.stats.busy_ns < int(ex.stats.duration_s * 1e9)
    assert ex.stats.mem_used == 0  # the worker released everything before it reported its end
    mems = [e.mem_used for e in events]
    assert mems[0] <= mapped_a + mapped_b and max(mems) == mapped_a + mapped_b


async def test_info_is_not_for_a_worker(supervisor: WorkerSupervisor, gpu: Gpu) -> None:
    """`info` is a first frame for gpupoold; inside a session the worker answers GP_EPROTO (a
    reply, so that a client waiting for one reads why) and closes as for any protocol error."""
    w = await supervisor.spawn(gpu)
    c = Client()
    try:
        assert await start_session(w, 14, c)
        assert (await asyncio.to_thread(c.hello_reply)).result == 0
        request = gp.Info(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, token="t", host="h")
        c.sock.sendall(gp.encode_frame(request, 77))
        op, req, body = await asyncio.to_thread(c.frame)
        await asyncio.to_thread(c.wait_closed)
        ex = await exited(w)
    finally:
        c.close()
    assert (op, req) == (gp.Info.OP, 77)
    reply = gp.InfoReply.decode(body)
    assert reply.result == gp.GP_EPROTO and "gpupoold" in reply.message
    assert (reply.major, reply.minor, reply.gpus, reply.gpu_views) == (gp.MAJOR, gp.MINOR, 0, [])
    assert [n.code for n in c.notices] == [gp.GP_EPROTO]
    assert ex.reason == "protocol error" and "info" in ex.detail, ex


async def test_stop_all(supervisor: WorkerSupervisor, gpu: Gpu) -> None:
    idle = await supervisor.spawn(gpu)
    busy = await supervisor.spawn(gpu)
    c = Client()
    try:
        assert await start_session(busy, 8, c)
        assert (await asyncio.to_thread(c.hello_reply)).result == 0
        await supervisor.stop_all(grace=30)
        await asyncio.to_thread(c.wait_closed)
    finally:
        c.close()
    assert idle.exited.result().reason == "shutdown" and idle.exited.result().exit_code == 0
    assert busy.exited.result().reason == "shutdown" and busy.exited.result().exit_code == 0
    assert [n.code for n in c.notices] == [CUDA_ERROR_DEVICE_UNAVAILABLE]
    with pytest.raises(WorkerStartError, match="shutting down"):
        await supervisor.spawn(gpu)


# ---------------------------------------------------------------------------------- raw socket
class RawWorker:
    """The worker with a control socket held by the test itself: for what the supervisor never
    does (closing the socket under the worker, sending garbage)."""

    def __init__(self, cache: Path, *extra: str) -> None:
        self.ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ctl.settimeout(60)
        env = driver_environment(Gpu(0, "x", "", True, str(SIM), 0))
        self.proc = subprocess.Popen(
            [str(WORKER), "--control-fd", str(theirs.fileno()), "--driver", str(SIM),
             "--device", "0", "--cache-dir", str(cache), "--simulated", *extra],
            pass_fds=(theirs.fileno(),), env=env, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL)
        theirs.close()

    def start_session(self, client: Client, session: int = 77) -> gp.WorkerStarted:
        msg = session_message(session)
        socket.send_fds(self.ctl, [msg], [client.hand_over()])
        client.close_server_side()
        ev = self.event()
        assert isinstance(ev, gp.WorkerStarted), ev
        assert client.hello_reply().result == 0
        return ev

    def event(self) -> object:
        return control_event(self.ctl)

    def finish(self, timeout: float) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.communicate()
            self.ctl.close()
        text = err.decode(errors="replace")
        for bad in SANITIZER_MARKS:
            assert bad not in text, text
        return self.proc.returncode, text


def session_message(session: int) -> bytes:
    return control.encode(gp.WorkerSession(session_id=session, hello_req=HELLO_REQ,
                                           hello=hello_body()))


def test_control_socket_closed_while_idle(tmp_path: Path) -> None:
    rw = RawWorker(tmp_path)
    assert isinstance(rw.event(), gp.WorkerReady)
    rw.ctl.shutdown(socket.SHUT_RDWR)  # the daemon is gone
    code, err = rw.finish(timeout=5)  # promptly: not a timeout
    assert code == 0 and "gpupoold is gone" in err


def test_control_socket_closed_during_a_session(tmp_path: Path) -> None:
    rw = RawWorker(tmp_path)
    assert isinstance(rw.event(), gp.WorkerReady)
    c = Client()
    try:
        socket.send_fds(rw.ctl, [session_message(77)], [c.hand_over()])
        c.close_server_side()
        assert rw.event() == gp.WorkerStarted(session_id=77, adoptable=0)
        assert c.hello_reply().result == 0
        rw.ctl.shutdown(socket.SHUT_RDWR)
        c.wait_closed()  # the worker closes the client connection...
        code, err = rw.finish(timeout=5)  # ...and exits promptly, with no end event
    finally:
        c.close()
    assert code == 0 and "gpupoold is gone" in err
    assert [n.code for n in c.notices] == [CUDA_ERROR_DEVICE_UNAVAILABLE]


# ------------------------------------------------------------------ adoption (worker/adopt.c)
def adopt(path: Path, version: int = gp.GP_WORKER_CONTROL_VERSION) -> tuple[socket.socket, int]:
    """Connect to an adoption socket and send worker_adopt with a new log pipe: (control,
    pipe)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(30)
    sock.connect(str(path))
    r, w = os.pipe()
    msg = gp.WorkerAdopt(control=version, daemon_pid=os.getpid())
    socket.send_fds(sock, [control.encode(msg)], [w])
    os.close(w)
    return sock, r


def control_event(sock: socket.socket) -> object:
    data = sock.recv(65536)
    assert data, "control socket closed"
    return control.decode(data)


def adoptable_worker(tmp_path: Path, grace: str) -> tuple[RawWorker, Path]:
    """A worker whose sessions outlive their daemon by `grace` seconds; its adoption folder."""
    folder = tmp_path / "workers"
    folder.mkdir()
    rw = RawWorker(tmp_path, "--adopt-dir", str(folder), "--orphan-grace", grace)
    assert isinstance(rw.event(), gp.WorkerReady)
    return rw, folder


def test_an_orphaned_session_goes_on_and_is_adopted(tmp_path: Path) -> None:
    rw, folder = adoptable_worker(tmp_path, "30")
    c = Client()
    try:
        assert rw.start_session(c).adoptable == 1
        path = folder / "lease-77.sock"
        assert path.is_socket() and path.stat().st_mode & 0o077 == 0  # the daemon's user only
        assert c.call(gp.Ping(token=1))[0].token == 1
        rw.ctl.shutdown(socket.SHUT_RDWR)  # gpupoold is gone...
        time.sleep(0.3)
        assert c.call(gp.Ping(token=2))[0].token == 2  # ...and the client is still served
        assert rw.proc.poll() is None
        # An unknown control version is refused; the session goes on, still adoptable.
        bad, bad_log = adopt(path, version=99)
        ev = control_event(bad)
        assert isinstance(ev, gp.WorkerAdoptRefused), ev
        assert f"control version {gp.GP_WORKER_CONTROL_VERSION}" in ev.error
        bad.close()
        os.close(bad_log)
        ctl, log_fd = adopt(path)
        ev = control_event(ctl)
        assert isinstance(ev, gp.WorkerAdopted), ev
        assert ev.session_id == 77 and ev.control == gp.GP_WORKER_CONTROL_VERSION
        assert ev.pid == rw.proc.pid and ev.device == 0
        assert ev.orphaned_s >= 0.3 and ev.uuid.startswith("GPU-")
        assert (ev.gpu, ev.model, ev.min_memory) == ("", "", 0)
        assert WorkerStats.from_counters(ev.counters).calls == dict.fromkeys(
            ("launch", "copy", "alloc", "sync", "other"), 0)
        # A second daemon cannot take it while this one follows it.
        other, other_log = adopt(path)
        assert isinstance(control_event(other), gp.WorkerAdoptRefused)
        other.close()
        os.close(other_log)
        assert c.call(gp.Ping(token=3))[0].token == 3
        ctl.send(control.encode(gp.WorkerEnd(code=100007, text="maintenance")))  # the new socket
        ev = control_event(ctl)
        assert isinstance(ev, gp.WorkerEnded) and ev.reason == "server ended", ev
        c.wait_closed()
        assert rw.proc.wait(timeout=10) == 0
        with os.fdopen(log_fd, "rb") as pipe:
            logged = pipe.read().decode(errors="replace")
        assert "adopted by gpupoold pid" in logged and "server ended the session" in logged
        assert not path.exists()
        ctl.close()
    finally:
        c.close()
        if rw.proc.poll() is None:
            rw.proc.kill()
        rw.finish(timeout=10)


def test_an_orphan_ends_after_its_grace_and_records_its_end(tmp_path: Path) -> None:
    rw, folder = adoptable_worker(tmp_path, "0.5")
    c = Client()
    try:
        rw.start_session(c, session=78)
        assert c.call(gp.Ping(token=1))[0].token == 1
        t0 = time.monotonic()
        rw.ctl.shutdown(socket.SHUT_RDWR)
        c.wait_closed()
        assert 0.4 <= time.monotonic() - t0 < 5
        code, err = rw.finish(timeout=10)
    finally:
        c.close()
    assert code == 0 and "no gpupoold adopted this session within 0.5 s" in err
    assert [n.code for n in c.notices] == [CUDA_ERROR_DEVICE_UNAVAILABLE]
    assert "gone for 0.5 s" in c.notices[0].text
    end = control.decode((folder / "lease-78.end").read_bytes())
    assert isinstance(end, gp.WorkerEnded) and end.in_session == 1
    assert end.session_id == 78 and end.reason == "daemon lost"
    assert "worker_orphan_grace" in end.detail
    assert not (folder / "lease-78.sock").exists()


@pytest.mark.parametrize("garbage", [
    b"GPWS", b"hello?",
    session_message(1)[:-1],  # the header says one byte more
    control.encode(gp.WorkerAdopt(control=2)),  # not worker_session
    control.encode(gp.WorkerSession(session_id=1, flags=4, hello=b"")),  # an unknown flag
], ids=["short", "text", "cut", "other message", "unknown flag"])
def test_malformed_session(tmp_path: Path, garbage: bytes) -> None:
    rw = RawWorker(tmp_path)
    assert isinstance(rw.event(), gp.WorkerReady)
    rw.ctl.send(garbage)
    ev = rw.event()
    assert isinstance(ev, gp.WorkerFailed) and "reinstall gpupool" in ev.error
    code, _ = rw.finish(timeout=30)
    assert code == 1


def test_usage_errors(tmp_path: Path) -> None:
    base = ["--driver", str(SIM), "--device", "0", "--cache-dir", str(tmp_path)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stream:
        p = subprocess.run([str(WORKER), "--control-fd", str(stream.fileno()), *base],
                           pass_fds=(stream.fileno(),), capture_output=True, timeout=30)
    assert p.returncode == 2 and b"SOCK_SEQPACKET" in p.stderr
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        p = subprocess.run([str(WORKER), "--control-fd", str(b.fileno()), "--session-id", "1",
                            *base], pass_fds=(b.fileno(),), capture_output=True, timeout=30)
    assert p.returncode == 2 and b"excludes" in p.stderr


def test_workers_never_get_the_client_shim_as_their_driver(tmp_path, native_build) -> None:
    from gpupoold.gpu.environment import without_shim_dirs

    shim_dir, driver_dir, empty = tmp_path / "shim", tmp_path / "driver", tmp_path / "empty"
    for d in (shim_dir, driver_dir, empty):
        d.mkdir()
    (shim_dir / "libcuda.so.1").write_bytes((native_build / "client" / "libcuda.so.1").read_bytes())
    (driver_dir / "libcuda.so.1").write_bytes(b"\x7fELF not the shim")
    path = f"{empty}:{shim_dir}:{driver_dir}"
    assert without_shim_dirs(path) == f"{empty}:{driver_dir}"


async def test_worker_process_follows_a_process_that_is_not_our_child(tmp_path: Path) -> None:
    """An adopted worker is someone else's child: its end is seen through the pidfd (or /proc),
    its exit status is unknown, and a signal reaches it only while it is the same process."""
    from gpupoold.workers.process import WorkerProcess

    # A grandchild: `sh` starts sleep in the background and exits, so sleep is not ours.
    out = subprocess.run(["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"], capture_output=True,
                         text=True, check=True)
    pid = int(out.stdout.strip())
    proc = WorkerProcess(pid)
    assert proc.adopted and not proc.ended
    proc.signal(signal.SIGKILL)
    assert await asyncio.wait_for(proc.wait(), 10) is None  # not our child: no status
    assert proc.ended
    proc.signal(signal.SIGKILL)  # a no-op once it has ended (the pid may be reused)


async def test_the_supervisor_keeps_a_pid_file_per_worker_it_follows(tmp_path: Path,
                                                                     gpu: Gpu) -> None:
    """Pid files under state_dir/workers name the workers a daemon follows (the next gpupoold
    kills the ones it does not take over): written at spawn, removed once the worker is reaped;
    kill_orphans kills a worker whose daemon is gone and spares the ones it is told to keep."""
    from gpupoold.workers.state_dir import WorkerDir
    wdir = WorkerDir(tmp_path)
    sup = WorkerSupervisor(WORKER, tmp_path / "cache", workers_dir=wdir)
    sup.prepare_workers_dir(adoptable=False)
    try:
        first = await sup.spawn(gpu)
        second = await sup.spawn(gpu)
        assert (wdir.path / str(first.pid)).read_text() == "0"
        assert (wdir.path / str(second.pid)).is_file()
        first.kill()
        await asyncio.wait_for(asyncio.shield(first.exited), 30)
        assert not (wdir.path / str(first.pid)).exists()
        # A stray worker of "a previous daemon" (a process named gpupool-worker that nobody
        # follows) and its pid file: killed; the kept worker is not.
        stray = subprocess.Popen(["bash", "-c", "exec -a gpupool-worker sleep 120"])
        # Until the exec has happened: bash's own command line holds the name too, and during
        # the exec /proc/PID/cmdline reads empty (kill_orphans then rightly spares the pid).
        for _ in range(500):
            if Path(f"/proc/{stray.pid}/comm").read_bytes() == b"sleep\n" and \
                    Path(f"/proc/{stray.pid}/cmdline").read_bytes().startswith(b"gpupool-worker"):
                break
            await asyncio.sleep(0.02)
        (wdir.path / str(stray.pid)).write_text("0")
        await asyncio.to_thread(sup.kill_orphans, {second.pid})
        assert stray.wait(10) == -signal.SIGKILL
        assert not (wdir.path / str(stray.pid)).exists()
        assert not second.exited.done() and (wdir.path / str(second.pid)).is_file()
    finally:
        await sup.stop_all(grace=10)
    assert not any(p.name.isdigit() for p in wdir.path.iterdir())


# ------------------------------------------------------------- CUDA IPC answers (worker/h_ipc.c)
def ipc_request(rw: RawWorker) -> gp.WorkerIpcExportEvent:
    """The worker's next CUDA IPC request on the control socket (statistics skipped)."""
    while True:
        ev = rw.event()
        if isinstance(ev, gp.WorkerIpcExportEvent):
            return ev


def test_a_late_ipc_answer_is_never_taken_for_the_next_requests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37, item 4 (review): answers carry no request number, so after an unanswered
    request (gpupoold stalled) its late answer must not become a later export's handle: every
    later IPC call of the session is refused at once, saying why and what to do."""
    # The simulated device keeps an interprocess event's record beside its memory file.
    monkeypatch.setenv("GPUPOOL_SIM_MEMORY_FILE", str(tmp_path / "gpu0.mem"))
    rw = RawWorker(tmp_path)
    assert isinstance(rw.event(), gp.WorkerReady)
    c = Client()
    try:
        rw.start_session(c)
        e1, e2 = handle(3, 1), handle(3, 2)  # events, CU_EVENT_INTERPROCESS | DISABLE_TIMING
        for e in (e1, e2):
            c.post(gp.EventCreate(event=e, flags=0x6))
        c.sock.sendall(gp.encode_frame(gp.IpcGetEventHandle(event=e1), 901))
        first = ipc_request(rw)  # ...and no answer: the worker gives up after its 10 s
        op, req, body = c.frame()
        assert (op, req) == (gp.IpcGetEventHandle.OP, 901)
        r = gp.REPLIES[op].decode(body)
        assert r.code != 0 and "did not answer" in r.error, r
        late = gp.WorkerIpcExported(session_id=first.session_id, handle=b"L" * 64)
        c.sock.sendall(gp.encode_frame(gp.IpcGetEventHandle(event=e2), 902))
        rw.ctl.settimeout(1)
        try:  # before the fix: a second request, answered here by the first one's late answer
            ipc_request(rw)
            rw.ctl.send(control.encode(late))
        except TimeoutError:
            pass
        op, req, body = c.frame()
        assert (op, req) == (gp.IpcGetEventHandle.OP, 902)
        r = gp.REPLIES[op].decode(body)
        assert r.code != 0 and r.handle != late.handle, r
        assert "CUDA IPC is off for the rest of this process" in r.error, r.error
        assert "restart the program" in r.error
    finally:
        c.close()
        rw.ctl.shutdown(socket.SHUT_RDWR)
        rw.finish(timeout=10)
