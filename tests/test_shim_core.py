"""The client shim's core (client/shim: connection, VA map, handles, contexts, memory, streams,
events), tested without gpupoold:

- the C unit tests of the VA map and the handle table;
- tests/c/shim_scenarios.c (a driver-API client of the shim) against the real worker and the
  simulated device, through tests/tools/mini_server.py (a minimal listener that hands each
  connection to a worker, as the daemon does);
- the same program against a scripted fake server written here, for what a healthy worker never
  does: refusing the session, asking for another VA window, reporting a deferred error, dropping
  the connection, keeping the client in its queue (GP_INFO_QUEUED notices before the hello
  reply). It also checks what the shim puts in its hello (identity, window, the GPU requirements
  from GPUPOOL_GPU / GPUPOOL_GPU_MODEL / GPUPOOL_MIN_MEMORY) and that queued work reaches the
  server without a synchronising call.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, SAN, require, run_client

sys.path.insert(0, str(REPO / "protocol" / "python"))
import gpupool_protocol as gp  # noqa: E402
from gpupool_protocol import HEADER, REPLIES, REQUESTS, encode_frame  # noqa: E402
from gpupool_protocol._generated import (  # noqa: E402
    GP_EAUTH,
    GP_EBUSY,
    GP_EPROTO,
    GP_EREFUSED,
    GP_EVAWINDOW,
    GP_EVERSION,
    GP_INFO_QUEUED,
    MAGIC,
    MAJOR,
    MINOR,
    HelloReply,
    Info,
    InfoReply,
    Notice,
)

VA_BASE = 0x200000000000
VA_SIZE = 1 << 40
OP_GOODBYE, OP_CTX_SYNCHRONIZE, OP_MEM_ALLOC, OP_MEMCPY_HTOD, OP_MEMCPY_DTOH = 2, 13, 20, 22, 23
OP_MEMSET, OP_MODULE_LOAD = 25, 50


# ------------------------------------------------------------------------------------ helpers
def binary(build: Path, name: str) -> Path:
    path = build / "tests" / name
    require(path.is_file(), f"{path} not built")
    return path


def client_env(server: str | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("GPUPOOL_")]:
        env.pop(key)
    env["GPUPOOL_CONFIG"] = "none"  # never the configuration file of whoever runs the tests
    # Plain TCP, said explicitly: tests/tools/mini_server.py and FakeServer below speak the
    # plaintext protocol (the shim's default is TLS with a pinned identity, issue 35).
    env["GPUPOOL_TLS"] = "0"
    if server is not None:
        env["GPUPOOL_SERVER"] = server
    env.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    env.update(extra or {})
    return env


def gpupool_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("gpupool: ")]


def assert_pass(proc: subprocess.CompletedProcess[str], name: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"PASS {name}:" in proc.stdout, out
    for mark in ("AddressSanitizer", "runtime error:", "LeakSanitizer"):
        assert mark not in out, out


# --------------------------------------------------------------------------- unit binaries
@pytest.mark.san
@pytest.mark.parametrize("name", ["test_vamap", "test_handles", "test_requirements"])
def test_unit(native_build: Path, name: str) -> None:
    proc = run_client([binary(native_build, name)], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout


# ------------------------------------------------------------- against the simulated device
@contextlib.contextmanager
def start_mini_server(native_build: Path, tmp_path: Path, *extra: str) -> Iterator[str]:
    """tests/tools/mini_server.py with the build's worker and simulated device; its address."""
    worker, sim = native_build / "gpupool-worker", native_build / "libgpupool-sim.so"
    require(worker.is_file() and sim.is_file(), "needs the worker and the simulated device")
    env = dict(os.environ)
    env.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    log = tmp_path / "mini_server.log"  # the workers log here too: a pipe could fill up
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "tools" / "mini_server.py"), "--worker",
             str(worker), "--driver", str(sim), "--simulated", "--cache-dir",
             str(tmp_path / "cache"), *extra],
            stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL, text=True,
            env=env, start_new_session=True)
    assert proc.stdout is not None
    with proc.stdout:
        line = proc.stdout.readline()
        m = re.match(r"listening on (\S+)", line)
        try:
            assert m, f"mini_server did not start: {line!r}\n{log.read_text()}"
            yield m.group(1)
        finally:
            os.killpg(proc.pid, 9)
            proc.wait()
    err = log.read_text(errors="replace")
    for mark in ("AddressSanitizer", "runtime error:"):
        assert mark not in err, err


@pytest.fixture
def mini_server(native_build: Path, tmp_path: Path) -> Iterator[str]:
    with start_mini_server(native_build, tmp_path) as address:
        yield address


@pytest.mark.san
@pytest.mark.parametrize("scenario", ["basic", "fork", "threads", "noexit-sync"])
def test_scenario_on_simulated_device(native_build: Path, mini_server: str,
                                      scenario: str) -> None:
    proc = run_client([binary(native_build, "shim_scenarios"), scenario],
                      env=client_env(mini_server), timeout=300)
    assert_pass(proc, scenario)
    # nothing unexpected on stderr: at most the one warning about mapped host memory
    lines = [x for x in gpupool_lines(proc.stderr) if "mapped (zero-copy)" not in x]
    assert lines == [], proc.stderr


def queue_texts(n: int, address: str = "gpu-server:7070") -> list[str]:
    """n queue notices as gpupoold words them, each a different position/time."""
    return [f"waiting for a GPU on {address}: position {n - i} of {n} in the queue "
            f"(waited {5 * i} s)" for i in range(n)]


@pytest.mark.san
def test_requirements_and_queue_notices_through_a_worker(native_build: Path,
                                                         tmp_path: Path) -> None:
    """The real worker decodes the new hello, the requirements arrive as set, and the queue
    notices sent before the worker's reply are all printed and never become an error."""
    hello_log = tmp_path / "hellos.jsonl"
    with start_mini_server(native_build, tmp_path, "--hello-log", str(hello_log),
                           "--queue-notices", "3") as address:
        proc = run_client([binary(native_build, "shim_scenarios"), "sync", "1"],
                          env=client_env(address, {"GPUPOOL_GPU": "0",
                                                   "GPUPOOL_GPU_MODEL": "simulated",
                                                   "GPUPOOL_MIN_MEMORY": "1.5GiB"}),
                          timeout=120)
    assert_pass(proc, "sync")
    (hello,) = [json.loads(line) for line in hello_log.read_text().splitlines()]
    assert (hello["gpu"], hello["model"], hello["min_memory"]) == ("0", "simulated", 3 << 29)
    assert hello["program"] == "shim_scenarios sync 1"
    assert gpupool_lines(proc.stderr) == [f"gpupool: {t}" for t in queue_texts(3, address)]


# ------------------------------------------------------------------------ the fake server
class FakeServer:
    """A scripted stand-in for gpupoold + worker. `on_hello(index, hello)` returns the hello
    reply; `before_reply(conn, index, hello)` runs before it goes out (to send notices);
    `on_frame(server, conn, op, req, msg, bulk)` returns True when it handled the frame itself
    (else the default answer goes out). An `info` first frame (a server-selection probe) gets
    `on_info(info)` (default: one free GPU; None: the notice a protocol 1.0 server sends) and the
    connection closes, as gpupoold does."""

    def __init__(self, on_hello: Callable[[int, Any], HelloReply] | None = None,
                 on_frame: Callable[..., bool] | None = None,
                 before_reply: Callable[[socket.socket, int, Any], None] | None = None,
                 on_info: Callable[[Any], Any] | None = None, trim: int = 0) -> None:
        self.on_hello = on_hello or (lambda i, h: snapshot(h))
        self.trim = trim  # the hello reply goes out without its last `trim` bytes (an older server)
        self.on_info = on_info or (lambda info: InfoReply(
            major=1, minor=1, server="fake", gpus=1, matching=1, free_matching=1))
        self.infos: list[Any] = []
        self.on_frame = on_frame
        self.before_reply = before_reply
        self.hellos: list[Any] = []
        self.frames: list[tuple[int, int, Any, float]] = []  # (op, req, msg, arrival)
        self.lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def ops(self) -> list[int]:
        with self.lock:
            return [f[0] for f in self.frames]

    def _accept(self) -> None:
        index = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, index), daemon=True).start()
            index += 1

    @staticmethod
    def _read(conn: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    def _serve(self, conn: socket.socket, index: int) -> None:
        memory: dict[int, bytearray] = {}
        try:
            length, op, _flags, req = HEADER.unpack(self._read(conn, HEADER.size))
            hello = REQUESTS[op].decode(self._read(conn, length))
            if op == Info.OP:
                with self.lock:
                    self.infos.append(hello)
                answer = self.on_info(hello)
                if answer is None:  # a 1.0 server: a notice, then it closes
                    answer, req = Notice(code=GP_EPROTO, text=(
                        "the first frame must be hello (op 1), got op 6")), 0
                conn.sendall(encode_frame(answer, req))
                return
            with self.lock:
                self.hellos.append(hello)
            reply = self.on_hello(index, hello)
            if self.before_reply:
                self.before_reply(conn, index, hello)
            frame = encode_frame(reply, req)
            if self.trim:  # the header's length is the shorter body's
                body = frame[HEADER.size:len(frame) - self.trim]
                frame = HEADER.pack(len(body), *HEADER.unpack(frame[:HEADER.size])[1:]) + body
            conn.sendall(frame)
            if reply.result != 0:
                return
            next_addr = hello.va_base
            while True:
                length, op, _flags, req = HEADER.unpack(self._read(conn, HEADER.size))
                msg = REQUESTS[op].decode(self._read(conn, length))
                bulk = self._read(conn, msg.data) if op in (OP_MEMCPY_HTOD, OP_MODULE_LOAD) else b""
                with self.lock:
                    self.frames.append((op, req, msg, time.monotonic()))
                if self.on_frame and self.on_frame(self, conn, op, req, msg, bulk):
                    continue
                if op == OP_GOODBYE:
                    return
                if op == OP_MEM_ALLOC:
                    dptr = next_addr
                    next_addr += (msg.size + (2 << 20) - 1) // (2 << 20) * (2 << 20)
                    memory[dptr] = bytearray(msg.size)
                    out = REPLIES[op](result=0, dptr=dptr, mapped_size=next_addr - dptr)
                    conn.sendall(encode_frame(out, req))
                elif op == OP_MEMCPY_HTOD:
                    for base, mem in memory.items():
                        if base <= msg.dst < base + len(mem):
                            mem[msg.dst - base:msg.dst - base + len(bulk)] = bulk
                elif op == OP_MEMCPY_DTOH:
                    data = bytes(msg.size)
                    for base, mem in memory.items():
                        if base <= msg.src < base + len(mem):
                            data = bytes(mem[msg.src - base:msg.src - base + msg.size])
                    conn.sendall(encode_frame(REPLIES[op](result=0, data=len(data)), req) + data)
                elif op in REPLIES:
                    conn.sendall(encode_frame(REPLIES[op](result=0), req))
        except (EOFError, OSError):
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


def snapshot(hello: Any, result: int = 0, message: str = "") -> HelloReply:
    attrs = [0] * 140
    for attr, value in {1: 1024, 2: 1024, 3: 1024, 4: 64, 5: 2147483647, 10: 32, 16: 4, 41: 1,
                        75: 9, 76: 0, 83: 1}.items():
        attrs[attr] = value
    return HelloReply(
        result=result, major=1, minor=0, message=message, server="fake", session_id=7,
        simulated=1, name="Fake GPU", uuid=bytes(range(16)), total_mem=1 << 34,
        driver_version=13020, pci_domain=0, pci_bus=0x41, pci_device=0, attributes=attrs,
        limits=[1024, 1 << 20, 8 << 20], stream_priority_least=0, stream_priority_greatest=-5,
        granularity=2 << 20, va_base=hello.va_base, va_size=hello.va_size)


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeServer]]:
    servers: list[FakeServer] = []

    def make(**kw: Any) -> FakeServer:
        server = FakeServer(**kw)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


def run_scenario(build: Path, server: str | None, *args: str,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_client([binary(build, "shim_scenarios"), *args], env=client_env(server, env),
                      timeout=60)


@pytest.mark.san
def test_hello_carries_identity_and_window(native_build: Path, fake: Callable[..., FakeServer],
                                           ) -> None:
    server = fake()
    proc = run_scenario(native_build, server.address, "noexit-sync",
                        env={"GPUPOOL_TOKEN": "s3cret", "GPUPOOL_GPU": "GPU-1234",
                             "GPUPOOL_GPU_MODEL": "A100", "GPUPOOL_MIN_MEMORY": "40GB"})
    assert_pass(proc, "noexit-sync")
    (hello,) = server.hellos
    assert hello.magic == MAGIC and hello.major == 1
    assert hello.token == "s3cret"
    assert (hello.gpu, hello.model, hello.min_memory) == ("GPU-1234", "A100", 40 * 10**9)
    assert hello.program == "shim_scenarios noexit-sync"
    assert hello.va_base == VA_BASE and hello.va_size == VA_SIZE
    assert hello.pid > 0 and hello.host and hello.user
    # every queued memset went out before the goodbye, and the goodbye came last
    ops = server.ops()
    deadline = time.monotonic() + 5
    while OP_GOODBYE not in ops and time.monotonic() < deadline:
        time.sleep(0.02)
        ops = server.ops()
    assert ops.count(OP_MEMSET) == 1000
    assert ops[-1] == OP_GOODBYE


@pytest.mark.san
@pytest.mark.parametrize(("env", "gpu", "model", "min_memory"), [
    ({}, "", "", 0),
    ({"GPUPOOL_GPU": "1"}, "1", "", 0),
    ({"GPUPOOL_DEVICE": "GPU-8f3a"}, "GPU-8f3a", "", 0),           # the old name
    ({"GPUPOOL_GPU": "2", "GPUPOOL_DEVICE": "3"}, "2", "", 0),     # the new name wins
    ({"GPUPOOL_GPU_MODEL": " h100 80GB "}, "", "h100 80GB", 0),    # trimmed, case kept
    ({"GPUPOOL_MIN_MEMORY": "40G"}, "", "", 40 * 10**9),
    ({"GPUPOOL_MIN_MEMORY": "40GB"}, "", "", 40 * 10**9),
    ({"GPUPOOL_MIN_MEMORY": "40GiB"}, "", "", 40 << 30),
    ({"GPUPOOL_MIN_MEMORY": "512M"}, "", "", 512 * 10**6),
    ({"GPUPOOL_MIN_MEMORY": "17179869184"}, "", "", 17179869184),
    ({"GPUPOOL_MIN_MEMORY": "0"}, "", "", 0),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_requirements_from_the_environment(native_build: Path, fake: Callable[..., FakeServer],
                                           env: dict[str, str], gpu: str, model: str,
                                           min_memory: int) -> None:
    server = fake()
    proc = run_scenario(native_build, server.address, "sync", env=env)
    assert_pass(proc, "sync")
    (hello,) = server.hellos
    assert (hello.gpu, hello.model, hello.min_memory) == (gpu, model, min_memory)
    notes = [x for x in gpupool_lines(proc.stderr) if "GPUPOOL_DEVICE=3 ignored" not in x]
    assert notes == [], proc.stderr


@pytest.mark.parametrize(("env", "gpus", "memory"), [
    ({}, 1, 0),                                                    # one whole GPU, as before 1.6
    ({"GPUPOOL_GPUS": "4", "GPUPOOL_MEMORY": "8GiB"}, 4, 8 << 30),
])
def test_hello_asks_for_gpus_and_memory(native_build: Path, fake: Callable[..., FakeServer],
                                        env: dict[str, str], gpus: int, memory: int) -> None:
    """The hello's gpus (issue 37) and memory (issue 32), protocol 1.6."""
    server = fake()
    proc = run_scenario(native_build, server.address, "sync", env=env)
    assert_pass(proc, "sync")
    (hello,) = server.hellos
    assert (hello.gpus, hello.memory) == (gpus, memory)


# An older server's hello reply is shorter: a 1.3 server's ends before redirect_fingerprint (its
# empty string: 4 bytes), 1.6's device_count, memory_quota (12) and 1.8's spread_group and empty
# redirect_parts (12); a 1.4-1.5 server's before 1.6's and 1.8's (24); a 1.6-1.7 server's before
# 1.8's (12). The shim reads the missing fields as 0 and runs as it did (connect_hello.c pads).
@pytest.mark.parametrize(("minor", "trim", "works"), [
    (3, 28, True), (5, 24, True), (7, 12, True),
    (6, 24, False),  # a 1.6 server's reply that short is broken, not older
])
def test_an_older_servers_shorter_hello_reply(native_build: Path, fake: Callable[..., FakeServer],
                                              minor: int, trim: int, works: bool) -> None:
    def reply(_: int, hello: Any) -> HelloReply:
        r = snapshot(hello)
        r.minor = minor
        return r

    server = fake(on_hello=reply, trim=trim)
    proc = run_scenario(native_build, server.address, "sync")
    if works:
        assert_pass(proc, "sync")
        assert gpupool_lines(proc.stderr) == [], proc.stderr
    else:
        assert proc.returncode != 0
        assert f"gpupool: server {server.address} refused the session: malformed hello reply " \
            "(client and server versions differ?)" in proc.stderr, proc.stderr


@pytest.mark.san
@pytest.mark.parametrize(("name", "value", "words"), [
    ("GPUPOOL_MIN_MEMORY", "40X", "GPUPOOL_MIN_MEMORY=40X is not a size"),
    ("GPUPOOL_MIN_MEMORY", "-1G", "GPUPOOL_MIN_MEMORY=-1G is not a size"),
    ("GPUPOOL_MIN_MEMORY", "99999999999999999999", "is not a size"),
    ("GPUPOOL_GPUS", "0", "GPUPOOL_GPUS=0 is not a number of GPUs: write a whole number"),
    ("GPUPOOL_GPU_MODEL", "A" * 300, "GPUPOOL_GPU_MODEL is longer than 255 bytes"),
])
def test_bad_requirement_stops_before_connecting(native_build: Path,
                                                 fake: Callable[..., FakeServer], name: str,
                                                 value: str, words: str) -> None:
    server = fake()
    proc = run_scenario(native_build, server.address, "init-fail", env={name: value})
    assert_pass(proc, "init-fail")
    lines = gpupool_lines(proc.stderr)
    assert len(lines) == 1 and words in lines[0], proc.stderr
    if name == "GPUPOOL_MIN_MEMORY":
        assert "40GiB" in lines[0]  # says what to write instead
    assert server.hellos == []  # never asked the server with a requirement dropped


def send_notices(texts: list[str], code: int = GP_INFO_QUEUED, pause: float = 0.0,
                 ) -> Callable[[socket.socket, int, Any], None]:
    def before_reply(conn: socket.socket, index: int, hello: Any) -> None:
        for text in texts:
            conn.sendall(encode_frame(Notice(code=code, op=0, text=text), 0))
        time.sleep(pause)
    return before_reply


@pytest.mark.san
def test_queue_notices_are_all_printed_and_never_an_error(
        native_build: Path, fake: Callable[..., FakeServer]) -> None:
    """More queue notices than the shim's table of notices already shown (512): every one is
    printed, none becomes the pending error, and the session's own deferred error afterwards is
    still printed (once) and returned."""
    texts = queue_texts(600)
    error = "memset failed on the server: error 1"
    server = fake(before_reply=send_notices(texts), on_frame=notice_on_memset(1, error))
    proc = run_scenario(native_build, server.address, "pending", "1", "0")
    assert_pass(proc, "pending")
    assert gpupool_lines(proc.stderr) == [f"gpupool: {t}" for t in [*texts, error]]


@pytest.mark.san
def test_queue_notice_replaces_the_waiting_line(native_build: Path,
                                                fake: Callable[..., FakeServer]) -> None:
    """A server that said where we are in its queue gets no generic "waiting for server" line
    after 5 s of silence (one that says nothing still does, see below)."""
    texts = queue_texts(1)
    server = fake(before_reply=send_notices(texts, pause=5.5))
    proc = run_scenario(native_build, server.address, "sync")
    assert_pass(proc, "sync")
    assert gpupool_lines(proc.stderr) == [f"gpupool: {texts[0]}"]

    silent = fake(before_reply=send_notices([], pause=5.5))
    proc = run_scenario(native_build, silent.address, "sync")
    assert_pass(proc, "sync")
    lines = gpupool_lines(proc.stderr)
    assert len(lines) == 1 and "waiting for server" in lines[0], proc.stderr


@pytest.mark.san
def test_info_notice_in_session_is_printed_each_time(native_build: Path,
                                                     fake: Callable[..., FakeServer]) -> None:
    """An informational code during the session: printed every time (not deduplicated) and
    never returned by a synchronising call."""
    text = "the server will restart at 18:00; your lease continues"
    server = fake(on_frame=notice_on_memset(GP_INFO_QUEUED, text))
    proc = run_scenario(native_build, server.address, "pending", "0", "0")
    assert_pass(proc, "pending")
    assert gpupool_lines(proc.stderr) == [f"gpupool: {text}"] * 2


@pytest.mark.san
def test_error_notice_before_the_reply_is_not_a_pending_error(
        native_build: Path, fake: Callable[..., FakeServer]) -> None:
    """Before the hello reply no CUDA call has run on the server: even an error notice then is
    printed but never returned by a later call."""
    server = fake(before_reply=send_notices(["the worker restarted"], code=1))
    proc = run_scenario(native_build, server.address, "sync")
    assert_pass(proc, "sync")
    assert gpupool_lines(proc.stderr) == ["gpupool: the worker restarted"]


@pytest.mark.san
def test_concurrent_cuinit_connects_once(native_build: Path, fake: Callable[..., FakeServer],
                                         ) -> None:
    server = fake()
    proc = run_scenario(native_build, server.address, "init-race")
    assert_pass(proc, "init-race")
    assert len(server.hellos) == 1


@pytest.mark.san
def test_cuinit_without_server_setting(native_build: Path) -> None:
    proc = run_scenario(native_build, None, "init-fail")
    assert_pass(proc, "init-fail")
    assert gpupool_lines(proc.stderr) == [
        line for line in gpupool_lines(proc.stderr) if "GPUPOOL_SERVER is not set" in line]
    assert len(gpupool_lines(proc.stderr)) == 1


@pytest.mark.san
def test_cuinit_with_server_down(native_build: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_scenario(native_build, f"127.0.0.1:{port}", "init-fail")
    assert_pass(proc, "init-fail")
    lines = gpupool_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert f"cannot connect to gpupool server 127.0.0.1:{port} (Connection refused)" in lines[0]


@pytest.mark.san
@pytest.mark.parametrize(("code", "message", "shown"), [
    (GP_EAUTH, "unknown token", "unknown token (check GPUPOOL_TOKEN)"),
    (GP_EBUSY, "no GPU became free in 600 s; try again later", None),
    (GP_EREFUSED, "no GPU on this server meets the request (model 'A100')", None),
])
def test_session_refused(native_build: Path, fake: Callable[..., FakeServer], code: int,
                         message: str, shown: str | None) -> None:
    """The server's own text is the reason printed, after the queue notices that came first."""
    texts = queue_texts(2)
    server = fake(on_hello=lambda i, h: snapshot(h, code, message),
                  before_reply=send_notices(texts))
    proc = run_scenario(native_build, server.address, "init-fail")
    assert_pass(proc, "init-fail")
    lines = gpupool_lines(proc.stderr)
    assert lines == [*(f"gpupool: {t}" for t in texts),
                     f"gpupool: server {server.address} refused the session: {shown or message}"
                     ], proc.stderr


@pytest.mark.san
def test_second_server_of_a_list(native_build: Path, fake: Callable[..., FakeServer]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"127.0.0.1:{s.getsockname()[1]}"
    server = fake()
    proc = run_scenario(native_build, f"{down}, {server.address}", "noexit-sync")
    assert_pass(proc, "noexit-sync")
    assert len(server.hellos) == 1
    # Two servers: each is probed with `info` first; the one that is down is skipped, said once.
    assert len(server.infos) == 1
    assert gpupool_lines(proc.stderr) == [f"gpupool: server {down} skipped: connection refused"]


def info(gpus: int = 1, matching: int = 1, free: int = 1, queue: int = 0, result: int = 0,
         message: str = "", major: int = 1) -> Callable[[Any], Any]:
    return lambda _: InfoReply(result=result, major=major, minor=1, message=message,
                               server="fake", gpus=gpus, matching=matching,
                               free_matching=free, queue=queue)


NO_GPU = "none of its 1 GPUs meets the requirements (any GPU)"


@pytest.mark.san
@pytest.mark.parametrize(("first", "second", "chosen", "lines"), [
    (info(free=0), info(), 1, []),                               # the first free, in list order
    (info(), info(), 0, []),
    (info(free=0, queue=3), info(free=0, queue=1), 1, []),      # else the shortest queue
    (info(free=0, queue=2), info(free=0, queue=2), 0, []),      # ties: list order
    (info(free=0, queue=5), info(matching=0), 0, []),           # no matching GPU: never
    (info(matching=0, free=0), info(), 1, []),                  # ... and said at debug level
    (lambda _: None, info(), 1,
     [f"server {{first}} skipped: server speaks protocol 1.0; this client needs {MAJOR}.{MINOR} for info: "
      "upgrade gpupoold"]),
    (info(result=GP_EAUTH, message="unknown token", gpus=0, matching=0, free=0), info(), 1,
     ["server {first} skipped: unknown token (check its token: GPUPOOL_TOKEN or the "
      "configuration file)"]),
    (info(result=GP_EVERSION, major=2, message="upgrade this client"), info(), 1,
     [f"server {{first}} skipped: server speaks protocol 2.1, this client {MAJOR}.{MINOR}: upgrade this "
      "client"]),
    (lambda _: Notice(code=GP_EBUSY, text="this server requires TLS"), info(), 1,
     ["server {first} skipped: this server requires TLS"]),  # its notice, as it said it
    (lambda _: HelloReply(), info(), 1,
     [f"server {{first}} skipped: it does not answer like a gpupool server (protocol {MAJOR}.{MINOR}); is the "
      "port right?"]),
    (info(matching=0), info(matching=0), None,
     ["cannot use any gpupool server ({first}: " + NO_GPU + "; {second}: " + NO_GPU + "). Are "
      "they running? Check GPUPOOL_SERVER and GPUPOOL_TOKEN."]),
])
def test_server_selection_rules(native_build: Path, fake: Callable[..., FakeServer],
                                first: Callable[[Any], Any], second: Callable[[Any], Any],
                                chosen: int | None, lines: list[str]) -> None:
    """Two servers: each is probed with `info`; the choice follows the counts (docs/architecture.md,
    "Server selection"), a failed probe is one warning line, and a hello goes only to
    the chosen server."""
    servers = [fake(on_info=first), fake(on_info=second)]
    names = {"first": servers[0].address, "second": servers[1].address}
    want = [f"gpupool: {line.format(**names)}" for line in lines]
    scenario = "init-fail" if chosen is None else "noexit-sync"
    proc = run_scenario(native_build, f"{servers[0].address},{servers[1].address}", scenario)
    assert_pass(proc, scenario)
    assert gpupool_lines(proc.stderr) == want, proc.stderr
    assert [len(s.infos) for s in servers] == [1, 1]
    assert [len(s.hellos) for s in servers] == [int(chosen == 0), int(chosen == 1)]


@pytest.mark.san
def test_va_window_retry(native_build: Path, fake: Callable[..., FakeServer]) -> None:
    server = fake(on_hello=lambda i, h: snapshot(h, GP_EVAWINDOW, "busy") if i == 0
                  else snapshot(h))
    proc = run_scenario(native_build, server.address, "noexit-sync")
    assert_pass(proc, "noexit-sync")
    assert [h.va_base for h in server.hellos] == [VA_BASE, 0x240000000000]
    assert gpupool_lines(proc.stderr) == []


def notice_on_memset(code: int, text: str) -> Callable[..., bool]:
    def on_frame(server: FakeServer, conn: socket.socket, op: int, req: int, msg: Any,
                 bulk: bytes) -> bool:
        if op == OP_MEMSET:
            conn.sendall(encode_frame(Notice(code=code, op=op, text=text), 0))
            return True
        return False
    return on_frame


@pytest.mark.san
@pytest.mark.parametrize(("code", "sticky"), [(1, 0), (700, 1)])
def test_deferred_error(native_build: Path, fake: Callable[..., FakeServer], code: int,
                        sticky: int) -> None:
    text = f"memset failed on the server: error {code}"
    server = fake(on_frame=notice_on_memset(code, text))
    proc = run_scenario(native_build, server.address, "pending", str(code), str(sticky))
    assert_pass(proc, "pending")
    assert gpupool_lines(proc.stderr) == [f"gpupool: {text}"], proc.stderr  # once


@pytest.mark.san
def test_lost_connection(native_build: Path, fake: Callable[..., FakeServer]) -> None:
    def drop_on_sync(server: FakeServer, conn: socket.socket, op: int, *rest: Any) -> bool:
        if op == OP_CTX_SYNCHRONIZE:
            conn.shutdown(socket.SHUT_RDWR)
            return True
        return False

    server = fake(on_frame=drop_on_sync)
    proc = run_scenario(native_build, server.address, "lost")
    assert_pass(proc, "lost")
    assert gpupool_lines(proc.stderr) == [
        f"gpupool: lost connection to server {server.address} (connection closed by the "
        "server); CUDA calls now fail with CUDA_ERROR_DEVICE_UNAVAILABLE"], proc.stderr


@pytest.mark.san
def test_queued_work_goes_out_without_a_sync(native_build: Path,
                                             fake: Callable[..., FakeServer]) -> None:
    server = fake()
    proc = run_scenario(native_build, server.address, "flush")
    assert_pass(proc, "flush")
    posted = float(re.search(r"posted-at (\S+)", proc.stdout).group(1))  # type: ignore[union-attr]
    arrivals = [t for op, _req, _msg, t in server.frames if op == OP_MEMSET]
    assert len(arrivals) == 1
    # the program idled 500 ms after posting; the flusher sends within ~50 us (generous bound
    # for a loaded machine)
    assert arrivals[0] - posted < 0.25, arrivals[0] - posted


@pytest.mark.skipif(SAN, reason="timings of the plain build only")
def test_bench_prints_numbers(native_build: Path, mini_server: str) -> None:
    proc = run_scenario(native_build, mini_server, "bench")
    assert_pass(proc, "bench")
    assert "sync round trip" in proc.stdout


# ------------------------------------------------------------ our extra CUDA declarations
GP_CUDA_MORE_H = REPO / "client" / "shim" / "gp_cuda_more.h"
CUDA_INCLUDE = Path(os.environ.get("GPUPOOL_CUDA_INCLUDE", "/usr/local/cuda/include"))


def test_gp_cuda_more_matches_cuda_h(tmp_path: Path) -> None:
    """Every constant and layout of client/shim/gp_cuda_more.h as the toolkit's cuda.h has it:
    one probe, compiled against each header, must print the same."""
    require((CUDA_INCLUDE / "cuda.h").is_file(), f"needs the toolkit's cuda.h in {CUDA_INCLUDE}")
    text = re.sub(r"/\*.*?\*/", "", GP_CUDA_MORE_H.read_text(), flags=re.S)
    names = sorted(set(re.findall(r"\b(CU[A-Z0-9_]+|CUDA_ERROR_[A-Z0-9_]+)\s*=", text)))
    assert len(names) > 20
    lines = [f'printf("{n}=%lld\\n", (long long){n});' for n in names]
    for t in ("CUdevprop", "CUctxCreateParams", "CUfunc_cache", "CUsharedconfig",
              "CUstreamCaptureStatus", "CUgreenCtx", "CUlogsCallbackHandle", "CUlogLevel"):
        lines.append(f'printf("sizeof {t}=%zu\\n", sizeof({t}));')
    for m in ("maxThreadsPerBlock", "maxThreadsDim", "maxGridSize", "sharedMemPerBlock",
              "totalConstantMemory", "SIMDWidth", "memPitch", "regsPerBlock", "clockRate",
              "textureAlign"):
        lines.append(f'printf("CUdevprop.{m}=%zu\\n", offsetof(CUdevprop, {m}));')
    for m in ("execAffinityParams", "numExecAffinityParams", "cigParams"):
        lines.append(f'printf("CUctxCreateParams.{m}=%zu\\n", offsetof(CUctxCreateParams, {m}));')
    body = "\n    ".join(lines)
    outputs = []
    for header, inc in (("cuda.h", CUDA_INCLUDE), ("gp_cuda_more.h", GP_CUDA_MORE_H.parent)):
        src = tmp_path / f"probe_{header.replace('.', '_')}.c"
        src.write_text(f"#include <stddef.h>\n#include <stdio.h>\n#include \"{header}\"\n"
                       f"int main(void) {{\n    {body}\n    return 0;\n}}\n")
        exe = tmp_path / src.stem
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-o", str(exe), str(src), f"-I{inc}", f"-I{REPO / 'cudaapi'}"],
                       check=True, capture_output=True, text=True)
        outputs.append(subprocess.run([str(exe)], check=True, capture_output=True,
                                      text=True).stdout)
    assert outputs[0] == outputs[1]


# ------------------------------------------------------------------------- keepalive (no hangs)
def keepalive_reply(index: int, hello: Any) -> HelloReply:
    assert hello.flags & gp.GP_HELLO_KEEPALIVE, "the shim always asks for keepalives"
    reply = snapshot(hello)
    reply.features = gp.GP_HELLO_KEEPALIVE
    return reply


def test_a_silent_server_is_given_up_after_a_keepalive(native_build: Path,
                                                       fake: Callable[..., FakeServer]) -> None:
    """The server promised keepalives, then hangs at a synchronise (answers nothing more, not
    even pings): the shim pings it once the connection has been quiet for a third of
    GPUPOOL_SERVER_TIMEOUT, and fails the call with the reason when the whole timeout passes
    with nothing received. (A server that answers the ping is alive: the call just takes long.)"""
    hung = threading.Event()

    def silent(server: FakeServer, conn: socket.socket, op: int, req: int, msg: Any,
               bulk: bytes) -> bool:
        if op == gp.CtxSynchronize.OP:
            hung.set()
        return hung.is_set()  # swallowed: no reply, ever

    server = fake(on_hello=keepalive_reply, on_frame=silent)
    t0 = time.monotonic()
    proc = run_scenario(native_build, server.address, "sync",
                        env={"GPUPOOL_SERVER_TIMEOUT": "3"})
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert "has not answered for 3 s, not even a keepalive" in proc.stderr, proc.stderr
    assert 2.5 < took < 15, took
    frames = [(op, req) for op, req, _m, _t in server.frames]
    pings = [req for op, req in frames if op == gp.Ping.OP]
    assert pings and set(pings) == {(1 << 64) - 1}, frames  # our keepalive, its own request id


def test_keepalive_notices_keep_a_long_call_alive(native_build: Path,
                                                  fake: Callable[..., FakeServer]) -> None:
    """A synchronise that takes 6 s, with GP_INFO_WORKING notices every half second meanwhile,
    outlives a 3 s timeout (a worker inside a long kernel)."""
    def slow(server: FakeServer, conn: socket.socket, op: int, req: int, msg: Any,
             bulk: bytes) -> bool:
        if op != gp.CtxSynchronize.OP:
            return False
        working = encode_frame(Notice(code=gp.GP_INFO_WORKING, op=0, text=""), 0)
        for _ in range(12):
            time.sleep(0.5)
            conn.sendall(working)
        conn.sendall(encode_frame(REPLIES[op](result=0), req))
        return True

    server = fake(on_hello=keepalive_reply, on_frame=slow)
    proc = run_scenario(native_build, server.address, "sync",
                        env={"GPUPOOL_SERVER_TIMEOUT": "3"})
    assert_pass(proc, "sync")
    assert "not answered" not in proc.stderr and "WORKING" not in proc.stderr


def test_without_the_servers_promise_silence_is_waited_out(native_build: Path,
                                                           fake: Callable[..., FakeServer]) -> None:
    """A server that does not send keepalives (an older one) is never timed out: a 5 s silent
    synchronise with a 3 s timeout still succeeds."""
    def slow(server: FakeServer, conn: socket.socket, op: int, req: int, msg: Any,
             bulk: bytes) -> bool:
        if op != gp.CtxSynchronize.OP:
            return False
        time.sleep(5)
        conn.sendall(encode_frame(REPLIES[op](result=0), req))
        return True

    server = fake(on_frame=slow)
    proc = run_scenario(native_build, server.address, "sync",
                        env={"GPUPOOL_SERVER_TIMEOUT": "3"})
    assert_pass(proc, "sync")


def test_a_servers_words_never_carry_control_characters_to_the_terminal(
        native_build: Path, fake: Callable[..., FakeServer]) -> None:
    """A notice whose text holds an escape sequence (which could rewrite what a terminal shows)
    and a newline is printed with them replaced: one line, no ESC."""
    def hostile(server: FakeServer, conn: socket.socket, op: int, req: int, msg: Any,
                bulk: bytes) -> bool:
        if op != gp.CtxSynchronize.OP:
            return False
        text = "\x1b[2J\x1b]0;owned\x07launch failed\nsecond line\x7f"
        conn.sendall(encode_frame(Notice(code=700, op=gp.Launch.OP, text=text), 0))
        conn.sendall(encode_frame(REPLIES[op](result=0), req))
        return True

    server = fake(on_frame=hostile)
    proc = run_scenario(native_build, server.address, "sync")
    assert "launch failed second line" in proc.stderr, proc.stderr
    assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr and "\x7f" not in proc.stderr
    line = next(ln for ln in proc.stderr.splitlines() if "launch failed" in ln)
    assert line.startswith("gpupool: ?[2J?]0;owned?launch failed"), line
