"""The `info` request (protocol 1.1, docs/protocol.md "info"): a real gpupoold on simulated GPUs,
asked over a socket with gpupool_protocol, plain and TLS. Leases are held by `Tenant`, a client
that speaks the protocol itself (hello, then driver calls), so the tests do not depend on the
shim; tests/test_telemetry.py uses it too.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gpupool_protocol as gp
import pytest
from conftest import GpupoolServer, tls_connect, wait_until
from gpupool.wire import frames
from gpupool.wire.info import document as client_document
from test_remoting_tls import Pki, pki, tls_daemon  # noqa: F401  (pki is a fixture)

HOST = socket.gethostname()
VA_BASE = 0x200000000000
VA_SIZE = 1 << 40
INFO_REQ = 9
MIB = 1 << 20
GIB = 1 << 30


# ------------------------------------------------------------------------------------ clients
def read_frame(sock: socket.socket) -> tuple[int, int, int, bytes]:
    f = frames.read_frame(sock)
    return f.op, f.flags, f.req, f.body


def info_request(token: str, **changes: Any) -> gp.Info:
    msg = gp.Info(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, flags=0, token=token, gpu="",
                  model="", min_memory=0, host=HOST)
    for key, value in changes.items():
        setattr(msg, key, value)
    return msg


def connect(server: GpupoolServer, tls_ca: Path | None = None) -> socket.socket:
    """A connection to the remoting port: pinned TLS to a daemon with its own identity (the
    default), TLS checked against `tls_ca` for one with an operator's certificate, plain TCP to
    a daemon with `tls = "off"`."""
    if tls_ca is None and server.fingerprint is not None:
        return tls_connect(server, timeout=30)
    sock = socket.create_connection((server.host, server.port), timeout=30)
    if tls_ca is None:
        return sock
    ctx = ssl.create_default_context(cafile=str(tls_ca))
    return ctx.wrap_socket(sock, server_hostname="localhost")


def ask(server: GpupoolServer, request: gp.Info | bytes, tls_ca: Path | None = None,
        ) -> gp.InfoReply:
    """Send one info frame (or raw bytes), read the reply, and check the server then closes."""
    with connect(server, tls_ca) as sock:
        data = request if isinstance(request, bytes) else gp.encode_frame(request, INFO_REQ)
        sock.sendall(data)
        op, flags, req, body = read_frame(sock)
        assert (op, flags, req) == (gp.Info.OP, gp.FLAG_REPLY, INFO_REQ), (op, flags, req, body)
        reply = gp.InfoReply.decode(body)
        assert sock.recv(1) == b"", "the server must close the connection after the reply"
    return reply


def document(reply: gp.InfoReply | Any) -> dict[str, Any]:
    """The reply's records as the `gpupool` command reads them (gpupool.wire.info.document)."""
    if not isinstance(reply, gp.InfoReply):  # InfoCache's pre-encoded reply
        reply = gp.InfoReply.decode(reply.encode())
    assert reply.result == 0, reply
    return client_document(reply)


class Tenant:
    """A client that takes a GPU by speaking the protocol itself: hello, then calls."""

    def __init__(self, server: GpupoolServer, token: str, host: str = HOST,
                 wait: bool = True) -> None:
        self.sock = connect(server)
        self._req = 100
        hello = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=os.getpid(),
                         flags=0, host=host, user="tester", program="test_info", token=token,
                         va_base=VA_BASE, va_size=VA_SIZE)
        self.sock.sendall(gp.encode_frame(hello, 1))
        self.reply: gp.HelloReply | None = None
        if wait:
            self.wait_for_gpu()

    def _frame(self) -> tuple[int, int, bytes]:
        while True:
            op, flags, req, body = read_frame(self.sock)
            if op == gp.Notice.OP and not flags & gp.FLAG_REPLY:
                continue  # queue position, hand-over
            return op, req, body

    def wait_for_gpu(self) -> gp.HelloReply:
        op, req, body = self._frame()
        assert (op, req) == (gp.Hello.OP, 1)
        self.reply = gp.HelloReply.decode(body)
        assert self.reply.result == 0, self.reply.message
        return self.reply

    def call(self, msg: Any) -> Any:
        self._req += 1
        self.sock.sendall(gp.encode_frame(msg, self._req))
        op, req, body = self._frame()
        assert (op, req) == (msg.OP, self._req)
        return gp.REPLIES[op].decode(body)

    def alloc(self, size: int) -> int:
        r = self.call(gp.MemAlloc(size=size, stream=0, flags=0))
        assert r.result == 0, r
        return int(r.dptr)

    def free(self, dptr: int) -> None:
        self.sock.sendall(gp.encode_frame(gp.MemFree(dptr=dptr, stream=0), 0))
        assert self.call(gp.CtxSynchronize()).result == 0

    def close(self) -> None:
        try:
            self.sock.sendall(gp.encode_frame(gp.Goodbye(), 0))
        except OSError:
            pass
        self.sock.close()




def counter(server: GpupoolServer, result: str) -> int:
    counters = server.get_json("/api/v1/status")["counters"]
    return int(counters.get("info_requests", {}).get(f"result={result}", 0))


def comparable(gpus: list[dict[str, Any]], like: list[dict[str, Any]] | None = None,
               ) -> list[dict[str, Any]]:
    """GPU views without what moves by itself between two requests (live readings, a lease's
    running duration); with `like`, only the keys those views have (the reply carries what
    clients use of the API's views)."""
    out = []
    for n, g in enumerate(gpus):
        keys = like[n] if like is not None else g
        live_keys = keys["live"] if like is not None else g["live"]
        g = {k: v for k, v in g.items() if k in keys}
        g["live"] = {k: v for k, v in g["live"].items() if k in live_keys and k != "at"}
        if g["lease"] is not None:
            lease_keys = keys["lease"] if like is not None else g["lease"]
            g["lease"] = {k: v for k, v in g["lease"].items()
                          if k in lease_keys and k != "duration_s"}
        out.append(g)
    return out


# ------------------------------------------------------------------------------------ tests
def test_info_without_leases(gpupool_server: GpupoolServer) -> None:
    reply = ask(gpupool_server, info_request(gpupool_server.token))
    assert (reply.result, reply.major, reply.minor, reply.message) == (0, gp.MAJOR, gp.MINOR, "")
    assert reply.server.startswith("gpupoold ") and reply.server.endswith(f" on {HOST}")
    assert (reply.gpus, reply.matching, reply.free_matching, reply.queue) == (1, 1, 1, 0)
    doc = document(reply)
    assert doc["server"]["protocol"] == f"{gp.MAJOR}.{gp.MINOR}"
    assert doc["server"]["remoting"] == gpupool_server.address
    assert doc["server"]["host"] == HOST
    assert doc["server"]["auth"] == "token"
    assert doc["server"]["simulated"] is True
    assert doc["server"]["driver_version"] == "580.00.00"  # simulated GPUs (gpu/telemetry.py)
    assert doc["server"]["cuda_driver_version"] == 13000
    assert doc["you"] == {"name": "tests", "role": "user"}
    assert abs(doc["time"] - time.time()) < 60
    assert doc["leases"] == [] and doc["queue"] == []
    # The GPU views are the API's.
    api = gpupool_server.get_json("/api/v1/gpus", token=gpupool_server.token)["gpus"]
    assert comparable(api, like=doc["gpus"]) == comparable(doc["gpus"])
    assert len(doc["gpus"][0]) == 13 and len(doc["gpus"][0]["live"]) == 13  # all of them
    assert doc["truncated"] is False
    gpu = doc["gpus"][0]
    assert gpu["pci_bus_id"].startswith("00000000:") and gpu["pci_bus_id"].endswith(":00.0")
    assert gpu["live"]["memory_used"] == 0 and gpu["live"]["memory_total"] == 80 * GIB
    assert counter(gpupool_server, "ok") == 1


def test_info_with_a_lease_and_a_queue(plain_server: GpupoolServer) -> None:
    server = plain_server  # plain TCP: the Tenants speak the protocol on raw sockets
    holder = Tenant(server, server.token)
    try:
        holder.alloc(8 * MIB)
        reply = ask(server, info_request(server.token))
        assert (reply.gpus, reply.matching, reply.free_matching, reply.queue) == (1, 1, 0, 0)
        doc = document(reply)
        assert [(le["gpu"], le["token"], le["mine"]) for le in doc["leases"]] == [(0, "tests", True)]
        assert doc["gpus"][0]["state"] == "leased"
        assert doc["gpus"][0]["lease"]["client"]["host"] == HOST
        api = server.get_json("/api/v1/gpus")["gpus"]
        assert comparable(api, like=doc["gpus"]) == comparable(doc["gpus"])
        (lease,) = server.get_json("/api/v1/leases?state=active")["leases"]
        assert {k: v for k, v in lease.items() if k in doc["leases"][0] and k != "duration_s"} \
            == {k: v for k, v in doc["leases"][0].items() if k not in ("mine", "duration_s")}

        # Another host, or another token, does not own the lease.
        other = document(ask(server, info_request(server.token, host="elsewhere")))
        assert [le["mine"] for le in other["leases"]] == [False]
        bob = server.create_token("bob")
        theirs = ask(server, info_request(bob))
        assert [le["mine"] for le in document(theirs)["leases"]] == [False]
        assert document(theirs)["you"] == {"name": "bob", "role": "user"}

        # A second client waits: it is counted, and it is bob's.
        waiting = Tenant(server, bob, wait=False)
        try:
            wait_until("the second client queued",
                       lambda: len(server.get_json("/api/v1/queue")["queue"]) == 1)
            reply = ask(server, info_request(bob))
            assert (reply.gpus, reply.matching, reply.free_matching, reply.queue) == (1, 1, 0, 1)
            assert [q["mine"] for q in document(reply)["queue"]] == [True]
            assert [q["mine"] for q in document(ask(server, info_request(server.token)))[
                "queue"]] == [False]
        finally:
            waiting.close()
    finally:
        holder.close()
    wait_until("the GPU free again", lambda: ask(server, info_request(server.token))
               .free_matching == 1)


@pytest.mark.parametrize("changes", [{"model": "A100"}, {"gpu": "3"}, {"gpu": "GPU-ffff"},
                                     {"min_memory": 81 * GIB}])
def test_requirements_no_gpu_meets_are_not_an_error(gpupool_server: GpupoolServer,
                                                      changes: dict[str, Any]) -> None:
    reply = ask(gpupool_server, info_request(gpupool_server.token, **changes))
    assert reply.result == 0, reply.message
    assert (reply.gpus, reply.matching, reply.free_matching, reply.queue) == (1, 0, 0, 0)
    assert len(document(reply)["gpus"]) == 1


def test_requirements_a_gpu_meets(gpupool_server: GpupoolServer) -> None:
    reply = ask(gpupool_server, info_request(gpupool_server.token, model="h100", gpu="0",
                                             min_memory=80 * GIB))
    assert (reply.gpus, reply.matching, reply.free_matching) == (1, 1, 1)


def test_a_drained_gpu_does_not_match(gpupool_server: GpupoolServer) -> None:
    gpupool_server.api("POST", "/api/v1/gpus/0/drain")
    reply = ask(gpupool_server, info_request(gpupool_server.token))
    assert (reply.gpus, reply.matching, reply.free_matching) == (1, 0, 0)
    assert document(reply)["gpus"][0]["state"] == "drained"


@pytest.mark.parametrize("token,why", [("", "requires a token"),
                                       ("gpt_000000000000_" + "x" * 43, "not known"),
                                       ("nonsense", "malformed")])
def test_a_refused_token(gpupool_server: GpupoolServer, token: str, why: str) -> None:
    reply = ask(gpupool_server, info_request(token))
    assert reply.result == gp.GP_EAUTH
    assert why in reply.message and "GPUPOOL_TOKEN" in reply.message, reply.message
    assert (reply.gpus, reply.matching, reply.free_matching, reply.queue) == (0, 0, 0, 0)
    assert (reply.gpu_views, reply.lease_views, reply.queue_views) == ([], [], [])
    assert (reply.major, reply.minor) == (gp.MAJOR, gp.MINOR)
    assert counter(gpupool_server, "auth") == 1 and counter(gpupool_server, "ok") == 0


def test_a_revoked_token(gpupool_server: GpupoolServer) -> None:
    token = gpupool_server.create_token("carol")
    gpupool_server.api("DELETE", "/api/v1/tokens/carol")
    reply = ask(gpupool_server, info_request(token))
    assert reply.result == gp.GP_EAUTH and "revoked" in reply.message


def test_another_major_version(gpupool_server: GpupoolServer) -> None:
    reply = ask(gpupool_server, info_request(gpupool_server.token, major=2, minor=0))
    assert reply.result == gp.GP_EVERSION
    assert (reply.major, reply.minor) == (gp.MAJOR, gp.MINOR)  # the server's
    assert "protocol 2.0" in reply.message and "upgrade gpupoold" in reply.message
    assert (reply.gpus, reply.gpu_views) == (0, [])
    assert counter(gpupool_server, "version") == 1


def test_a_malformed_info(gpupool_server: GpupoolServer) -> None:
    body = info_request(gpupool_server.token).encode()[:-3]  # the host string cut short
    reply = ask(gpupool_server, gp.HEADER.pack(len(body), gp.Info.OP, 0, INFO_REQ) + body)
    assert reply.result == gp.GP_EPROTO and "malformed info" in reply.message
    assert (reply.gpus, reply.gpu_views) == (0, [])
    assert counter(gpupool_server, "malformed") == 1


def test_auth_none_lets_anyone_ask(start_daemon: Callable[..., GpupoolServer],
                                   native_build: Path) -> None:
    server = start_daemon("--auth", "none", build_dir=native_build)
    doc = document(ask(server, info_request("")))
    assert doc["you"] == {"name": "anonymous", "role": "admin"}
    assert doc["server"]["auth"] == "none"


def test_max_gpus_per_token_makes_a_free_gpu_not_free_for_that_token(
        start_daemon: Callable[..., GpupoolServer], native_build: Path, tmp_path: Path) -> None:
    config = tmp_path / "gpupoold.toml"
    config.write_text("max_gpus_per_token = 1\n")
    # plain TCP: the Tenant speaks the protocol on a raw socket
    server = start_daemon("--config", str(config), simulated=2, build_dir=native_build, tls=False)
    reply = ask(server, info_request(server.token))
    assert (reply.gpus, reply.matching, reply.free_matching) == (2, 2, 2)
    holder = Tenant(server, server.token)
    try:
        reply = ask(server, info_request(server.token))
        assert (reply.gpus, reply.matching, reply.free_matching) == (2, 2, 0)
        other = ask(server, info_request(server.create_token("dave")))
        assert (other.gpus, other.matching, other.free_matching) == (2, 2, 1)
    finally:
        holder.close()


def test_info_over_tls(start_daemon: Callable[..., GpupoolServer], native_build: Path,
                       pki: Pki, tmp_path: Path) -> None:  # noqa: F811
    server = tls_daemon(start_daemon, native_build, pki, tmp_path)
    reply = ask(server, info_request(server.token), tls_ca=pki.ca)
    assert (reply.result, reply.gpus, reply.free_matching) == (0, 1, 1)
    assert document(reply)["you"]["name"] == "tests"
    refused = ask(server, info_request("nonsense"), tls_ca=pki.ca)
    assert refused.result == gp.GP_EAUTH and "malformed" in refused.message
    assert counter(server, "ok") == 1 and counter(server, "auth") == 1


def test_info_in_plaintext_on_the_tls_port_is_told_to_use_tls(
        start_daemon: Callable[..., GpupoolServer], native_build: Path, pki: Pki,  # noqa: F811
        tmp_path: Path) -> None:
    server = tls_daemon(start_daemon, native_build, pki, tmp_path)
    with socket.create_connection((server.host, server.port), timeout=30) as sock:  # plain
        sock.sendall(gp.encode_frame(info_request(server.token), INFO_REQ))
        op, _flags, req, body = read_frame(sock)
    assert (op, req) == (gp.Info.OP, INFO_REQ)
    refused = gp.InfoReply.decode(body)
    assert refused.result == gp.GP_EPROTO and "requires TLS" in refused.message
    assert "gpupool login HOST:PORT" in refused.message  # the fix: pin it


def test_info_over_the_servers_own_identity_names_it(gpupool_server: GpupoolServer) -> None:
    """A daemon with no TLS setting serves TLS with its own identity; the info reply (over the
    pinned channel) carries that fingerprint, and, outside a fleet, no fleet members."""
    assert gpupool_server.fingerprint is not None
    reply = ask(gpupool_server, info_request(gpupool_server.token))
    assert reply.result == 0 and reply.fingerprint == gpupool_server.fingerprint
    assert reply.fleet_servers == []


# ------------------------------------------------------------------ the daemon's side, in-process
# RemotingListener and InfoCache (gpupoold/remoting/listener.py, gpupoold/remoting/info.py) on a stand-in lease
# manager whose views can be made as large as the reply allows.
class StandInLeases:
    """What InfoCache and the info path of RemotingListener read of the lease manager and of its
    views (gpupoold/pool/views.py): one object passed as both."""

    def __init__(self, leases: int = 0, queue: int = 0, pad: int = 0, gpu_pad: int = 0) -> None:
        self.slots = [SimpleNamespace(gpu=SimpleNamespace(simulated=True))]
        self.telemetry: Any = None
        self.fleet: Any = None  # a server without a shared store
        self.key = 0
        self.gpu_pad = gpu_pad
        self.leases = [self._entry(i, pad) for i in range(leases)]
        self.queue = [{"position": i + 1, **self._entry(i, pad)} for i in range(queue)]

    @staticmethod
    def _entry(i: int, pad: int) -> dict[str, Any]:
        # every fifth a lease of two GPUs (issue 37): lease_gpus lists both
        return {"id": i, "gpu": 0, "gpus": [0, 1] if i % 5 == 0 else [0],
                "token": ("alice", "bob")[i % 2],
                "client": {"host": ("h1", "h2", "hé")[i % 3], "user": "u", "pid": i,
                           "program": "prögram ✓ " + "x" * pad, "peer": "127.0.0.1:1"},
                "request": "any GPU", "started": 1767225600.25, "duration_s": 0.5,
                "calls": {"cuMemAlloc": i}}

    def gpu_views(self) -> list[dict[str, Any]]:
        # GPU 0 shared (issue 32) by the first two leases, if there are any
        shares = {"max": 4, "closed": False, "leases": [
            {"id": v["id"], "token": v["token"], "client": v["client"], "memory_quota": 8 << 30,
             "memory_used": 3 << 20, "busy_s": 1.5} for v in self.leases[:2]]}
        return [{"index": 0, "name": "H100 (gpupool simulated) " + "y" * self.gpu_pad,
                 "state": "free", "live": {"memory_used": 0}, "shares": shares}]

    def active_leases(self) -> list[dict[str, Any]]:
        return [dict(v) for v in self.leases]

    def stop_queue(self) -> None:
        """The listener tells queued clients to come back when it stops: nobody queues here."""

    def queue_view(self) -> list[dict[str, Any]]:
        return [dict(v) for v in self.queue]

    def view_key(self) -> tuple[Any, ...]:
        return (self.key,)

    def counts(self, req: Any, token: str) -> tuple[int, int, int, int]:
        return 1, 1, 1, len(self.queue)


def doc_settings(**changes: Any) -> Any:
    """Settings of an in-process listener: plain TCP unless the test gives a certificate (the
    server's own identity would be made in the default state directory)."""
    from gpupoold.config.settings import Settings
    if "tls_cert" not in changes:
        changes.setdefault("tls", "off")
    return Settings(listen="127.0.0.1:0", auth="none", **changes)


@pytest.mark.parametrize(("leases", "queue", "pad", "gpu_pad", "truncated"), [
    (0, 0, 0, 0, False),
    (7, 5, 10, 0, False),
    (2200, 300, 1500, 0, False),  # programs' names cut to the field's 1,023 bytes
    (4096, 4096, 0, 0, False),  # the limits exactly
    (5000, 10, 0, 0, True),  # past the lease limit
    (1, 4100, 0, 0, True),  # past the queue limit
    (1, 1, 0, 5 * MIB, False),  # a GPU name cut to 255 bytes
])
async def test_the_cached_reply_is_the_reference_encoding(
        leases: int, queue: int, pad: int, gpu_pad: int, truncated: bool) -> None:
    from gpupoold.remoting import info
    stand_in = StandInLeases(leases, queue, pad, gpu_pad)
    settings = doc_settings()
    cache = info.InfoCache(settings, stand_in, stand_in)  # type: ignore[arg-type]
    snap = await cache.snapshot("0.0.0.0:7070")
    counts = (1, 1, 1, queue)
    for name, role, host in (("alice", "user", "h1"), ("bob", "user", "hé"),
                             ("alice", "user", ""), ("carol", "user", "h2"),
                             ("anonymous", "anonymous", "h1"), ("root", "admin", "h2")):
        expected = info.reply(settings, stand_in, "0.0.0.0:7070", name, role, host,  # type: ignore[arg-type]
                              counts, now=snap.time).encode()
        got = snap.compose(name, role, host, counts)
        assert got == expected, (name, host)
        # Command lines (pool/privacy.py): the owner's token and admins see the arguments,
        # everyone else the program's name.
        decoded = gp.InfoReply.decode(got)
        for r in decoded.lease_views[:4] + decoded.queue_views[:4]:
            whole = r.token == name and role == "user" or role == "admin"
            assert r.client_program.startswith("prögram ✓ ") is whole, (name, role, r.token)
            assert whole or r.client_program == "prögram", (name, role, r.token)
    reply = gp.InfoReply.decode(snap.compose("alice", "user", "h1", counts))
    assert reply.truncated == int(truncated)
    assert len(reply.lease_views) == min(leases, info.LEASE_LIMIT)
    assert len(reply.queue_views) == min(queue, info.QUEUE_LIMIT)
    assert len(reply.gpu_views[0].name.encode()) <= 255
    assert all(len(r.client_program.encode()) <= 1023 for r in reply.lease_views)
    mine = [r.mine for r in reply.lease_views[:6]]
    assert mine == [int(i % 2 == 0 and i % 3 == 0) for i in range(len(mine))]  # alice on h1
    # Protocol 1.7: GPU 0's shares, and both GPUs of every fifth lease.
    shown = min(leases, info.LEASE_LIMIT)
    assert [(g.gpu, g.max_shares, g.shares) for g in reply.shared_gpus] == [(0, 4, min(leases, 2))]
    assert [(s.lease_id, s.memory_quota, s.busy_s) for s in reply.share_views] == [
        (i, 8 << 30, 1.5) for i in range(min(leases, 2))]
    assert [(r.lease_id, r.gpu) for r in reply.lease_gpus] == [
        (i, g) for i in range(shown) for g in ([0, 1] if i % 5 == 0 else [0])]


async def test_repeat_requests_share_one_snapshot_until_something_changes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpupoold.remoting import info
    monkeypatch.setattr(info, "CACHE_TTL", 0.3)
    stand_in = StandInLeases(leases=3)
    stand_in.telemetry = SimpleNamespace(samples=1, driver_version="", cuda_driver_version=13000)
    cache = info.InfoCache(doc_settings(), stand_in, stand_in)  # type: ignore[arg-type]
    request = info_request("", host="h1")

    async def ask_doc(name: str = "alice", host: str = "h1") -> dict[str, Any]:
        request.host = host
        return document(await cache.answer(request, name, "user", "0.0.0.0:7070"))

    first = await ask_doc()
    for _ in range(20):
        again = await ask_doc()
        assert again == first  # same snapshot, same time
    assert [le["mine"] for le in first["leases"]] == [True, False, False]
    assert [le["mine"] for le in (await ask_doc("bob", "h2"))["leases"]] == [False, True, False]
    assert (await ask_doc("bob", "h2"))["you"] == {"name": "bob", "role": "user"}
    assert cache.builds == 1

    stand_in.leases.append(StandInLeases._entry(3, 0))  # a lease started: the key moves
    stand_in.key += 1
    assert len((await ask_doc())["leases"]) == 4 and cache.builds == 2
    stand_in.telemetry.samples += 1  # new live values
    await ask_doc()
    assert cache.builds == 3
    await ask_doc()
    assert cache.builds == 3
    await asyncio.sleep(0.35)  # CACHE_TTL: running durations move
    later = await ask_doc()
    assert cache.builds == 4 and later["time"] > first["time"]


async def test_a_large_snapshot_is_encoded_off_the_event_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpupoold.remoting import info
    threads: list[bool] = []
    encode = info._encode_lists

    def recording(*args: Any) -> Any:
        threads.append(threading.current_thread() is threading.main_thread())
        return encode(*args)

    monkeypatch.setattr(info, "_encode_lists", recording)
    for n in (3, info.THREAD_ITEMS + 1):
        stand_in = StandInLeases(leases=n)
        cache = info.InfoCache(doc_settings(), stand_in, stand_in)  # type: ignore[arg-type]
        reply = await cache.answer(info_request(""), "alice", "user", "x:1")
        assert len(document(reply)["leases"]) == n
    assert threads == [True, False]


class InProcessDaemon:
    """A RemotingListener on 127.0.0.1:0 with a stand-in lease manager, answering `info`."""

    def __init__(self, leases: StandInLeases, **settings: Any) -> None:
        from gpupoold.auth.authenticator import NoAuthentication
        from gpupoold.pool.counters import Counters
        from gpupoold.remoting.listener import RemotingListener
        self.counters = Counters()
        self.listener = RemotingListener(doc_settings(**settings), leases,  # type: ignore[arg-type]
                                         NoAuthentication(), self.counters,  # type: ignore[arg-type]
                                         views=leases)  # type: ignore[arg-type]

    async def start(self, sndbuf: int = 256 * 1024) -> InProcessDaemon:
        await self.listener.start()
        # Accepted sockets inherit a small send buffer from the listening socket: a reply of
        # megabytes cannot vanish into the kernel, whatever its TCP autotuning allows.
        assert self.listener._server is not None
        for sock in self.listener._server.sockets:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        host, _, port = self.listener.address.rpartition(":")
        self.host, self.port = host, int(port)
        return self

    async def handshakes_done(self, connections: int, timeout: float) -> float:
        """Seconds until `connections` connections were seen and none is in its handshake any
        more (fails after `timeout`)."""
        t0 = time.monotonic()
        while self.counters.total("connections") < connections or self.listener._handshakes:
            assert time.monotonic() - t0 < timeout, \
                f"{len(self.listener._handshakes)} connection(s) still held after {timeout} s"
            await asyncio.sleep(0.02)
        return time.monotonic() - t0


def open_non_reader(daemon: InProcessDaemon, tls_ca: Path | None = None,
                    rcvbuf: int | None = 4096) -> socket.socket:
    """Connect with a tiny receive buffer, send an info request, and read nothing (yet)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect((daemon.host, daemon.port))
    if tls_ca is not None:
        ctx = ssl.create_default_context(cafile=str(tls_ca))
        sock = ctx.wrap_socket(sock, server_hostname="localhost")
    sock.sendall(gp.encode_frame(info_request(""), INFO_REQ))
    return sock


def read_to_the_end(sock: socket.socket) -> tuple[int, str]:
    """(bytes read, how the connection ended: "eof" or "reset")."""
    total = 0
    try:
        while chunk := sock.recv(1 << 20):
            total += len(chunk)
    except (ConnectionResetError, ssl.SSLError):
        return total, "reset"
    return total, "eof"


def ask_in_thread(daemon: InProcessDaemon, tls_ca: Path | None = None) -> gp.InfoReply:
    server = SimpleNamespace(host=daemon.host, port=daemon.port, fingerprint=None)
    return ask(server, info_request(""), tls_ca)  # type: ignore[arg-type]


@pytest.mark.parametrize("use_tls", [False, True], ids=["plain", "tls"])
async def test_a_client_that_never_reads_its_reply_is_dropped(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, pki: Pki,  # noqa: F811
        use_tls: bool) -> None:
    from gpupoold.remoting import listener as remoting
    monkeypatch.setattr(remoting, "SEND_TIMEOUT", 1.0)
    monkeypatch.setattr(remoting, "CLOSE_TIMEOUT", 1.0)
    tls: dict[str, Any] = {"tls_cert": pki.cert, "tls_key": pki.key} if use_tls else {}
    ca = pki.ca if use_tls else None
    daemon = await InProcessDaemon(StandInLeases(leases=1500, pad=1500), **tls).start()
    try:
        caplog.set_level("INFO", logger="gpupoold.remoting")
        t0 = time.monotonic()
        sock = await asyncio.to_thread(open_non_reader, daemon, ca)
        try:
            await daemon.handshakes_done(1, timeout=10)
            took = time.monotonic() - t0
            # A round of SEND_TIMEOUT for what the kernels took at first, and one or two while
            # the client's kernel takes its last bytes: far from SEND_LIMIT (30 s).
            assert took < 5, f"the connection was held {took:.1f} s"
            assert any("read nothing for 1 s; connection dropped" in r.getMessage()
                       for r in caplog.records), [r.getMessage() for r in caplog.records]
            got, end = await asyncio.to_thread(read_to_the_end, sock)
            assert end == "reset" or got < 2 * MIB, (got, end)  # never the whole reply
        finally:
            sock.close()
        # The daemon serves the next client as before, the whole reply.
        reply = await asyncio.to_thread(ask_in_thread, daemon, ca)
        assert len(document(reply)["leases"]) == 1500
        assert daemon.counters.get("info_requests", result="ok") == 2
    finally:
        await daemon.listener.close()


async def test_info_requests_answered_at_once_are_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpupoold.remoting import listener as remoting
    monkeypatch.setattr(remoting, "MAX_INFO_AT_ONCE", 1)
    monkeypatch.setattr(remoting, "SEND_TIMEOUT", 3.0)
    daemon = await InProcessDaemon(StandInLeases(leases=1500, pad=1500),
                                   handshake_timeout=1.0).start()
    try:
        sock = await asyncio.to_thread(open_non_reader, daemon)  # holds the only slot ~3 s
        try:
            t0 = time.monotonic()
            busy = await asyncio.to_thread(ask_in_thread, daemon)
            waited = time.monotonic() - t0
            assert busy.result == gp.GP_EBUSY, busy
            assert "too many info requests at once (1)" in busy.message, busy.message
            assert "try again" in busy.message
            assert (busy.gpus, busy.gpu_views) == (0, [])
            assert 0.9 < waited < 2.5, waited  # it waited its turn for handshake_timeout
            assert daemon.counters.get("info_requests", result="busy") == 1
        finally:
            sock.close()
        await daemon.handshakes_done(2, timeout=6)
        # The slot is free again; a request that has to wait a little (for one reply of 1500
        # leases to be built and sent; a third could wait past handshake_timeout on a loaded
        # machine) is served.
        replies = await asyncio.gather(*(asyncio.to_thread(ask_in_thread, daemon)
                                         for _ in range(2)))
        assert [r.result for r in replies] == [0, 0]
    finally:
        await daemon.listener.close()


@pytest.mark.parametrize("use_tls", [False, True], ids=["plain", "tls"])
async def test_a_client_that_reads_slowly_gets_its_whole_reply(
        monkeypatch: pytest.MonkeyPatch, pki: Pki, use_tls: bool) -> None:  # noqa: F811
    from gpupoold.remoting import listener as remoting
    monkeypatch.setattr(remoting, "SEND_TIMEOUT", 1.0)
    tls: dict[str, Any] = {"tls_cert": pki.cert, "tls_key": pki.key} if use_tls else {}
    ca = pki.ca if use_tls else None
    daemon = await InProcessDaemon(StandInLeases(leases=300, pad=1500),
                                   **tls).start(sndbuf=32 * 1024)

    def slow_reader() -> tuple[float, gp.InfoReply]:
        sock = open_non_reader(daemon, ca, rcvbuf=64 * 1024)
        with sock:
            t0 = time.monotonic()
            buf = bytearray()
            while True:  # 32 KiB every 0.3 s: never idle for SEND_TIMEOUT
                step = len(buf) + 32 * 1024
                while len(buf) < step and (chunk := sock.recv(step - len(buf))):
                    buf += chunk
                if len(buf) < step:
                    break
                time.sleep(0.3)
            took = time.monotonic() - t0
        length, op, _flags, _req = gp.HEADER.unpack(buf[:gp.HEADER.size])
        assert (op, len(buf)) == (gp.Info.OP, gp.HEADER.size + length)
        return took, gp.InfoReply.decode(bytes(buf[gp.HEADER.size:]))

    try:
        took, reply = await asyncio.to_thread(slow_reader)
        assert took > 2 * remoting.SEND_TIMEOUT  # longer than one SEND_TIMEOUT, by far
        assert len(document(reply)["leases"]) == 300
    finally:
        await daemon.listener.close()
