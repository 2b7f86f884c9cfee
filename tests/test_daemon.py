"""gpupoold end to end: the remoting handshake, the queue, worker supervision, start-up and
shutdown. In-process tests run the app factory with a fake worker (tests/fake_worker.py) and a
fake scrub tool, without authentication (`auth = none`; tokens are tested in test_e2e_leases.py);
the subprocess tests run `python -m gpupoold serve` as users do, and the last one the real
worker."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import gpupool_protocol as gp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from conftest import REPO, GpupoolServer, daemon_env, require
from gpupool.wire.frames import read_frame

from gpupoold.app import StartupError, create_app
from gpupoold.config.settings import Settings
from gpupoold.gpu.inventory import Gpu
from gpupoold.http.keys import COUNTERS, INVENTORY, REMOTING, SUPERVISOR

FAKE_WORKER = REPO / "tests" / "fake_worker.py"


# ------------------------------------------------------------------------------------ helpers
def hello(**changes: object) -> gp.Hello:
    msg = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=4242, host="laptop",
                   user="ada", program="pytest-client", token="", gpu="", model="",
                   min_memory=0,
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
    """An executable that runs tests/fake_worker.py in `mode` with the worker's arguments, with
    a fake `gpupool-scrub` beside it (the daemon looks for the scrub tool next to the worker)."""
    folder = tmp_path / f"fake-{mode}"
    folder.mkdir(exist_ok=True)
    path = folder / "gpupool-worker"
    path.write_text(f'#!/bin/sh\nPYTHONPATH="{REPO}/protocol/python" exec "{sys.executable}" '
                    f'"{FAKE_WORKER}" {mode} "$@"\n')
    path.chmod(0o755)
    scrub = folder / "gpupool-scrub"
    scrub.write_text('#!/bin/sh\necho \'{"ok": true, "bytes": 4096, "allocations": 1, '
                     '"free_before": 4096, "total": 4096, "samples": 1, "duration_s": 0.001, '
                     '"init_s": 0.001}\'\n')
    scrub.chmod(0o755)
    return path


def settings_for(tmp_path: Path, mode: str = "serve", **changes: object) -> Settings:
    sim_lib = tmp_path / "libfake-sim.so"
    sim_lib.touch()
    base = Settings(listen="127.0.0.1:0", http="127.0.0.1:0", state_dir=tmp_path / "state",
                    simulated=1, worker=fake_worker(tmp_path, mode), sim_lib=sim_lib,
                    stop_grace=2.0, auth="none",
                    # plain TCP, said explicitly: these tests speak the protocol on raw sockets
                    # (TLS on the remoting port is tested in test_remoting_tls.py, test_trust.py)
                    tls="off")
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

    async def wait_leases(self, count: int, timeout: float = 10) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            leases = (await self.get("/api/v1/leases?state=active"))["leases"]
            if len(leases) == count:
                return leases
            assert time.monotonic() < deadline, f"{len(leases)} leases, wanted {count}"
            await asyncio.sleep(0.02)

    async def wait_free(self, timeout: float = 10, ready: bool = True) -> list[dict]:
        """Every GPU free (scrubbed) and, with `ready`, its pre-started worker up."""
        deadline = time.monotonic() + timeout
        while True:
            gpus = (await self.get("/api/v1/gpus"))["gpus"]
            if all(g["state"] == "free" and (g["worker_ready"] or not ready) for g in gpus):
                return gpus
            assert time.monotonic() < deadline, f"GPUs not free: {gpus}"
            await asyncio.sleep(0.02)


async def start_app(settings: Settings, ready: bool = True) -> AsyncIterator[Daemon]:
    async with TestClient(TestServer(create_app(settings))) as client:
        d = Daemon(client)
        await d.wait_free(ready=ready)
        yield d


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    async for d in start_app(settings_for(tmp_path)):
        yield d


@pytest.fixture
def make_daemon(tmp_path: Path) -> Callable[..., AsyncIterator[Daemon]]:
    def make(mode: str = "serve", ready: bool = True, **changes: object) -> AsyncIterator[Daemon]:
        return start_app(settings_for(tmp_path, mode, **changes), ready=ready)
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
     [f"client speaks protocol 2.3, this server speaks {gp.MAJOR}.{gp.MINOR}",
      "upgrade gpupoold"]),
    ({"major": 0, "minor": 9}, gp.GP_EVERSION,
     [f"client speaks protocol 0.9, this server speaks {gp.MAJOR}.{gp.MINOR}",
      "upgrade the gpupool client"]),
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
    assert (await daemon.get("/api/v1/leases?state=all"))["leases"] == []


async def test_other_major_with_a_different_hello_layout_still_gets_the_version_error(
        daemon: Daemon) -> None:
    client = await RawClient.connect(daemon.address)
    body = struct.pack("<IHH", gp.MAGIC, 3, 0) + b"whatever version 3 sends"
    await client.send(frame(gp.Hello.OP, body, req=99))
    reply = await client.recv()
    assert reply.req == 99
    decoded = gp.HelloReply.decode(reply.body)
    assert decoded.result == gp.GP_EVERSION and "protocol 3.0" in decoded.message


async def test_newer_minor_with_unknown_fields_is_served(daemon: Daemon) -> None:
    """A client of a newer minor version appends hello fields this server does not know: they
    are skipped and the client is served (docs/protocol.md, "Versioning")."""
    client = await RawClient.connect(daemon.address)
    body = hello(minor=gp.MINOR + 1).encode() + b"\x01\x02\x03\x04"
    await client.send(frame(gp.Hello.OP, body))
    decoded = gp.HelloReply.decode((await client.recv()).body)
    assert decoded.result == 0 and (decoded.major, decoded.minor) == (gp.MAJOR, gp.MINOR)
    assert decoded.server == "fake-worker"


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


async def test_info_is_answered_by_the_daemon_and_never_reaches_a_worker(daemon: Daemon) -> None:
    before = (await daemon.get("/api/v1/gpus"))["gpus"]
    counters = daemon.app[COUNTERS]
    client = await RawClient.connect(daemon.address)
    await client.send(gp.encode_frame(gp.Info(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR,
                                              host="laptop"), 5))
    got = await client.recv()
    assert (got.op, got.flags, got.req) == (gp.Info.OP, gp.FLAG_REPLY, 5)
    reply = gp.InfoReply.decode(got.body)
    assert (reply.result, reply.gpus, reply.matching, reply.free_matching, reply.queue) == \
        (0, 1, 1, 1, 0)
    assert (reply.you_name, reply.you_role, reply.lease_views) == ("anonymous", "admin", [])
    assert await client.closed_by_server()
    # The pre-started worker was not used: no lease, the same worker still waiting.
    after = (await daemon.get("/api/v1/gpus"))["gpus"]
    assert [(g["state"], g["lease"], g["worker_ready"]) for g in after] == [("free", None, True)]
    assert after[0]["since"] == before[0]["since"]
    assert len(daemon.app[SUPERVISOR].workers) == 1
    assert counters.get("info_requests", result="ok") == 1
    assert counters.total("handshakes_refused") == 0 and counters.get("leases_started") == 0
    await assert_still_serving(daemon)


async def test_an_info_reply_is_not_an_info(daemon: Daemon) -> None:
    client = await RawClient.connect(daemon.address)
    await client.send(frame(gp.Info.OP, gp.InfoReply().encode(), flags=gp.FLAG_REPLY))
    notice = await client.recv()
    assert notice.op == gp.Notice.OP
    assert "must be hello (op 1) or info (op 6)" in gp.Notice.decode(notice.body).text
    assert await client.closed_by_server()
    assert daemon.app[COUNTERS].get("info_requests", result="ok") == 0


async def test_gpu_views_carry_the_pci_bus_id_and_live_values(daemon: Daemon) -> None:
    gpu = (await daemon.get("/api/v1/gpus"))["gpus"][0]
    assert gpu["pci_bus_id"] == daemon.app[INVENTORY].gpus[0].pci_bus_id != ""
    assert gpu["live"]["memory_total"] == gpu["memory_total"]
    assert (gpu["live"]["memory_used"], gpu["live"]["cuda_driver_version"]) == (0, 13000)
    assert (await daemon.get("/api/v1/gpus/0"))["pci_bus_id"] == gpu["pci_bus_id"]


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


@pytest.mark.parametrize(("change", "words"), [
    ({"model": "A100"}, "its name does not contain 'A100'"),
    ({"gpu": "3"}, "not GPU 3"),
    ({"min_memory": 1 << 50}, "less than 1024 TiB"),
])
async def test_requirements_nobody_meets_are_refused(daemon: Daemon, change: dict,
                                                     words: str) -> None:
    client = await RawClient.connect(daemon.address)
    reply = await client.hello(hello(**change))
    assert reply.result == gp.GP_EREFUSED and "no GPU on this server meets" in reply.message
    assert words in reply.message


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
    assert body["remoting"] == daemon.address and body["gpus"] == 1 and body["leases"] == 0


async def test_gpus_are_labelled_simulated(make_daemon) -> None:
    async for d in make_daemon(simulated=2):
        gpus = (await d.get("/api/v1/gpus"))["gpus"]
        assert [g["index"] for g in gpus] == [0, 1]
        for g in gpus:
            assert g["simulated"] is True and "simulated" in g["name"]
            assert g["uuid"].startswith("GPU-") and g["lease"] is None
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
async def test_lease_goes_through_the_prestarted_worker(daemon: Daemon,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    (gpu,) = await daemon.wait_free()
    client = await RawClient.connect(daemon.address)
    reply = await client.hello(req=1234)
    assert reply.result == 0 and reply.server == "fake-worker"  # answered by the worker
    assert reply.session_id == 1 and reply.simulated == 1
    # The rest of the stream is between client and worker: a ping round trip.
    await client.send(gp.encode_frame(gp.Ping(token=0xABCDEF), 55))
    pong = await client.recv()
    assert pong.req == 55 and gp.PingReply.decode(pong.body).token == 0xABCDEF

    (lease,) = await daemon.wait_leases(1)
    assert lease["id"] == 1 and lease["gpu"] == 0 and lease["worker_pid"] > 0
    assert lease["client"]["host"] == "laptop" and lease["client"]["pid"] == 4242
    assert lease["token"] == "anonymous"
    gpus = (await daemon.get("/api/v1/gpus"))["gpus"]
    assert gpus[0]["state"] == "leased" and gpus[0]["lease"]["id"] == 1

    await client.send(gp.encode_frame(gp.Goodbye()))
    assert await client.closed_by_server()
    await daemon.wait_leases(0)
    wait_gone(lease["worker_pid"])
    await daemon.wait_free()
    record = await daemon.get("/api/v1/leases/1")
    assert record["end_reason"] == "client exit" and record["scrub_ok"] is True
    text = caplog.text
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in text  # the worker environment
    assert "fake-worker: session 1 hello from ada@laptop" in text
    assert "lease 1 ended (client exit)" in text


async def test_worker_gets_the_contract_arguments(daemon: Daemon, tmp_path: Path) -> None:
    sup = daemon.app[SUPERVISOR]
    gpu = Gpu(index=0, name="x", uuid="", simulated=True, driver="/lib/sim.so", ordinal=0)
    argv = sup.argv(gpu, 12)
    assert argv[1:] == ["--control-fd", "12", "--driver", "/lib/sim.so", "--device", "0",
                        "--cache-dir", str(tmp_path / "state" / "cache"), "--simulated",
                        "--adopt-dir", str(tmp_path / "state" / "workers"),
                        "--orphan-grace", "300"]


async def test_two_gpus_one_client_each_the_third_waits(make_daemon) -> None:
    async for d in make_daemon(simulated=2, queue_notice_interval=0.2):
        clients = []
        for _ in range(2):
            c = await RawClient.connect(d.address)
            assert (await c.hello()).result == 0
            clients.append(c)
        assert sorted(le["gpu"] for le in await d.wait_leases(2)) == [0, 1]
        third = await RawClient.connect(d.address)
        await third.send(gp.encode_frame(hello(pid=3), 9))
        notice = await third.recv()
        assert notice.op == gp.Notice.OP
        text = gp.Notice.decode(notice.body)
        assert text.code == gp.GP_INFO_QUEUED and "position 1 of 1" in text.text
        assert (await d.get("/api/v1/queue"))["queue"][0]["client"]["pid"] == 3
        await clients[0].close()  # client lost: scrubbed, then the third gets GPU 0
        while True:
            frame_ = await third.recv(timeout=20)
            if frame_.op == gp.Hello.OP:
                break
            assert frame_.op == gp.Notice.OP
        assert gp.HelloReply.decode(frame_.body).result == 0
        leases = await d.wait_leases(2)
        assert {le["client"]["pid"] for le in leases} == {3, 4242}
        await clients[1].close()
        await third.close()
        await d.wait_leases(0)


async def test_worker_crash_ends_the_lease_and_the_daemon_keeps_serving(
        make_daemon, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async for d in make_daemon("exit3"):
        client = await RawClient.connect(d.address)
        assert (await client.hello()).result == 0
        assert await client.closed_by_server()
        await d.wait_leases(0)
        await d.wait_free()
        record = await d.get("/api/v1/leases/1")
        assert record["end_reason"] == "worker crashed" and "exit code 3" in record["end_detail"]
        assert (await d.get("/healthz"))["ok"] is True


async def test_worker_setup_failure_is_a_refusal_with_its_reason(
        make_daemon, caplog: pytest.LogCaptureFixture) -> None:
    async for d in make_daemon("noinit", ready=False):
        client = await RawClient.connect(d.address)
        reply = await client.hello()
        assert reply.result == gp.GP_EREFUSED and "the driver is on holiday" in reply.message
        assert await client.closed_by_server()
        assert "could not pre-start a worker" in caplog.text


async def test_worker_that_cannot_start_is_a_refusal(make_daemon, tmp_path: Path) -> None:
    broken = fake_worker(tmp_path, "broken")
    broken.write_text("#!/nonexistent/interpreter\n")  # exec fails with ENOENT
    async for d in make_daemon(worker=broken, ready=False):
        client = await RawClient.connect(d.address)
        reply = await client.hello()
        assert reply.result == gp.GP_EREFUSED and "cannot start" in reply.message
        assert await client.closed_by_server()
        assert (await d.get("/api/v1/leases?state=all"))["leases"] == []


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
        (lease,) = await d.wait_leases(1)
        pid = lease["worker_pid"]
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
    assert proc.returncode == 78  # EX_CONFIG: systemd does not restart it (gpupoold.service)
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


def test_no_driver_is_an_error_that_says_what_was_found(tmp_path: Path) -> None:
    """A GPU server whose driver broke must stop, not lend a simulated GPU: exit 78 (EX_CONFIG,
    systemd does not restart it in a loop) with what real mode found and the fixes."""
    config = tmp_path / "gpupoold.toml"
    config.write_text('driver = "/nonexistent/libcuda.so.1"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "gpupoold", "serve", "--config", str(config), "--state-dir",
         str(tmp_path / "state"), "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"],
        capture_output=True, text=True, env=daemon_env(), timeout=60)
    assert proc.returncode == 78, proc.stderr
    assert "gpupoold: error: no GPU to serve: no driver: the driver library " \
           "/nonexistent/libcuda.so.1 cannot be loaded" in proc.stderr
    assert "Repair the NVIDIA driver" in proc.stderr and "`simulated = N`" in proc.stderr
    assert "SIMULATED" not in proc.stderr


def test_no_driver_falls_back_to_one_simulated_gpu_loudly_when_asked(
        start_daemon, tmp_path: Path) -> None:
    config = tmp_path / "gpupoold.toml"
    config.write_text('driver = "/nonexistent/libcuda.so.1"\nfallback_to_simulated = true\n')
    server = start_daemon("--config", str(config), simulated=None)
    assert "serving 1 SIMULATED GPU instead, as `fallback_to_simulated = true` asks" in \
        server.log_text()
    gpus = server.get_json("/api/v1/gpus")["gpus"]
    assert len(gpus) == 1 and gpus[0]["simulated"] is True
    health = server.get_json("/healthz")
    assert health["simulated"] == 1 and "/nonexistent/libcuda.so.1" in health["fallback"]
    # Every dashboard page says so, the sign-in page included.
    with urllib.request.urlopen(server.http_url + "/ui/login", timeout=10) as reply:
        page = reply.read().decode()
    assert 'id="simulated-fallback"' in page and "/nonexistent/libcuda.so.1" in page


def wait_free_sync(server: GpupoolServer, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not all(g["state"] == "free" and g["worker_ready"]
                  for g in server.get_json("/api/v1/gpus")["gpus"]):
        assert time.monotonic() < deadline, server.get_json("/api/v1/gpus")
        time.sleep(0.02)


def test_sigterm_ends_leases_and_exits_0(start_daemon, tmp_path: Path) -> None:
    sim_lib = tmp_path / "libfake-sim.so"
    sim_lib.touch()
    # plain TCP: the hello below is written on a raw socket
    server: GpupoolServer = start_daemon("--worker", str(fake_worker(tmp_path)),
                                         "--sim-lib", str(sim_lib), native=False, tls=False)
    wait_free_sync(server)
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(gp.encode_frame(hello(token=server.token), 3))
        reply = gp.HelloReply.decode(read_frame(sock).body)
        assert reply.result == 0
        (lease,) = server.get_json("/api/v1/leases?state=active")["leases"]
        state_dir = server.state_dir
        assert server.stop() == 0
        wait_gone(lease["worker_pid"])
        assert sock.recv(1) == b""  # the worker is gone, so is the connection
    log = server.log_text()
    assert "lease 1 ended (daemon stopped" in log
    # The record says so (read the database directly: the daemon is gone).
    from gpupoold.store.database import StoreDB

    db = StoreDB(state_dir / "gpupoold.db")
    try:
        (record,) = db.leases("all")
        assert record.end_reason == "daemon stopped"
    finally:
        db.close()


# ------------------------------------------------------------------------ the real worker (C)
@pytest.mark.san
def test_real_worker_answers_the_hello_with_a_simulated_device(
        plain_server: GpupoolServer) -> None:
    gpupool_server = plain_server  # plain TCP: the hello is written on a raw socket
    worker = gpupool_server.build_dir / "gpupool-worker"
    require(worker.is_file(), f"{worker} not built yet")
    wait_free_sync(gpupool_server)
    with socket.create_connection((gpupool_server.host, gpupool_server.port), timeout=30) as s:
        s.sendall(gp.encode_frame(hello(token=gpupool_server.token), 5))
        answer = read_frame(s)
        assert (answer.op, answer.flags, answer.req) == (gp.Hello.OP, gp.FLAG_REPLY, 5)
        reply = gp.HelloReply.decode(answer.body)
        assert reply.result == 0, reply.message
        assert "simulated" in reply.name.lower() and reply.simulated == 1
        assert reply.session_id == 1 and reply.total_mem == 80 << 30
        (gpu,) = gpupool_server.get_json("/api/v1/gpus")["gpus"]
        assert gpu["name"] == reply.name
        assert gpu["uuid"] == "GPU-" + "-".join(
            reply.uuid.hex()[a:b] for a, b in ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32)))
        (lease,) = gpupool_server.get_json("/api/v1/leases?state=active")["leases"]
        assert lease["client"]["user"] == "ada"
        s.sendall(gp.encode_frame(gp.Goodbye()))
        s.settimeout(30)
        while s.recv(65536):
            pass
    gpupool_server.wait_for_log(r"lease 1 ended \(client exit", timeout=30)
