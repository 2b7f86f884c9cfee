"""The `info` request (protocol 1.1, docs/protocol.md "info"): a real gpupoold on simulated GPUs,
asked over a socket with gpupool_protocol, plain and TLS. Leases are held by `Tenant`, a client
that speaks the protocol itself (hello, then driver calls), so the tests do not depend on the
shim; tests/test_telemetry.py uses it too.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gpupool_protocol as gp
import pytest
from conftest import GpupoolServer
from test_remoting_tls import Pki, pki, tls_daemon  # noqa: F401  (pki is a fixture)

HOST = socket.gethostname()
VA_BASE = 0x200000000000
VA_SIZE = 1 << 40
INFO_REQ = 9
MIB = 1 << 20
GIB = 1 << 30


# ------------------------------------------------------------------------------------ clients
def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket) -> tuple[int, int, int, bytes]:
    length, op, flags, req = gp.HEADER.unpack(recv_exact(sock, gp.HEADER.size))
    return op, flags, req, recv_exact(sock, length)


def info_request(token: str, **changes: Any) -> gp.Info:
    msg = gp.Info(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, flags=0, token=token, gpu="",
                  model="", min_memory=0, host=HOST)
    for key, value in changes.items():
        setattr(msg, key, value)
    return msg


def connect(server: GpupoolServer, tls_ca: Path | None = None) -> socket.socket:
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


def document(reply: gp.InfoReply) -> dict[str, Any]:
    assert reply.result == 0, reply
    doc = json.loads(reply.json)
    assert isinstance(doc, dict)
    return doc


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


def wait_until(what: str, predicate: Callable[[], Any], timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def counter(server: GpupoolServer, result: str) -> int:
    counters = server.get_json("/api/v1/status")["counters"]
    return int(counters.get("info_requests", {}).get(f"result={result}", 0))


def comparable(gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """GPU views without what moves by itself between two requests (live readings, a lease's
    running duration)."""
    out = []
    for g in gpus:
        g = {**g, "live": {k: v for k, v in g["live"].items() if k != "at"}}
        if g["lease"] is not None:
            g["lease"] = {k: v for k, v in g["lease"].items() if k != "duration_s"}
        out.append(g)
    return out


# ------------------------------------------------------------------------------------ tests
def test_info_without_leases(gpupool_server: GpupoolServer) -> None:
    reply = ask(gpupool_server, info_request(gpupool_server.token))
    assert (reply.result, reply.major, reply.minor, reply.message) == (0, 1, 1, "")
    assert reply.server.startswith("gpupoold ") and reply.server.endswith(f" on {HOST}")
    assert (reply.gpus, reply.matching, reply.free_matching, reply.queue) == (1, 1, 1, 0)
    doc = document(reply)
    assert doc["schema"] == 1
    assert doc["server"]["protocol"] == "1.1"
    assert doc["server"]["remoting"] == gpupool_server.address
    assert doc["server"]["host"] == HOST
    assert doc["server"]["auth"] == "token"
    assert doc["server"]["simulated"] is True
    assert doc["server"]["driver_version"] == ""
    assert doc["server"]["cuda_driver_version"] == 13000
    assert doc["you"] == {"name": "tests", "role": "user"}
    assert abs(doc["time"] - time.time()) < 60
    assert doc["leases"] == [] and doc["queue"] == []
    # The GPU views are the API's.
    api = gpupool_server.get_json("/api/v1/gpus", token=gpupool_server.token)["gpus"]
    assert comparable(doc["gpus"]) == comparable(api)
    gpu = doc["gpus"][0]
    assert gpu["pci_bus_id"].startswith("00000000:") and gpu["pci_bus_id"].endswith(":00.0")
    assert gpu["live"]["memory_used"] == 0 and gpu["live"]["memory_total"] == 80 * GIB
    assert counter(gpupool_server, "ok") == 1


def test_info_with_a_lease_and_a_queue(gpupool_server: GpupoolServer) -> None:
    server = gpupool_server
    holder = Tenant(server, server.token)
    try:
        holder.alloc(8 * MIB)
        reply = ask(server, info_request(server.token))
        assert (reply.gpus, reply.matching, reply.free_matching, reply.queue) == (1, 1, 0, 0)
        doc = document(reply)
        assert [(le["gpu"], le["token"], le["mine"]) for le in doc["leases"]] == [(0, "tests", True)]
        assert doc["gpus"][0]["state"] == "leased"
        assert doc["gpus"][0]["lease"]["client"]["host"] == HOST
        assert comparable(doc["gpus"]) == comparable(server.get_json("/api/v1/gpus")["gpus"])

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
    assert (reply.gpus, reply.matching, reply.free_matching, reply.queue, reply.json) == \
        (0, 0, 0, 0, "")
    assert (reply.major, reply.minor) == (1, 1)
    assert counter(gpupool_server, "auth") == 1 and counter(gpupool_server, "ok") == 0


def test_a_revoked_token(gpupool_server: GpupoolServer) -> None:
    token = gpupool_server.create_token("carol")
    gpupool_server.api("DELETE", "/api/v1/tokens/carol")
    reply = ask(gpupool_server, info_request(token))
    assert reply.result == gp.GP_EAUTH and "revoked" in reply.message


def test_another_major_version(gpupool_server: GpupoolServer) -> None:
    reply = ask(gpupool_server, info_request(gpupool_server.token, major=2, minor=0))
    assert reply.result == gp.GP_EVERSION
    assert (reply.major, reply.minor) == (1, 1)  # the server's
    assert "protocol 2.0" in reply.message and "upgrade gpupoold" in reply.message
    assert (reply.gpus, reply.json) == (0, "")
    assert counter(gpupool_server, "version") == 1


def test_a_malformed_info(gpupool_server: GpupoolServer) -> None:
    body = info_request(gpupool_server.token).encode()[:-3]  # the host string cut short
    reply = ask(gpupool_server, gp.HEADER.pack(len(body), gp.Info.OP, 0, INFO_REQ) + body)
    assert reply.result == gp.GP_EPROTO and "malformed info" in reply.message
    assert (reply.gpus, reply.json) == (0, "")
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
    server = start_daemon("--config", str(config), simulated=2, build_dir=native_build)
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
    with connect(server) as sock:
        sock.sendall(gp.encode_frame(info_request(server.token), INFO_REQ))
        op, _flags, req, body = read_frame(sock)
    assert (op, req) == (gp.Info.OP, INFO_REQ)
    refused = gp.InfoReply.decode(body)
    assert refused.result == gp.GP_EPROTO and "requires TLS" in refused.message
    assert "GPUPOOL_TLS=1" in refused.message
