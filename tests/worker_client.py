"""A small synchronous client that drives one gpupool-worker process directly, for tests.

It plays the daemon's part (spawns the worker with one end of a socketpair and the hello body on
stdin, exactly as gpupoold does) and the client shim's part (frames from the generated protocol).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "protocol" / "python"))

import gpupool_protocol as gp  # noqa: E402
from gpupool.wire.frames import read_exactly  # noqa: E402

# The same choice as tests/conftest.py: $GPUPOOL_BUILD_DIR, else build-asan/ when GPUPOOL_SAN=1.
_SAN = os.environ.get("GPUPOOL_SAN") == "1"
BUILD = (ROOT / os.environ.get("GPUPOOL_BUILD_DIR", "build-asan" if _SAN else "build")).resolve()
WORKER = BUILD / "gpupool-worker"
SIM = BUILD / "libgpupool-sim.so"

PRIMARY_CTX = 0x6750000000000000 | (1 << 40) | 1
DEFAULT_VA_BASE = 0x200000000000
DEFAULT_VA_SIZE = 1 << 40


def next_frame(sock: socket.socket, notices: list[gp.Notice]) -> tuple[int, int, bytes]:
    """(op, req, body) of the next frame from a worker that is not a notice; the notices on the
    way are appended to `notices`."""
    while True:
        length, op, flags, req = gp.HEADER.unpack(read_exactly(sock, gp.HEADER.size))
        body = read_exactly(sock, length)
        if op == gp.Notice.OP and not flags & gp.FLAG_REPLY:
            notices.append(gp.Notice.decode(body))
            continue
        return op, req, body


def handle(kind: int, n: int) -> int:
    """A client-chosen id as the shim makes them (tag | kind << 40 | n)."""
    return 0x6750000000000000 | (kind << 40) | n


class WorkerError(Exception):
    pass


class WorkerSession:
    """One worker process and its connection."""

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        va_base: int = DEFAULT_VA_BASE,
        va_size: int = DEFAULT_VA_SIZE,
        hello: gp.Hello | None = None,
        hello_body: bytes | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
        extra_args: list[str] | None = None,
    ) -> None:
        ours, theirs = socket.socketpair()
        self.sock = ours
        self.sock.settimeout(timeout)
        self.log = tempfile.TemporaryFile()
        self._stderr: str | None = None
        self.notices: list[gp.Notice] = []
        self._next_req = 100
        if hello_body is None:
            hello = hello or gp.Hello(
                magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=os.getpid(),
                host="testhost", user="tester", program="test_worker", token="",
                gpu="", model="", min_memory=0, va_base=va_base, va_size=va_size,
            )
            hello_body = hello.encode()
        cmd = [
            str(WORKER), "--fd", str(theirs.fileno()), "--driver", str(SIM), "--device", "0",
            "--cache-dir", str(cache_dir), "--session-id", "0x1234", "--hello-req", "1",
            "--simulated", *(extra_args or []),
        ]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stderr=self.log, pass_fds=(theirs.fileno(),),
            env={**os.environ, **(env or {})},
        )
        theirs.close()
        assert self.proc.stdin is not None
        self.proc.stdin.write(hello_body)
        self.proc.stdin.close()
        op, req, body = self.recv_frame()
        assert op == gp.Hello.OP and req == 1, (op, req)
        self.hello = gp.HelloReply.decode(body)

    # ---- framing ------------------------------------------------------------------------
    def _read_exact(self, n: int) -> bytes:
        return read_exactly(self.sock, n)

    def recv_frame(self) -> tuple[int, int, bytes]:
        """Next frame that is not a notice (notices are collected in self.notices)."""
        return next_frame(self.sock, self.notices)

    def send(self, msg: object, bulk: bytes = b"", req: int = 0) -> None:
        self.sock.sendall(gp.encode_frame(msg, req) + bulk)

    def post(self, msg: object, bulk: bytes = b"") -> None:
        """A fire-and-forget frame."""
        self.send(msg, bulk)

    def call(self, msg: object, bulk: bytes = b"") -> tuple[object, bytes]:
        """Request and its reply; returns (decoded reply, reply bulk data)."""
        req = self._next_req
        self._next_req += 1
        self.send(msg, bulk, req)
        op, rreq, body = self.recv_frame()
        assert rreq == req and op == msg.OP, (op, rreq, msg)  # type: ignore[attr-defined]
        reply = gp.REPLIES[op].decode(body)
        data = b""
        if isinstance(reply, gp.MemcpyDtohReply) and reply.data:
            data = self._read_exact(reply.data)
        return reply, data

    # ---- conveniences -------------------------------------------------------------------
    def alloc(self, size: int, stream: int = 0) -> gp.MemAllocReply:
        reply, _ = self.call(gp.MemAlloc(size=size, stream=stream, flags=0))
        return reply  # type: ignore[return-value]

    def htod(self, dst: int, data: bytes, stream: int = 0, is_async: int = 0) -> None:
        self.post(gp.MemcpyHtod(dst=dst, stream=stream, is_async=is_async, data=len(data)), data)

    def dtoh(self, src: int, size: int, stream: int = 0, is_async: int = 0) -> tuple[int, bytes]:
        reply, data = self.call(gp.MemcpyDtoh(src=src, size=size, stream=stream, is_async=is_async))
        return reply.result, data  # type: ignore[attr-defined]

    def sync(self) -> int:
        reply, _ = self.call(gp.CtxSynchronize())
        return reply.result  # type: ignore[attr-defined]

    def stats(self) -> gp.StatsReply:
        reply, _ = self.call(gp.Stats())
        return reply  # type: ignore[return-value]

    def close(self, timeout: float = 60.0) -> int:
        """goodbye, then wait for the worker to exit; returns its exit status."""
        try:
            self.send(gp.Goodbye())
        except OSError:
            pass
        return self.wait(timeout)

    def wait(self, timeout: float = 60.0) -> int:
        """Waits for the worker to exit (killing it after timeout); closes our resources."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self.sock.close()
            self._stderr = self.stderr_text()
            self.log.close()
        return rc

    def stderr_text(self) -> str:
        if self._stderr is not None:
            return self._stderr
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


def spawn_raw(args: list[str], stdin: bytes = b"", pass_fds: tuple[int, ...] = ()) -> tuple[int, str]:
    """Runs the worker binary with arbitrary arguments; returns (exit status, stderr)."""
    p = subprocess.run(
        [str(WORKER), *args], input=stdin, capture_output=True, pass_fds=pass_fds, timeout=60,
    )
    return p.returncode, p.stderr.decode(errors="replace")
