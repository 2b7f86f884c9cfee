"""Worker processes: spawn one per session, forward its output to the log, reap it, stop them all.

The worker contract (worker/README.md):
  gpupool-worker --fd N --driver PATH --device ORDINAL --cache-dir DIR --session-id ID
                 --hello-req REQ [--simulated]
with the raw hello body on stdin (then EOF), the client socket as fd N, and GPUPOOL_SIM_CONFIG in
the environment for simulated GPUs. The worker sends the hello reply itself and serves the client
until it leaves. Exit codes: 0 normal, 1 setup failure, 2 usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

from gpupoold.gpus import Gpu
from gpupoold.sessions import Session, SessionRegistry

log = logging.getLogger("gpupoold.workers")
wlog = logging.getLogger("gpupoold.worker")

EXIT_MEANINGS = {0: "normal end", 1: "setup failure", 2: "usage error (daemon/worker mismatch?)"}
OUTPUT_LINE_LIMIT = 1 << 20


class WorkerStartError(Exception):
    """The worker could not be started; the message is for the client and the log."""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code} ({EXIT_MEANINGS.get(code, 'error')})"


class WorkerSupervisor:
    """Owns every worker process: starts them, watches them, and stops them at shutdown."""

    def __init__(self, worker: Path | None, cache_dir: Path, sessions: SessionRegistry) -> None:
        self.worker = worker
        self.cache_dir = cache_dir
        self.sessions = sessions
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self._closing = False

    def argv(self, gpu: Gpu, session: Session, fd: int, hello_req: int) -> list[str]:
        assert self.worker is not None
        argv = [str(self.worker), "--fd", str(fd), "--driver", gpu.driver,
                "--device", str(gpu.ordinal), "--cache-dir", str(self.cache_dir),
                "--session-id", str(session.id), "--hello-req", str(hello_req)]
        if gpu.simulated:
            argv.append("--simulated")
        return argv

    async def start(self, session: Session, gpu: Gpu, fd: int, hello_body: bytes,
                    hello_req: int) -> None:
        """Start the worker of `session` with the client socket `fd` (the caller closes its copy).
        Raises WorkerStartError when it cannot be started."""
        if self._closing:
            raise WorkerStartError("the server is shutting down")
        if self.worker is None:
            raise WorkerStartError("this server has no gpupool-worker binary (set `worker`)")
        if not gpu.driver:
            raise WorkerStartError(f"GPU {gpu.index} has no driver library: the simulated device "
                                   "library was not found (set `sim_lib`)")
        env = dict(os.environ)
        env.update(gpu.env)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv(gpu, session, fd, hello_req), pass_fds=(fd,), env=env,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, limit=OUTPUT_LINE_LIMIT)
        except OSError as exc:
            raise WorkerStartError(f"cannot start {self.worker}: {exc.strerror or exc}") from exc
        session.worker_pid = proc.pid
        self.sessions.add(session)
        self._procs[session.id] = proc
        watcher = asyncio.create_task(self._watch(session, proc), name=f"worker-{session.id}")
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        await self._send_hello(session, proc, hello_body)

    async def _send_hello(self, session: Session, proc: asyncio.subprocess.Process,
                          body: bytes) -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(body)
            await asyncio.wait_for(proc.stdin.drain(), timeout=10)
        except (BrokenPipeError, ConnectionResetError):
            log.warning("session %d: worker exited before reading the hello", session.id)
        except TimeoutError:
            log.warning("session %d: worker did not read the hello within 10 s", session.id)
        finally:
            proc.stdin.close()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                await proc.stdin.wait_closed()

    async def _watch(self, session: Session, proc: asyncio.subprocess.Process) -> None:
        """Forward the worker's output to the log until it exits, then reap it."""
        try:
            assert proc.stdout is not None
            while True:
                try:
                    line = await proc.stdout.readline()
                except ValueError:  # a line longer than the limit: take it in pieces
                    line = await proc.stdout.read(OUTPUT_LINE_LIMIT)
                if not line:
                    break
                wlog.info("[session %d] %s", session.id,
                          line.decode(errors="replace").rstrip("\n"))
            code = await proc.wait()
            level = logging.INFO if code == 0 else logging.WARNING
            log.log(level, "session %d ended: worker pid %d %s", session.id, proc.pid,
                    describe_exit(code))
        except Exception:  # never let a worker take the daemon down
            log.exception("session %d: error while supervising worker pid %d", session.id,
                          proc.pid)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        finally:
            self._procs.pop(session.id, None)
            self.sessions.remove(session.id)

    async def stop_all(self, grace: float) -> None:
        """SIGTERM every worker, SIGKILL the ones still there after `grace` seconds, reap all."""
        self._closing = True
        if not self._procs:
            return
        log.info("stopping %d worker(s)", len(self._procs))
        for proc in list(self._procs.values()):
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        watchers = set(self._watchers)
        pending: set[asyncio.Task[None]] = set()
        if watchers:
            _, pending = await asyncio.wait(watchers, timeout=grace)
        if pending:
            log.warning("%d worker(s) still running after %.1f s: SIGKILL", len(pending), grace)
            for proc in list(self._procs.values()):
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await asyncio.wait(pending)
