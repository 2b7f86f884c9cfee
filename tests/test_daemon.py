"""gpupoold end to end: the remoting handshake, the HTTP API, worker supervision, start-up and
shutdown. In-process tests run the app factory with a fake worker (tests/fake_worker.py); the
subprocess tests run `python -m gpupoold serve` as users do, and the last ones the real worker."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import gpupool_protocol as gp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from conftest import REPO, GpupoolServer, daemon_env, require

from gpupoold.app import StartupError, create_app
from gpupoold.gpus import Gpu
from gpupoold.keys import REMOTING, SUPERVISOR
from gpupoold.sessions import Session
from gpupoold.settings import Settings

FAKE_WORKER = REPO / "tests" / "fake_worker.py"


# ------------------------------------------------------------------------------------ helpers
def hello(**changes: object) -> gp.Hello:
    msg = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=4242, host="laptop",
                   user="ada", program="pytest-client", token="", device_request="",
                   va_base=0x200000000000, va_size=1 << 40)
    for key, value in changes.items():
        setattr(msg, key, value)
    return msg


def frame(op: int, body: bytes, req: int = 7, flags: int = 0) -> bytes:
    return gp.HEADER.pack(len(body), op, flags, req) + body


class RawClient:
    """A client speaking the wire protocol by hand, as a misbehaving or foreign client might."""

    opened: list[RawClient] = []  # closed after each test (close_raw_clients)

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        RawClient.opened.append(self)

    @classmethod
    async def connect(cls, address: str) -> RawClient:
        host, _, port = address.rpartition(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self, timeout: float = 10) -> gp.Frame:
        return await asyncio.wait_for(gp.read_frame(self.reader), timeout)

    async def hello(self, msg: gp.Hello | None = None, req: int = 7) -> gp.HelloReply:
        await self.send(gp.encode_frame(msg or hello(), req))
        reply = await self.recv()
        assert (reply.op, reply.flags, reply.req) == (gp.Hello.OP, gp.FLAG_REPLY, req)
        return gp.HelloReply.decode(reply.body)

    async def closed_by_server(self, timeout: float = 10) -> bool:
        return await asyncio.wait_for(self.reader.read(), timeout) == b""

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass


@pytest.fixture(autouse=True)
async def close_raw_clients() -> AsyncIterator[None]:
    yield
    while RawClient.opened:
        await RawClient.opened.pop().close()


def fake_worker(tmp_path: Path, mode: str = "serve") -> Path:
    """An executable that runs tests/fake_worker.py in `mode` with the worker's arguments."""
    path = tmp_path / f"fake-worker-{mode}"
    path.write_text(f'#!/bin/sh\nPYTHONPATH="{REPO}/protocol/python" exec "{sys.executable}" '
                    f'"{FAKE_WORKER}" {mode} "$@"\n')
    path.chmod(0o755)
    return path


def settings_for(tmp_path: Path, mode: str = "serve", **changes: object) -> Settings:
    sim_lib = tmp_path / "libfake-sim.so"
    sim_lib.touch()
    base = Settings(listen="127.0.0.1:0", http="127.0.0.1:0", state_dir=tmp_path / "state",
                    simulated=1, worker=fake_worker(tmp_path, mode), sim_lib=sim_lib,
                    stop_grace=2.0)
    return replace(base, **changes)


class Daemon:
    """An in-process gpupoold app: HTTP through aiohttp's TestClient, remoting on a real port."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.app = client.app
        self.address = self.app[REMOTING].address

    async def get(self, path: str) -> dict:
        resp = await self.client.get(path)
        assert resp.status == 200, await resp.text()
        return await resp.json()

    async def wait_sessions(self, count: int, timeout: float = 10) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            sessions = (await self.get("/api/v1/sessions"))["sessions"]
            if len(sessions) == count:
                return sessions
            assert time.monotonic() < deadline, f"{len(sessions)} sessions, wanted {count}"
            await asyncio.sleep(0.02)


async def start_app(settings: Settings) -> AsyncIterator[Daemon]:
    async with TestClient(TestServer(create_app(settings))) as client:
        yield Daemon(client)


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    async for d in start_app(settings_for(tmp_path)):
        yield d


@pytest.fixture
def make_daemon(tmp_path: Path) -> Callable[..., AsyncIterator[Daemon]]:
    def make(mode: str = "serve", **changes: object) -> AsyncIterator[Daemon]:
        return start_app(settings_for(tmp_path, mode, **changes))
    return make


def wait_gone(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and _state(pid) != "Z":
        assert time.monotonic() < deadline, f"process {pid} still alive"
        time.sleep(0.02)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


# ----------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("change", "result", "words"), [
    ({"magic": 0xDEADBEEF}, gp.GP_EVERSION, ["not a gpupool client", "0xdeadbeef"]),
    ({"major": 2, "minor": 3}, gp.GP_EVERSION,
     ["client speaks protocol 2.3, this server speaks 1.0", "upgrade gpupoold"]),
    ({"major": 0, "minor": 9}, gp.GP_EVERSION,
     ["client speaks protocol 0.9, this server speaks 1.0", "upgrade the gpupool client"]),
])
async def test_hello_refused_with_a_helpful_reply(daemon: Daemon, change: dict, result: int,
                                                  words: list[str]) -> None:
    client = await RawClient.connect(daemon.address)
    reply = await client.hello(hello(**change))
    assert reply.result == result
    assert (reply.major, reply.minor) == (gp.MAJOR, gp.MINOR)
    for w in words:
        assert w in reply.message
    assert "gpupoold" in reply.server
    assert await client.closed_by_server()
    assert (await daemon.get("/api/v1/sessions"))["sessions"] == []


async def test_other_major_with_a_different_hello_layout_still_gets_the_version_error(
        daemon: Daemon) -> None:
    client = await RawClient.connect(daemon.address)
    body = struct.pack("<IHH", gp.MAGIC, 3, 0) + b"whatever version 3 sends"
    await client.send(frame(gp.Hello.OP, body, req=99))
    reply = await client.recv()
    assert reply.req == 99
    decoded = gp.HelloReply.decode(reply.body)
    assert decoded.result == gp.GP_EVERSION and "protocol 3.0" in decoded.message


async def test_newer_minor_with_unknown_fields_is_refused_clearly(daemon: Daemon) -> None:
    client = await RawClient.connect(daemon.address)
    body = hello(minor=gp.MINOR + 1).encode() + b"\x01\x02\x03\x04"
    await client.send(frame(gp.Hello.OP, body))
    decoded = gp.HelloReply.decode((await client.recv()).body)
    assert decoded.result == gp.GP_EVERSION
    assert f"1.{gp.MINOR + 1}" in decoded.message and "upgrade gpupoold" in decoded.message


@pytest.mark.parametrize("body", [
    b"",
    b"\x01\x02",
    hello().encode()[:-3],  # truncated
    hello().encode() + b"\x00",  # trailing byte, same version
])
async def test_malformed_hello_closes_only_that_connection(daemon: Daemon, body: bytes) -> None:
    bad = await RawClient.connect(daemon.address)
    await bad.send(frame(gp.Hello.OP, body))
    decoded = gp.HelloReply.decode((await bad.recv()).body)
    assert decoded.result == gp.GP_EPROTO and "malformed hello" in decoded.message
    assert await bad.closed_by_server()
    await assert_still_serving(daemon)


async def test_first_frame_not_hello_gets_a_notice_and_is_closed(daemon: Daemon) -> None:
    client = await RawClient.connect(daemon.address)
    await client.send(frame(gp.Ping.OP, struct.pack("<Q", 1)))
    notice = await client.recv()
    assert notice.op == gp.Notice.OP and notice.req == 0
    decoded = gp.Notice.decode(notice.body)
    assert decoded.code == gp.GP_EPROTO and "must be hello" in decoded.text
    assert await client.closed_by_server()
    await assert_still_serving(daemon)


async def test_a_hello_reply_is_not_a_hello(daemon: Daemon) -> None:
    client = await RawClient.connect(daemon.address)
    await client.send(frame(gp.Hello.OP, hello().encode(), flags=gp.FLAG_REPLY))
    assert (await client.recv()).op == gp.Notice.OP
    assert await client.closed_by_server()


async def test_oversized_first_frame_is_refused_without_reading_it(daemon: Daemon) -> None:
    client = await RawClient.connect(daemon.address)
    await client.send(gp.HEADER.pack(gp.MAX_BODY, gp.Hello.OP, 0, 1))  # the body never comes
    notice = await client.recv()
    assert gp.Notice.decode(notice.body).code == gp.GP_EPROTO
    assert await client.closed_by_server()
    await assert_still_serving(daemon)


async def test_garbage_and_early_close_do_not_hurt(daemon: Daemon) -> None:
    for data in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\xff" * 7, b""):
        client = await RawClient.connect(daemon.address)
        await client.send(data)
        await client.close()
    await assert_still_serving(daemon)


async def test_silent_client_is_dropped_after_the_handshake_timeout(make_daemon) -> None:
    async for d in make_daemon(handshake_timeout=0.3):
        client = await RawClient.connect(d.address)
        started = time.monotonic()
        assert await client.closed_by_server(timeout=5)
        assert 0.2 < time.monotonic() - started < 4
        await assert_still_serving(d)


async def test_data_sent_before_the_hello_reply_is_refused(daemon: Daemon) -> None:
    client = await RawClient.connect(daemon.address)
    await client.send(gp.encode_frame(hello(), 7) + frame(gp.Ping.OP, struct.pack("<Q", 1), 8))
    decoded = gp.HelloReply.decode((await client.recv()).body)
    assert decoded.result == gp.GP_EPROTO and "before the hello reply" in decoded.message


async def test_unknown_device_request_is_refused(daemon: Daemon) -> None:
    client = await RawClient.connect(daemon.address)
    reply = await client.hello(hello(device_request="A100"))
    assert reply.result == gp.GP_EREFUSED and "no GPU on this server matches" in reply.message


async def assert_still_serving(d: Daemon) -> None:
    """The daemon answers HTTP and still hands a good client to a worker."""
    assert (await d.get("/healthz"))["ok"] is True
    client = await RawClient.connect(d.address)
    reply = await client.hello()
    assert reply.result == 0, reply.message
    await client.send(gp.encode_frame(gp.Goodbye()))
    assert await client.closed_by_server()


# ------------------------------------------------------------------------------------ HTTP API
async def test_healthz(daemon: Daemon) -> None:
    body = await daemon.get("/healthz")
    assert body["ok"] is True and body["version"]
    assert body["remoting"] == daemon.address and body["gpus"] == 1 and body["sessions"] == 0


async def test_gpus_are_labelled_simulated(make_daemon) -> None:
    async for d in make_daemon(simulated=2):
        gpus = (await d.get("/api/v1/gpus"))["gpus"]
        assert [g["index"] for g in gpus] == [0, 1]
        for g in gpus:
            assert g["simulated"] is True and "simulated" in g["name"]
            assert g["uuid"].startswith("GPU-") and g["sessions"] == []
        assert gpus[0]["uuid"] != gpus[1]["uuid"]


async def test_sim_config_files_are_distinct(tmp_path: Path) -> None:
    async for _ in start_app(settings_for(tmp_path, simulated=2)):
        texts = [(tmp_path / "state" / "sim" / f"gpu{i}.conf").read_text() for i in range(2)]
        values = [dict(line.split(" = ", 1) for line in t.splitlines()
                       if line and not line.startswith("#")) for t in texts]
        assert values[0]["uuid"] != values[1]["uuid"] and len(values[0]["uuid"]) == 32
        assert values[0]["pci_bus"] != values[1]["pci_bus"]
        assert "simulated" in values[0]["name"]
        assert int(values[0]["total_memory"]) == 80 << 30


async def test_unknown_route_is_404(daemon: Daemon) -> None:
    assert (await daemon.client.get("/api/v1/nope")).status == 404


# --------------------------------------------------------------------------- workers (fake one)
async def test_session_goes_through_the_worker(daemon: Daemon,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    client = await RawClient.connect(daemon.address)
    reply = await client.hello(req=1234)
    assert reply.result == 0 and reply.server == "fake-worker"  # answered by the worker
    assert reply.session_id == 1 and reply.simulated == 1
    # The rest of the stream is between client and worker: a ping round trip.
    await client.send(gp.encode_frame(gp.Ping(token=0xABCDEF), 55))
    pong = await client.recv()
    assert pong.req == 55 and gp.PingReply.decode(pong.body).token == 0xABCDEF

    (session,) = await daemon.wait_sessions(1)
    assert session["id"] == 1 and session["gpu"] == 0 and session["worker_pid"] > 0
    assert session["client"] == {"host": "laptop", "user": "ada", "pid": 4242,
                                 "program": "pytest-client"}
    gpus = (await daemon.get("/api/v1/gpus"))["gpus"]
    assert gpus[0]["sessions"] == [1]

    await client.send(gp.encode_frame(gp.Goodbye()))
    assert await client.closed_by_server()
    await daemon.wait_sessions(0)
    wait_gone(session["worker_pid"])
    text = caplog.text
    assert "[session 1] fake-worker: session 1 hello from ada@laptop device 0 simulated=1" in text
    assert "[session 1] fake-worker: goodbye" in text
    assert "session 1 ended: worker pid" in text and "exit code 0" in text


async def test_worker_gets_the_contract_arguments(daemon: Daemon, tmp_path: Path) -> None:
    sup = daemon.app[SUPERVISOR]
    gpu = Gpu(index=0, name="x", uuid="", simulated=True, driver="/lib/sim.so", ordinal=0)
    session = Session(id=9, gpu=0, peer="p", client_host="h", client_user="u", client_pid=1,
                      program="p")
    argv = sup.argv(gpu, session, fd=12, hello_req=77)
    assert argv[1:] == ["--fd", "12", "--driver", "/lib/sim.so", "--device", "0",
                        "--cache-dir", str(tmp_path / "state" / "cache"), "--session-id", "9",
                        "--hello-req", "77", "--simulated"]


async def test_two_gpus_get_one_session_each_then_share(make_daemon) -> None:
    async for d in make_daemon(simulated=2):
        clients = []
        for _ in range(3):
            c = await RawClient.connect(d.address)
            assert (await c.hello()).result == 0
            clients.append(c)
        sessions = await d.wait_sessions(3)
        assert [s["gpu"] for s in sessions] == [0, 1, 0]
        for c in clients:
            await c.close()
        await d.wait_sessions(0)


async def test_worker_crash_is_logged_and_the_daemon_keeps_serving(
        make_daemon, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async for d in make_daemon("exit3"):
        client = await RawClient.connect(d.address)
        assert (await client.hello()).result == 0
        assert await client.closed_by_server()
        await d.wait_sessions(0)
        assert "exit code 3" in caplog.text
        assert (await d.get("/healthz"))["ok"] is True


async def test_worker_setup_failure_is_logged(make_daemon,
                                              caplog: pytest.LogCaptureFixture) -> None:
    async for d in make_daemon("noreply"):
        client = await RawClient.connect(d.address)
        await client.send(gp.encode_frame(hello(), 1))
        assert await client.closed_by_server()
        await d.wait_sessions(0)
        assert "exit code 1 (setup failure)" in caplog.text


async def test_worker_that_cannot_start_is_a_refusal(make_daemon, tmp_path: Path) -> None:
    broken = tmp_path / "broken-worker"
    broken.write_text("#!/nonexistent/interpreter\n")  # exec fails with ENOENT
    broken.chmod(0o755)
    async for d in make_daemon(worker=broken):
        client = await RawClient.connect(d.address)
        reply = await client.hello()
        assert reply.result == gp.GP_EREFUSED and "cannot start" in reply.message
        assert await client.closed_by_server()
        assert (await d.get("/api/v1/sessions"))["sessions"] == []


@pytest.mark.parametrize("what", ["missing", "not executable", "a directory"])
async def test_configured_worker_must_be_an_executable_file(tmp_path: Path, what: str) -> None:
    worker = tmp_path / "worker"
    if what == "not executable":
        worker.write_text("#!/bin/sh\n")
    elif what == "a directory":
        worker.mkdir()
    runner = web.AppRunner(create_app(settings_for(tmp_path, worker=worker)))
    with pytest.raises(StartupError, match="setting 'worker': .* is not an existing executable"):
        await runner.setup()
    await runner.cleanup()


async def test_shutdown_kills_a_worker_that_ignores_sigterm(make_daemon) -> None:
    pid = 0
    async for d in make_daemon("stubborn", stop_grace=0.5):
        client = await RawClient.connect(d.address)
        assert (await client.hello()).result == 0
        (session,) = await d.wait_sessions(1)
        pid = session["worker_pid"]
        started = time.monotonic()
    # Leaving the context stopped the app: SIGTERM, 0.5 s grace, SIGKILL.
    assert time.monotonic() - started < 5
    wait_gone(pid)
    assert await client.closed_by_server()


# ----------------------------------------------------------------- the real command (subprocess)
def test_serve_bad_config_stops_startup_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("listen = '127.0.0.1:0'\nworkers = 3\n")
    proc = subprocess.run([sys.executable, "-m", "gpupoold", "serve", "--config", str(config)],
                          capture_output=True, text=True, env=daemon_env(), timeout=60)
    assert proc.returncode == 1
    assert "unknown setting 'workers'" in proc.stderr and str(config) in proc.stderr


def test_version_flag() -> None:
    proc = subprocess.run([sys.executable, "-m", "gpupoold", "--version"], capture_output=True,
                          text=True, env=daemon_env(), timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("gpupoold ")


def test_port_in_use_stops_startup(start_daemon, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "gpupoold", "serve", "--simulated", "1", "--state-dir",
             str(tmp_path), "--listen", f"127.0.0.1:{port}", "--http", "127.0.0.1:0"],
            capture_output=True, text=True, env=daemon_env(), timeout=60)
    assert proc.returncode == 1
    assert "setting 'listen': cannot listen on" in proc.stderr


def test_no_driver_falls_back_to_one_simulated_gpu_loudly(start_daemon, tmp_path: Path) -> None:
    config = tmp_path / "gpupoold.toml"
    config.write_text('driver = "/nonexistent/libcuda.so.1"\n')
    server = start_daemon("--config", str(config), simulated=None)
    assert "serving 1 SIMULATED GPU" in server.log_text()
    gpus = server.get_json("/api/v1/gpus")["gpus"]
    assert len(gpus) == 1 and gpus[0]["simulated"] is True


def test_sigterm_ends_sessions_and_exits_0(start_daemon, tmp_path: Path) -> None:
    sim_lib = tmp_path / "libfake-sim.so"
    sim_lib.touch()
    server: GpupoolServer = start_daemon("--worker", str(fake_worker(tmp_path)),
                                         "--sim-lib", str(sim_lib), native=False)
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(gp.encode_frame(hello(), 3))
        reply = gp.HelloReply.decode(read_frame_sync(sock).body)
        assert reply.result == 0
        (session,) = server.get_json("/api/v1/sessions")["sessions"]
        assert server.stop() == 0
        wait_gone(session["worker_pid"])
        assert sock.recv(1) == b""  # the worker is gone, so is the connection
    log = server.log_text()
    assert "stopping 1 worker(s)" in log and "session 1 ended" in log


def read_frame_sync(sock: socket.socket) -> gp.Frame:
    def exact(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "connection closed"
            data += chunk
        return data
    length, op, flags, req = gp.HEADER.unpack(exact(gp.HEADER.size))
    return gp.Frame(op, flags, req, exact(length))


# ------------------------------------------------------------------------ the real worker (C)
@pytest.mark.san
def test_real_worker_answers_the_hello_with_a_simulated_device(
        gpupool_server: GpupoolServer) -> None:
    worker = gpupool_server.build_dir / "gpupool-worker"
    require(worker.is_file(), f"{worker} not built yet")
    with socket.create_connection((gpupool_server.host, gpupool_server.port), timeout=30) as s:
        s.sendall(gp.encode_frame(hello(), 5))
        answer = read_frame_sync(s)
        assert (answer.op, answer.flags, answer.req) == (gp.Hello.OP, gp.FLAG_REPLY, 5)
        reply = gp.HelloReply.decode(answer.body)
        assert reply.result == 0, reply.message
        assert "simulated" in reply.name.lower() and reply.simulated == 1
        assert reply.session_id == 1 and reply.total_mem == 80 << 30
        (gpu,) = gpupool_server.get_json("/api/v1/gpus")["gpus"]
        assert gpu["name"] == reply.name
        assert gpu["uuid"] == "GPU-" + "-".join(
            reply.uuid.hex()[a:b] for a, b in ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32)))
        (session,) = gpupool_server.get_json("/api/v1/sessions")["sessions"]
        assert session["client"]["user"] == "ada"
        s.sendall(gp.encode_frame(gp.Goodbye()))
        s.settimeout(30)
        while s.recv(65536):
            pass
    gpupool_server.wait_for_log(r"session 1 ended: worker pid \d+ exit code 0", timeout=30)
