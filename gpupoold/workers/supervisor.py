"""Worker processes: pre-start one per free GPU, hand it a client, follow it, reap it.

The worker contract (worker/README.md, "Control channel"):

    gpupool-worker --control-fd N --driver PATH --device ORDINAL --cache-dir DIR [--simulated]
                   [--tls-cert PATH --tls-key PATH [--tls-client-ca PATH]]

(the --tls-* options when the supervisor was made with `tls=WorkerTls(...)`: TLS on the remoting
port; worker_session then carries GP_WORKER_SESSION_TLS and the worker runs the client's second
TLS handshake itself, docs/protocol.md "TLS".)

N is one end of a SOCK_SEQPACKET socketpair; every packet either way is one frame of the spec's
control messages (workers/control.py, protocol/gpupool.toml "control"). The worker sets the
device up before any client comes and says worker_ready; `WorkerSupervisor.spawn` returns then.
`Worker.assign` sends worker_session (the client's hello body, the client socket in SCM_RIGHTS);
the worker answers the client's hello itself and reports worker_started or worker_refused, then
worker_stats (at most once a second, when a counter, `mem_used` or `busy_ns` changed) and
worker_ended (reason and counters) before it exits. worker_end asks it to stop serving. Closing
the control socket (the daemon's exit) makes it exit at once.

Nothing here raises into the daemon for a worker's sake: a worker that dies, talks nonsense or
hangs ends up as a `WorkerExit` on `Worker.exited`, which always resolves once the process is
reaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import gpupool_protocol as gp

from gpupoold.gpu.environment import driver_environment, with_jit_cache
from gpupoold.gpu.inventory import Gpu
from gpupoold.log import journal_fields, printable
from gpupoold.workers import control, ipc_broker
from gpupoold.workers.process import WorkerProcess
from gpupoold.workers.state_dir import WorkerDir

log = logging.getLogger("gpupoold.workers")
wlog = logging.getLogger("gpupoold.worker")

EXIT_MEANINGS = {0: "normal end", 1: "setup failure or refused session",
                 2: "usage error (daemon/worker mismatch?)"}
OUTPUT_LINE_LIMIT = 1 << 20
CALL_CLASSES = ("launch", "copy", "alloc", "sync", "other")
# The upper bounds (seconds, inclusive) of the workers' call latency histogram; the worker counts
# into these 17 buckets and an 18th above them (+Inf). worker/worker.h WK_LAT_BOUNDS_NS holds the
# same bounds in ns (tests/test_worker_control.py compares them).
LATENCY_BUCKETS: tuple[float, ...] = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                      0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

MAX_DEVICES = 64  # GPUs of one lease: worker_session's array:i32:64 devices
SIM_DEVICES_PER_CONFIG = 1  # a simulated GPU's config: `device_count = 1` (gpu/sim.py)
END_TEXT_LIMIT = 2047  # bytes of worker_end's text (the spec's string:2047)
ADOPT_NOTICE_EVERY = 10.0  # seconds between log lines while a busy worker has not answered
RETIRE_GRACE = 10.0  # seconds an unadoptable worker has to end after END, before SIGKILL
CONTROL_RECV = 65536  # worker events are under 4 KiB
CONTROL_FDS = 4  # descriptors taken with one control message (a worker sends at most one)
DRAIN_TIMEOUT = 5.0  # seconds to read what an exited worker left in its pipes


# The worker marks its warnings and errors with an sd-daemon(3) priority (worker/errors.c).
WORKER_PRIORITY = re.compile(r"^<([0-7])>")


def worker_line(line: str) -> tuple[int, str]:
    """The logging level of a line of the worker, and the line without its priority mark."""
    m = WORKER_PRIORITY.match(line)
    if not m:
        return logging.INFO, line
    prio = int(m.group(1))
    level = (logging.CRITICAL if prio <= 2 else logging.ERROR if prio == 3 else
             logging.WARNING if prio == 4 else logging.INFO if prio <= 6 else logging.DEBUG)
    return level, line[m.end():]


@dataclass(frozen=True)
class WorkerTls:
    """The remoting listener's TLS files, passed to every worker (`--tls-*`): the worker
    terminates the data path's TLS itself."""
    cert: Path
    key: Path
    client_ca: Path | None = None

    def argv(self) -> list[str]:
        args = ["--tls-cert", str(self.cert), "--tls-key", str(self.key)]
        if self.client_ca is not None:
            args += ["--tls-client-ca", str(self.client_ca)]
        return args


class AdoptError(Exception):
    """A worker of an earlier gpupoold could not be adopted; the message says why."""


class WorkerStartError(Exception):
    """The worker could not be started or given its client; the message is for the client and
    the log."""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code} ({EXIT_MEANINGS.get(code, 'error')})"


COUNTER_MAX = (1 << 63) - 1  # what SQLite's INTEGER (and Prometheus' int64 view) can hold


def _int(value: object) -> int:
    """A counter from a worker event: a non-negative integer that fits the store, else 0 (a
    worker's number is input to the daemon, never trusted to fit)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= COUNTER_MAX:
        return value
    return 0


@dataclass
class WorkerStats:
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CALL_CLASSES, 0))
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    module_bytes: int = 0  # module image bytes received from the client
    duration_s: float = 0.0  # since the session started
    mem_used: int = 0  # bytes of device memory the session holds now
    busy_ns: int = 0  # simulated device: ns spent executing work (0 on real GPUs)
    # Calls per latency bucket (LATENCY_BUCKETS, then +Inf; not cumulative) and their total time,
    # over the session. Once a call is over it is in both these and `calls`.
    latency_counts: list[int] = field(
        default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum_ns: int = 0

    @classmethod
    def from_counters(cls, c: gp.WorkerCounters) -> WorkerStats:
        """The counters of a worker_stats, worker_ended or worker_adopted message (a number past
        what the store holds reads 0; a histogram of another length, from a worker built with
        other buckets, reads as no calls timed)."""
        buckets = len(LATENCY_BUCKETS) + 1
        counts = c.latency_counts if len(c.latency_counts) == buckets else [0] * buckets
        dur = c.duration_s
        return cls(calls={"launch": _int(c.calls_launch), "copy": _int(c.calls_copy),
                          "alloc": _int(c.calls_alloc), "sync": _int(c.calls_sync),
                          "other": _int(c.calls_other)},
                   bytes_h2d=_int(c.bytes_h2d), bytes_d2h=_int(c.bytes_d2h),
                   module_bytes=_int(c.module_bytes),
                   duration_s=dur if dur >= 0 and dur == dur else 0.0,
                   mem_used=_int(c.mem_used), busy_ns=_int(c.busy_ns),
                   latency_counts=[_int(n) for n in counts],
                   latency_sum_ns=_int(c.latency_sum_ns))

    def to_json(self) -> dict[str, object]:
        return {"calls": dict(self.calls), "bytes_h2d": self.bytes_h2d,
                "bytes_d2h": self.bytes_d2h, "module_bytes": self.module_bytes,
                "duration_s": self.duration_s, "mem_used": self.mem_used,
                "busy_ns": self.busy_ns,
                "latency": {"counts": list(self.latency_counts), "sum_ns": self.latency_sum_ns}}


@dataclass(frozen=True)
class WorkerExit:
    # client exit | client lost | protocol error | server ended | shutdown | worker error (the
    # worker's `end`); refused (hello refused) | setup failed (`failed`) | worker crashed (no
    # event explains the exit)
    reason: str
    detail: str  # human text (e.g. "killed by SIGSEGV")
    exit_code: int | None  # as asyncio reports it (negative: signal)
    stats: WorkerStats


class Worker:
    """One worker process: pre-started on a GPU, then serving at most one session."""

    def __init__(self, supervisor: WorkerSupervisor, gpu: Gpu, proc: WorkerProcess,
                 sock: socket.socket, output: int, spawned: float) -> None:
        loop = asyncio.get_running_loop()
        self.pid = proc.pid
        self.gpu = gpu
        self.init_ms = 0.0  # the worker's own set-up time (process start to `ready`)
        self.spawn_ms = 0.0  # spawn to `ready` as the daemon saw it
        self.device = ""  # device name as the driver reports it
        self.uuid = ""
        self.total_memory = 0
        self.session_id: int | None = None
        self.stats = WorkerStats()
        self.refusal: tuple[int, str] | None = None  # (result, error) of a refused hello
        self.exited: asyncio.Future[WorkerExit] = loop.create_future()
        self._supervisor = supervisor
        self._proc = proc
        self._sock = sock
        self._output_fd = output  # read end of the pipe that carries its stdout and stderr
        self._ready: asyncio.Future[None] = loop.create_future()
        self._started: asyncio.Future[bool] = loop.create_future()
        # Adoption (WorkerSupervisor.adopt): resolves with the worker_adopted message.
        self._adopted: asyncio.Future[gp.WorkerAdopted] = loop.create_future()
        self._adopted.add_done_callback(_consume)
        self.request: dict[str, Any] = {}  # what the client asked for (worker_adopted)
        self.adopted_flags = 0  # worker_adopted's GP_ADOPTED_* (0 from an older worker)
        self.orphaned_s = 0.0  # how long it served alone before this daemon adopted it
        self.detached = False  # left running when this daemon stopped (detach())
        # Adopted while its lease was detached (idle detach): the device memory it saved, as the
        # worker_detach_ok it sends again before worker_adopted says (worker/adopt.c); else None.
        self.adopted_detached: int | None = None
        # Its session can outlive this daemon (it listens on its adoption socket; `started`).
        self.adoptable = False
        self._end: gp.WorkerEnded | None = None
        self._failure: str | None = None
        self._killed = False
        self._spawned = spawned  # time.monotonic() before the process was created
        self._assigned = 0.0
        self.start_ms = 0.0  # SESSION sent to `started` received
        # Nobody may be waiting on these when the worker exits: no "never retrieved" warnings.
        self._ready.add_done_callback(_consume)
        self._tasks: list[asyncio.Task[None]] = []
        self._peer_tasks: set[asyncio.Task[None]] = set()  # link requests being answered
        # One sender at a time: two waiting for room would replace each other's wake-up.
        self._send_lock = asyncio.Lock()
        self._peer_busy = 0  # of _peer_tasks, those not refused at once (the caps)
        self._supervise_task: asyncio.Task[None] | None = None
        # Idle detach (pool/detach.py): the answer to the pending worker_detach_ask, and the
        # parked session's client sending a frame (worker_wants_gpu).
        self._detach_answer: asyncio.Future[Any] | None = None
        self.wants_gpu = asyncio.Event()
        # time.monotonic() of the last sign of activity (a changed counter, the session's
        # start): idle detach asks only leases quiet for a while (pool/detach.py).
        self.active_at = time.monotonic()

    def __repr__(self) -> str:
        return (f"<Worker pid={self.pid} gpu={self.gpu.index} session={self.session_id} "
                f"{'exited' if self.exited.done() else 'running'}>")

    @property
    def reported_end(self) -> bool:
        """The worker sent its `end` event: its session is over and it exits."""
        return self._end is not None

    @property
    def label(self) -> str:
        """How its log lines are prefixed."""
        if self.session_id is not None:
            return f"[session {self.session_id}]"
        return f"[GPU {self.gpu.index} prestart]"

    # ------------------------------------------------------------------ the daemon's side
    async def assign(self, session_id: int, client_fd: int, hello_body: bytes,
                     hello_req: int, tls: bool | None = None, devices: Sequence[int] = (),
                     memory_quota: int = 0) -> None:
        """Hand the client (its socket and hello) to this worker. The caller keeps its own copy
        of client_fd and closes it. WorkerStartError if the worker is gone or taken.

        devices: the server ordinals of every GPU of the lease, program order (this worker's own
        first); empty for a lease of this worker's GPU alone. memory_quota: the bytes the tenant
        may hold on each GPU (0: no quota).

        tls: the client speaks TLS (the daemon closed its own TLS session on client_fd; the
        worker runs the next handshake). None: as the supervisor is set up (TLS when it was made
        with `tls=`), so that a TLS listener needs no change in the callers."""
        if tls is None:
            tls = self._supervisor.tls is not None
        if tls and self._supervisor.tls is None:
            raise WorkerStartError("a TLS session was assigned to a worker started without the "
                                   "TLS certificate (WorkerSupervisor(tls=...) is not set)")
        if self.session_id is not None:
            raise WorkerStartError(f"the worker for GPU {self.gpu.index} already serves "
                                   f"session {self.session_id}")
        if self.exited.done() or self._proc.ended:
            raise WorkerStartError(f"the worker for GPU {self.gpu.index} (pid {self.pid}) has "
                                   "exited")
        if not (0 <= session_id < 1 << 64 and 0 <= hello_req < 1 << 64
                and 0 <= memory_quota < 1 << 64):
            raise WorkerStartError("session id, hello request id or memory quota out of range")
        if len(devices) > MAX_DEVICES or (devices and devices[0] != self.gpu.ordinal):
            raise WorkerStartError(f"a lease's devices must start with the worker's own GPU "
                                   f"(ordinal {self.gpu.ordinal}), at most {MAX_DEVICES}: "
                                   f"{list(devices)}")
        msg = control.encode(gp.WorkerSession(
            session_id=session_id, hello_req=hello_req,
            flags=gp.GP_WORKER_SESSION_TLS if tls else 0, hello=hello_body,
            devices=list(devices), memory_quota=memory_quota))
        self.session_id = session_id
        self._assigned = time.monotonic()
        try:
            await self._send(msg, [client_fd])
        except OSError as exc:
            raise WorkerStartError(f"the worker for GPU {self.gpu.index} (pid {self.pid}) is "
                                   f"gone ({exc.strerror or exc})") from None

    async def wait_started(self, timeout: float) -> bool:
        """True once the worker has answered the hello with success; False when it refused it,
        exited, or did not answer within `timeout` seconds (it is killed then)."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._started), timeout)
        except TimeoutError:
            log.warning("%s worker pid %d did not answer the hello within %g s: SIGKILL",
                        self.label, self.pid, timeout)
            self.kill()
            return False

    async def end(self, text: str, code: int) -> None:
        """Ask the worker to end its session: the client gets a notice (code, text), the worker
        releases everything, reports `end` ("server ended") and exits. No-op if it is gone."""
        if self.exited.done() or self._sock.fileno() < 0:
            return
        msg = gp.WorkerEnd(code=code, text=control.clip_text(text, END_TEXT_LIMIT))
        try:
            await self._send(control.encode(msg), [])
        except OSError as exc:
            log.info("%s could not send END to worker pid %d: %s", self.label, self.pid, exc)

    async def ask_detach(self, idle_ms: int) -> gp.WorkerDetachOk | gp.WorkerDetachNo | None:
        """Ask the serving worker whether it idles (worker_detach_ask): its answer, or None when
        it exited first. It answers from its wait for the client only, so a worker inside a long
        call answers when the call returns; the ask stays pending until then."""
        if self.session_id is None or self.exited.done():
            return None
        self.wants_gpu.clear()
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._detach_answer = answer
        try:
            await self._send(control.encode(gp.WorkerDetachAsk(
                session_id=self.session_id, idle_ms=max(0, min(idle_ms, 0xFFFFFFFF)))), [])
        except OSError:
            return None
        done, _ = await asyncio.wait([answer, self.exited], return_when=asyncio.FIRST_COMPLETED)
        self._detach_answer = None
        return answer.result() if answer in done else None

    async def tell_detached(self) -> None:
        """worker_detached: its state was checkpointed and its GPU is another lease's."""
        await self._send_quietly(gp.WorkerDetached(session_id=self.session_id or 0))

    async def tell_attached(self, gpu: Gpu, moved: bool) -> None:
        """worker_attached: serve again, on `gpu` (another one than before when `moved`)."""
        self.gpu = gpu
        if gpu.uuid:
            self.uuid = gpu.uuid
        self.wants_gpu.clear()
        await self._send_quietly(gp.WorkerAttached(session_id=self.session_id or 0,
                                                   moved=1 if moved else 0, uuid=gpu.uuid))

    async def _send_quietly(self, msg: Any) -> None:
        if self.exited.done() or self._sock.fileno() < 0:
            return
        try:
            await self._send(control.encode(msg), [])
        except OSError as exc:
            log.info("%s could not send %s to worker pid %d: %s", self.label, msg.NAME,
                     self.pid, exc)

    def kill(self) -> None:
        """SIGKILL (the exit is still reaped and reported on `exited`)."""
        if not self._proc.ended:
            self._killed = True
            self._proc.signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM: the worker tells its client, releases everything and reports "shutdown"."""
        self._proc.signal(signal.SIGTERM)

    def detach(self) -> None:
        """This daemon is stopping and leaves the worker serving its client: close the control
        socket (the worker goes on alone, worker/adopt.c, until a new gpupoold adopts it) and
        forget the process. `exited` never resolves after this."""
        self.detached = True
        for task in [*self._tasks, *self._peer_tasks]:
            task.cancel()
        if self._supervise_task is not None:
            self._supervise_task.cancel()
        asyncio.get_running_loop().call_soon(self._forget)

    def _forget(self) -> None:
        self._proc.forget()
        self._close_socket()

    # ------------------------------------------------------------------ internals
    async def _send(self, data: bytes, fds: list[int]) -> None:
        """One control message (with descriptors), waiting for room if the socket is full."""
        loop = asyncio.get_running_loop()
        async with self._send_lock:
            while True:
                try:
                    socket.send_fds(self._sock, [data], fds)
                    return
                except BlockingIOError:
                    pass
                writable: asyncio.Future[None] = loop.create_future()
                fd = self._sock.fileno()
                loop.add_writer(fd, _set_once, writable)
                try:
                    await writable
                finally:
                    loop.remove_writer(fd)

    def _start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._read_control(), name=f"worker-{self.pid}-control"),
            asyncio.create_task(self._read_output(), name=f"worker-{self.pid}-output"),
        ]
        supervise = asyncio.create_task(self._supervise(), name=f"worker-{self.pid}")
        self._supervise_task = supervise
        self._supervisor._tasks.add(supervise)
        supervise.add_done_callback(self._supervisor._tasks.discard)

    async def _recv_control(self) -> tuple[bytes, list[int]]:
        """One control message and the descriptors that came with it (CUDA IPC's exports)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, CONTROL_RECV, CONTROL_FDS,
                                                  socket.MSG_CMSG_CLOEXEC)
                return data, fds
            except (BlockingIOError, InterruptedError):
                pass
            readable: asyncio.Future[None] = loop.create_future()
            fd = self._sock.fileno()
            loop.add_reader(fd, _set_once, readable)
            try:
                await readable
            finally:
                loop.remove_reader(fd)

    async def _read_control(self) -> None:
        while True:
            try:
                data, fds = await self._recv_control()
            except OSError as exc:
                log.info("%s control socket of worker pid %d: %s", self.label, self.pid, exc)
                return
            if not data:
                _close_fds(fds)
                return
            try:
                ev = control.decode(data)
            except gp.ProtocolError as exc:
                _close_fds(fds)
                log.warning("%s worker pid %d sent an unreadable control message (%s): %r",
                            self.label, self.pid, exc, data[:200])
                continue
            if isinstance(ev, ipc_broker.REQUESTS):
                await self._answer_ipc(ev, fds)
                continue
            if isinstance(ev, PEER_REQUESTS):  # waits for the network: a task of its own
                _close_fds(fds)
                await self._take_peer_request(ev)
                continue
            _close_fds(fds)
            try:
                self._on_event(ev)
            except Exception:  # an odd event costs that event, never the daemon
                log.exception("%s worker pid %d: cannot handle %r", self.label, self.pid, ev)

    async def _answer_ipc(self, ev: Any, fds: list[int]) -> None:
        """A program's cuIpcGetMemHandle / cuIpcOpenMemHandle (issue 37): the broker answers,
        the worker waits for it."""
        fd: int | None = None
        try:
            msg, fd = ipc_broker.answer(self._supervisor.ipc, self.session_id, ev, fds)
            if msg.code:
                log.info("%s worker pid %d: CUDA IPC refused: %s", self.label, self.pid,
                         msg.error)
            await self._send(control.encode(msg), [fd] if fd is not None else [])
        except OSError as exc:
            log.info("%s worker pid %d: answering a CUDA IPC request: %s", self.label, self.pid,
                     exc)
        except Exception:  # an odd request costs that request, never the daemon
            log.exception("%s worker pid %d: cannot answer %r", self.label, self.pid, ev)
        finally:
            _close_fds(fds)
            if fd is not None:
                os.close(fd)

    async def _take_peer_request(self, ev: Any) -> None:
        """A link request gets a task of its own, within PEER_REQUESTS_PER_WORKER of this
        worker's and PEER_REQUESTS_IN_ALL of every worker's at once (each holds a store query
        and a connection for seconds); beyond, it is refused here and now (a worker that floods
        and reads no answer is not read either meanwhile)."""
        sup, refusal = self._supervisor, None
        if self._peer_busy >= PEER_REQUESTS_PER_WORKER:
            refusal = f"this worker has {PEER_REQUESTS_PER_WORKER} being answered"
        elif sup.peer_requests >= PEER_REQUESTS_IN_ALL:
            refusal = f"this server answers {PEER_REQUESTS_IN_ALL} at once"
        if refusal is not None:
            return await self._answer_peer(ev, f"too many link requests: {refusal}; copies go "
                                           "through the client")
        task = asyncio.create_task(self._answer_peer(ev), name=f"worker-{self.pid}-peer")
        self._peer_tasks.add(task)
        task.add_done_callback(self._peer_tasks.discard)
        self._peer_busy, sup.peer_requests = self._peer_busy + 1, sup.peer_requests + 1
        task.add_done_callback(self._peer_done)

    def _peer_done(self, _: asyncio.Task[None]) -> None:
        self._peer_busy -= 1
        self._supervisor.peer_requests -= 1

    async def _answer_peer(self, ev: Any, refusal: str | None = None) -> None:
        """A link of a spread lease between this worker and another server's (issue 37, item
        3): gpupoold connects or accepts (remoting/peer_links.py), the worker gets the socket.
        A worker that does not read its answer within PEER_ANSWER_SEND_S loses it (and the
        socket, closed here)."""
        fd: int | None = None
        links = self._supervisor.peer_links
        try:
            if links is None or refusal is not None:
                cls = (gp.WorkerPeerConnected if isinstance(ev, gp.WorkerPeerConnect)
                       else gp.WorkerPeerAccepted)
                msg: Any = cls(session_id=ev.session_id, link_id=ev.link_id,
                               code=CUDA_ERROR_NOT_SUPPORTED, error=refusal or NO_PEER_LINKS)
            else:
                msg, fd = await links.answer(self.session_id, ev)
            fds = [fd] if fd is not None else []
            await asyncio.wait_for(self._send(control.encode(msg), fds), PEER_ANSWER_SEND_S)
        except TimeoutError:
            log.info("%s worker pid %d: the answer to link request %d was not read within %g s; "
                     "dropped", self.label, self.pid, ev.link_id, PEER_ANSWER_SEND_S)
        except OSError as exc:
            log.info("%s worker pid %d: answering a link request: %s", self.label, self.pid, exc)
        except Exception:  # an odd request costs that request, never the daemon
            log.exception("%s worker pid %d: cannot answer %r", self.label, self.pid, ev)
        finally:
            if fd is not None:
                os.close(fd)

    def _on_event(self, ev: Any) -> None:
        if isinstance(ev, gp.WorkerReady):
            self.init_ms = ev.init_ms if ev.init_ms >= 0 else 0.0
            self.device = ev.device
            self.uuid = ev.uuid
            self.total_memory = _int(ev.total_memory)
            self.spawn_ms = (time.monotonic() - self._spawned) * 1000
            if not self._ready.done():
                self._ready.set_result(None)
        elif isinstance(ev, gp.WorkerFailed):
            self._failure = ev.error or "the worker failed to start"
            if not self._ready.done():
                self._ready.set_exception(WorkerStartError(
                    f"the worker for GPU {self.gpu.index} failed to start: {self._failure}"))
        elif isinstance(ev, gp.WorkerStarted):
            self.start_ms = (time.monotonic() - self._assigned) * 1000
            self.active_at = time.monotonic()
            self.adoptable = ev.adoptable == 1
            if not self._started.done():
                self._started.set_result(True)
        elif isinstance(ev, gp.WorkerRefused):
            self.refusal = (ev.code, ev.error)
            if not self._started.done():
                self._started.set_result(False)
        elif isinstance(ev, gp.WorkerStats):
            self.stats = WorkerStats.from_counters(ev.counters)
            self.active_at = time.monotonic()
            if self._supervisor.on_stats is not None:
                try:
                    self._supervisor.on_stats(self)
                except Exception:  # the callback's bug must not stop the worker's events
                    log.exception("%s on_stats callback failed", self.label)
        elif isinstance(ev, (gp.WorkerDetachOk, gp.WorkerDetachNo)):
            if self._detach_answer is not None and not self._detach_answer.done():
                self._detach_answer.set_result(ev)
            elif isinstance(ev, gp.WorkerDetachOk) and not self._adopted.done():
                self.adopted_detached = _int(ev.mem_used)  # unasked, before worker_adopted
        elif isinstance(ev, gp.WorkerWantsGpu):
            self.wants_gpu.set()
        elif isinstance(ev, gp.WorkerEnded):
            self._end = ev
            self.stats = WorkerStats.from_counters(ev.counters)
        elif isinstance(ev, gp.WorkerAdopted):
            self.stats = WorkerStats.from_counters(ev.counters)
            self.session_id = ev.session_id
            self.uuid = ev.uuid
            self.request = {"gpu": ev.gpu, "model": ev.model, "min_memory": ev.min_memory,
                            "memory": ev.memory_quota}  # a share's quota (0: a whole GPU)
            self.adopted_flags = ev.flags  # GP_ADOPTED_*: kept GPU, ran as a share
            self.orphaned_s = ev.orphaned_s if ev.orphaned_s >= 0 else 0.0
            if not self._adopted.done():
                self._adopted.set_result(ev)
        elif isinstance(ev, gp.WorkerAdoptRefused):
            if not self._adopted.done():
                self._adopted.set_exception(AdoptError(
                    f"worker pid {self.pid} refused: {ev.error or 'no reason given'}"))

    async def _read_output(self) -> None:
        """Forward the worker's stderr (and stdout) lines to the log."""
        loop = asyncio.get_running_loop()
        stream = asyncio.StreamReader(limit=OUTPUT_LINE_LIMIT)
        pipe = os.fdopen(self._output_fd, "rb", buffering=0, closefd=False)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(stream), pipe)
        try:
            while True:
                try:
                    line = await stream.readline()
                except ValueError:  # a line longer than the limit: take it in pieces
                    line = await stream.read(OUTPUT_LINE_LIMIT)
                if not line:
                    return
                # printable: the worker quotes what a client sent (its program, its errors)
                level, text = worker_line(printable(line.decode(errors="replace").rstrip("\n")))
                wlog.log(level, "%s %s", self.label, text,
                         extra=journal_fields(self.session_id, self.gpu.index))
        except OSError as exc:
            log.warning("%s reading the output of worker pid %d: %s", self.label, self.pid, exc)
        finally:
            transport.close()

    async def _supervise(self) -> None:
        """Reap the process, let the readers finish, resolve `exited` (always)."""
        code: int | None = None
        try:
            code = await self._proc.wait()
            # The readers end at end of stream, which the exit brings, unless something else
            # holds the pipe or the socket (a grandchild): then stop reading after a while.
            _, pending = await asyncio.wait(self._tasks, timeout=DRAIN_TIMEOUT)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        except asyncio.CancelledError:
            if self.detached:  # left running on purpose: nothing to resolve or report
                raise
            self.kill()
            self._finish(code)
            raise
        except Exception:  # never let a worker take the daemon down
            log.exception("%s error while supervising worker pid %d", self.label, self.pid)
            self.kill()
            with contextlib.suppress(Exception):
                code = await self._proc.wait()
        self._finish(code)

    def _finish(self, code: int | None) -> None:
        for task in self._peer_tasks:  # no worker to answer any more
            task.cancel()
        pending = [task for task in self._tasks if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            # The cancelled sock_recv unregisters the socket in a callback that is already
            # queued: close after it, so that the descriptor number is not reused before.
            asyncio.get_running_loop().call_soon(self._close_socket)
        else:
            self._close_socket()
        self._supervisor._reaped(self)
        ex = self._exit_record(code)
        if not self._ready.done():
            why = self._failure or (describe_exit(code) if code is not None else "unknown")
            self._ready.set_exception(WorkerStartError(
                f"the worker for GPU {self.gpu.index} exited during start-up ({why})"))
        if not self._started.done():
            self._started.set_result(False)
        if not self.exited.done():
            self.exited.set_result(ex)
        if ex.reason in ("client exit", "server ended", "shutdown") and code == 0:
            level = logging.INFO
        elif ex.reason in ("client lost", "refused") and code in (0, 1):
            level = logging.INFO
        else:
            level = logging.WARNING
        if code is not None:
            status = describe_exit(code)
        else:
            status = "exit status unknown: adopted" if self._proc.adopted else "not reaped"
        log.log(level, "%s worker pid %d (GPU %d) exited: %s%s (%s)", self.label, self.pid,
                self.gpu.index, ex.reason, f": {ex.detail}" if ex.detail else "", status)

    def _close_socket(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(OSError):
            os.close(self._output_fd)
        self._output_fd = -1

    def _exit_record(self, code: int | None) -> WorkerExit:
        if self._end is not None:
            return WorkerExit(self._end.reason or "worker crashed", self._end.detail, code,
                              self.stats)
        if self.refusal is not None:
            result, error = self.refusal
            return WorkerExit("refused", f"{error} (result {result})", code, self.stats)
        if self._failure is not None:
            return WorkerExit("setup failed", self._failure, code, self.stats)
        if code is not None:
            detail = describe_exit(code)
        elif self._proc.adopted:
            detail = "it ended without a word (adopted from an earlier gpupoold: exit status unknown)"
        else:
            detail = "the process could not be reaped"
        if self._killed:
            detail += " (killed by gpupoold)"
        return WorkerExit("worker crashed", detail, code, self.stats)


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _set_once(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def device_ordinal(first: Gpu, gpu: Gpu) -> int:
    """How worker_session.devices names `gpu` to the worker of `first` (a lease's device 0):
    its device ordinal in that worker's driver. A real GPU: its ordinal (the NVML index, what
    --device says). A simulated one: each simulated GPU's worker loads ordinal 0 of its own
    config, whose peers are the server's other GPUs in index order (gpu/sim.py) at the ordinals
    after its own device (worker/sim/sim_config.c: ordinal device_count + k is peer k)."""
    if not (first.simulated and gpu.simulated):
        return gpu.ordinal
    if gpu.index == first.index:
        return first.ordinal
    return SIM_DEVICES_PER_CONFIG + (gpu.index if gpu.index < first.index else gpu.index - 1)


# A worker's requests for a link of a spread lease to another server (issue 37, item 3), which
# the daemon's PeerLinks (remoting/peer_links.py) answers; without it, this refusal.
PEER_REQUESTS: tuple[type, ...] = (gp.WorkerPeerConnect, gp.WorkerPeerAccept)
CUDA_ERROR_NOT_SUPPORTED = 801
PEER_REQUESTS_PER_WORKER = 4  # link requests one worker may have answered at once
PEER_REQUESTS_IN_ALL = 64  # ...and all workers together
PEER_ANSWER_SEND_S = 20.0  # the most an answer waits for room on the worker's control socket
NO_PEER_LINKS = ("this gpupoold runs without server-to-server links; copies between servers go "
                 "through the client")


class PeerLinkBroker(Protocol):
    async def answer(self, session_id: int | None, ev: Any) -> tuple[Any, int | None]:
        """The message for the worker, and the link's socket (closed by the caller) or None."""
        ...


class WorkerSupervisor:
    """Starts every worker, follows it until it is reaped, and stops them all at shutdown.
    With a `workers_dir` (workers/state_dir.py) it also keeps a pid file per worker it follows, so the
    next gpupoold can tell its predecessor's workers (take over or kill the orphans), and holds
    the adoption sockets and end records the workers leave there."""

    def __init__(self, worker: Path | None, cache_dir: Path, *,
                 on_stats: Callable[[Worker], None] | None = None,
                 tls: WorkerTls | None = None, workers_dir: WorkerDir | None = None,
                 orphan_grace: float = 0.0, sandbox: bool = True, jit_cache_mib: int = 0) -> None:
        self.worker = worker
        self.sandbox = sandbox  # False: workers run without Landlock (`worker_sandbox`)
        self.cache_dir = cache_dir
        self.jit_cache_mib = jit_cache_mib  # the driver's PTX JIT cache (`jit_cache_mib`)
        self.tls = tls  # the remoting port's TLS files, given to every worker
        # Sessions outlive this daemon by up to `orphan_grace` seconds, adoptable through
        # sockets in `workers_dir` (worker/adopt.c); None or 0: they end with it.
        self.workers_dir = workers_dir
        self.adopt_dir = workers_dir.path if workers_dir is not None else None
        self.orphan_grace = orphan_grace
        self.on_stats = on_stats
        # CUDA IPC between the workers of one job (issue 37): set by the daemon once the pool
        # exists (gpupoold/app.py); None: the workers' IPC requests are refused.
        self.ipc: ipc_broker.IpcBroker | None = None
        # Server-to-server links of spread leases (issue 37, item 3; remoting/peer_links.py),
        # likewise.
        self.peer_links: PeerLinkBroker | None = None
        self.peer_requests = 0  # link requests of all workers being answered
        self._workers: set[Worker] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    @property
    def workers(self) -> list[Worker]:
        """The workers not reaped yet."""
        return sorted(self._workers, key=lambda w: w.pid)

    def argv(self, gpu: Gpu, control_fd: int) -> list[str]:
        assert self.worker is not None
        argv = [str(self.worker), "--control-fd", str(control_fd), "--driver", gpu.driver,
                "--device", str(gpu.ordinal), "--cache-dir", str(self.cache_dir)]
        if gpu.simulated:
            argv.append("--simulated")
        for folder in gpu.writable:
            argv += ["--sandbox-rw", folder]
        for path in gpu.readable:
            argv += ["--sandbox-ro", path]
        if not self.sandbox:
            argv.append("--no-sandbox")
        if self.tls is not None:
            argv += self.tls.argv()
        if self.adopt_dir is not None and self.orphan_grace > 0:
            argv += ["--adopt-dir", str(self.adopt_dir), "--orphan-grace", f"{self.orphan_grace:g}"]
        return argv

    def environment(self, gpu: Gpu) -> dict[str, str]:
        """A worker's environment: the driver's (gpu/environment.py) with the shared JIT cache."""
        return with_jit_cache(driver_environment(gpu), self.cache_dir, self.jit_cache_mib)

    async def spawn(self, gpu: Gpu, timeout: float = 60.0) -> Worker:
        """Start a worker on `gpu` and return it once it is `ready` (device set up, waiting for
        a session). WorkerStartError (with a message for the log and the client) otherwise."""
        if self._closing:
            raise WorkerStartError("the server is shutting down")
        if self.worker is None:
            raise WorkerStartError("this server has no gpupool-worker binary (set `worker`)")
        if not gpu.driver:
            raise WorkerStartError(f"GPU {gpu.index} has no driver library: the simulated device "
                                   "library was not found (set `sim_lib`)")
        spawned = time.monotonic()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out_r, out_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        os.set_blocking(out_w, True)  # the worker's end: its writes block, never fail EAGAIN
        try:
            ours.setblocking(False)
            # Popen, not asyncio's subprocess: the worker may outlive this daemon (module doc of
            # workers/process.py).
            popen = subprocess.Popen(
                self.argv(gpu, theirs.fileno()), pass_fds=(theirs.fileno(),),
                env=self.environment(gpu), stdin=subprocess.DEVNULL, stdout=out_w,
                stderr=out_w)
        except OSError as exc:
            ours.close()
            os.close(out_r)
            raise WorkerStartError(f"cannot start {self.worker}: {exc.strerror or exc}") from exc
        finally:
            theirs.close()
            os.close(out_w)
        worker = Worker(self, gpu, WorkerProcess(popen.pid, popen), ours, out_r, spawned)
        self._follow(worker)
        worker._start()
        try:
            await asyncio.wait_for(asyncio.shield(worker._ready), timeout)
        except TimeoutError:
            worker.kill()
            raise WorkerStartError(f"the worker for GPU {gpu.index} was not ready within "
                                   f"{timeout:g} s (the driver may hang: check the GPU with "
                                   "nvidia-smi)") from None
        except WorkerStartError:
            # It exits by itself after `failed`; the caller gets the error once it is reaped.
            await asyncio.wait([worker.exited], timeout=DRAIN_TIMEOUT)
            if not worker.exited.done():
                worker.kill()
                await asyncio.wait([worker.exited])
            raise
        except asyncio.CancelledError:
            worker.kill()
            raise
        log.info("[GPU %d prestart] worker pid %d ready on %s in %.1f ms (set-up %.1f ms)",
                 gpu.index, worker.pid, worker.device, worker.spawn_ms, worker.init_ms)
        return worker

    @staticmethod
    async def connect_adoption(path: Path) -> tuple[socket.socket, int]:
        """Connect to the adoption socket at `path` (worker/adopt.c): the connection and the
        listening worker's pid. AdoptError when nobody listens there (the worker is gone)."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, str(path))
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize("3i"))
        except OSError as exc:
            sock.close()
            raise AdoptError(f"no worker listens on {path} ({exc.strerror or exc})") from None
        return sock, struct.unpack("3i", creds)[0]

    async def adopt(self, gpu: Gpu, sock: socket.socket, pid: int,
                    max_wait: float = 3600.0) -> Worker:
        """Adopt the worker `pid` on its adoption connection `sock` (connect_adoption): a
        session of an earlier gpupoold. Returns it once it has answered ADOPT with `adopted`
        (session id, uuid, request and counters set), which may take as long as the call it is
        busy with, up to `max_wait` seconds; AdoptError if the worker refuses, ends, does not
        answer in time or speaks a control version we do not know (it is ended then, and gone
        when this returns)."""
        out_r, out_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        os.set_blocking(out_w, True)
        worker = Worker(self, gpu, WorkerProcess(pid), sock, out_r, time.monotonic())
        self._follow(worker)
        worker._ready.set_result(None)
        worker._start()
        try:
            await worker._send(control.encode(gp.WorkerAdopt(
                control=gp.GP_WORKER_CONTROL_VERSION, daemon_pid=os.getpid(), flags=0)), [out_w])
        except OSError as exc:
            worker.kill()
            await asyncio.shield(worker.exited)
            raise AdoptError(f"worker pid {pid}: {exc.strerror or exc}") from None
        finally:
            os.close(out_w)
        waited = 0.0
        while True:
            done, _ = await asyncio.wait([worker._adopted, worker.exited],
                                         timeout=ADOPT_NOTICE_EVERY,
                                         return_when=asyncio.FIRST_COMPLETED)
            if worker._adopted.done():
                break
            if worker.exited.done():
                raise AdoptError(f"worker pid {pid} ended before answering "
                                 f"({worker.exited.result().detail})")
            waited += ADOPT_NOTICE_EVERY
            if waited >= max_wait:
                worker.kill()
                await asyncio.shield(worker.exited)
                raise AdoptError(f"worker pid {pid} did not answer its adoption within "
                                 f"{max_wait:g} s (stuck in one driver call?); it was killed")
            log.warning("[GPU %d] still waiting for worker pid %d to answer its adoption "
                        "(%.0f s; busy in a long call?)", gpu.index, pid, waited)
        try:
            ev = worker._adopted.result()
        except AdoptError:
            await self.retire(worker)
            raise
        if ev.control not in control.CONTROL_VERSIONS:
            await self.retire(worker)
            raise AdoptError(f"worker pid {pid} speaks control version {ev.control}; this "
                             f"gpupoold knows {sorted(control.CONTROL_VERSIONS)}")
        worker._started.set_result(True)
        worker.adoptable = True
        return worker

    def _follow(self, worker: Worker) -> None:
        self._workers.add(worker)
        if self.workers_dir is not None:
            self.workers_dir.note_pid(worker.pid, worker.gpu.index)

    def _reaped(self, worker: Worker) -> None:
        """The worker's process is gone (not merely detached: a detached worker keeps its pid
        file for the next gpupoold)."""
        self._workers.discard(worker)
        if self.workers_dir is not None:
            self.workers_dir.forget_pid(worker.pid)

    # ---------------------------------------------- what workers leave under state_dir/workers
    def prepare_workers_dir(self, adoptable: bool) -> None:
        if self.workers_dir is not None:
            self.workers_dir.prepare(adoptable)

    def adoption_socket(self, lease_id: int) -> Path | None:
        return self.workers_dir.socket(lease_id) if self.workers_dir is not None else None

    def end_record(self, lease_id: int) -> gp.WorkerEnded | None:
        return self.workers_dir.end_record(lease_id) if self.workers_dir is not None else None

    def forget_lease(self, lease_id: int) -> None:
        if self.workers_dir is not None:
            self.workers_dir.forget_lease(lease_id)

    def kill_orphans(self, keep: set[int]) -> None:
        """Kill the workers a previous gpupoold left running, except `keep` (blocking: run it
        in a thread)."""
        if self.workers_dir is not None:
            self.workers_dir.kill_orphans(keep)

    async def retire(self, worker: Worker) -> None:
        """End a worker we will not keep: END, then SIGKILL after the grace; until reaped."""
        await worker.end("the gpupool server could not take over this session after a "
                         "restart; run the program again", gp.GP_EREFUSED)
        try:
            await asyncio.wait_for(asyncio.shield(worker.exited), RETIRE_GRACE)
        except TimeoutError:
            worker.kill()
            await asyncio.shield(worker.exited)

    async def stop_all(self, grace: float, keep: frozenset[Worker] = frozenset()) -> None:
        """SIGTERM every worker but `keep`, SIGKILL the ones still there after `grace` seconds,
        reap all."""
        self._closing = True
        workers = [w for w in self._workers if not w.exited.done() and w not in keep
                   and not w.detached]
        if workers:
            log.info("stopping %d worker(s)", len(workers))
            for w in workers:
                w.terminate()
            _, pending = await asyncio.wait([w.exited for w in workers], timeout=grace)
            if pending:
                log.warning("%d worker(s) still running after %.1f s: SIGKILL", len(pending),
                            grace)
                for w in workers:
                    if not w.exited.done():
                        w.kill()
                await asyncio.wait(pending)
        tasks = {t for t in self._tasks if not t.done()}
        if tasks:
            await asyncio.wait(tasks)
