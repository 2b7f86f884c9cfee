"""Version skew across minor protocol versions (docs/protocol.md, "Versioning"): a minor version
only appends fields at the end of messages, so peers of different minor versions read the fields
they know and skip the rest. A synthetic client of the next minor version, whose hello and info
carry fields this build does not know, is served by a real gpupoold and worker on a simulated
GPU; the C decoders report such bytes apart from malformed ones (GP_PROTO_ETRAILING, checked for
every message by tests/c/test_protocol.c) and the Python ones skip them on request.

The synthetic client speaks the plaintext protocol on a raw socket: its daemons run with
`--tls off` (the plain_server fixture); TLS is not what is tested here.
"""

from __future__ import annotations

import os
import socket

import gpupool_protocol as gp
import pytest
from conftest import GpupoolServer
from test_hostile_tenant import VA_BASE, VA_SIZE, recv_frame

NEWER = gp.MINOR + 1
EXTRA = b"\x07" * 12  # the next version's fields, whatever they are


def newer_hello(server: GpupoolServer) -> bytes:
    return gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=NEWER, pid=os.getpid(), host="future",
                    user="tester", program="test_version_skew", token=server.token,
                    va_base=VA_BASE, va_size=VA_SIZE).encode() + EXTRA


def send(s: socket.socket, op: int, body: bytes, req: int) -> None:
    s.sendall(gp.HEADER.pack(len(body), op, 0, req) + body)


def test_python_decoders_skip_trailing_fields_only_when_asked() -> None:
    body = gp.Ping(token=5).encode() + EXTRA
    with pytest.raises(gp.ProtocolError, match="trailing"):
        gp.Ping.decode(body)
    assert gp.Ping.decode(body, allow_trailing=True).token == 5


@pytest.mark.san
def test_a_newer_minor_client_is_served(plain_server: GpupoolServer) -> None:
    server = plain_server  # plain TCP: the frames below go on a raw socket
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        send(s, gp.Hello.OP, newer_hello(server), 1)
        op, body = recv_frame(s)
        assert op == gp.Hello.OP
        reply = gp.HelloReply.decode(body)
        assert reply.result == 0, reply.message
        # The server says what it speaks: the client keeps to that version's messages.
        assert (reply.major, reply.minor) == (gp.MAJOR, gp.MINOR)
        send(s, gp.Ping.OP, gp.Ping(token=42).encode(), 2)
        op, body = recv_frame(s)
        assert op == gp.Ping.OP and gp.PingReply.decode(body).token == 42
        send(s, gp.Goodbye.OP, gp.Goodbye().encode(), 0)
    leases = server.get_json("/api/v1/leases?state=all")["leases"]
    assert [le["program"] for le in leases] == ["test_version_skew"]
    assert not server.problems(), server.problems()


@pytest.mark.san
def test_an_older_minor_client_without_the_appended_hello_fields_is_served(
        plain_server: GpupoolServer) -> None:
    """A 1.4 client's hello ends before connect_timeout_ms (1.5): gpupoold and the worker read
    it as 0 (docs/protocol.md, "Versioning") and serve the client."""
    server = plain_server  # plain TCP: the frames below go on a raw socket
    older = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=4, pid=os.getpid(), host="past",
                     user="tester", program="test_version_skew_older", token=server.token,
                     va_base=VA_BASE, va_size=VA_SIZE).encode()[:-32]  # no connect_timeout_ms (1.5),
    # gpus, memory (1.6), spread_group, part, parts (1.8)
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        send(s, gp.Hello.OP, older, 1)
        op, body = recv_frame(s)
        reply = gp.HelloReply.decode(body)
        assert op == gp.Hello.OP and reply.result == 0, reply.message
        send(s, gp.Ping.OP, gp.Ping(token=43).encode(), 2)
        op, body = recv_frame(s)
        assert op == gp.Ping.OP and gp.PingReply.decode(body).token == 43
        send(s, gp.Goodbye.OP, gp.Goodbye().encode(), 0)
    leases = server.get_json("/api/v1/leases?state=all")["leases"]
    assert [le["program"] for le in leases] == ["test_version_skew_older"]
    assert not server.problems(), server.problems()


def test_a_newer_minor_info_is_answered(plain_server: GpupoolServer) -> None:
    server = plain_server  # plain TCP: the frames below go on a raw socket
    info = gp.Info(magic=gp.MAGIC, major=gp.MAJOR, minor=NEWER, token=server.token,
                   host="future").encode() + EXTRA
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        send(s, gp.Info.OP, info, 1)
        op, body = recv_frame(s)
    reply = gp.InfoReply.decode(body)
    assert op == gp.Info.OP and reply.result == 0, reply.message
    assert reply.gpus == 1 and len(reply.gpu_views) == 1 and reply.gpu_views[0].index == 0


def test_trailing_bytes_from_the_same_version_are_still_malformed(
        plain_server: GpupoolServer) -> None:
    server = plain_server  # plain TCP: the frames below go on a raw socket
    body = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, token=server.token,
                    va_base=VA_BASE, va_size=VA_SIZE).encode() + EXTRA
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        send(s, gp.Hello.OP, body, 1)
        op, reply_body = recv_frame(s)
    reply = gp.HelloReply.decode(reply_body)
    assert reply.result == gp.GP_EPROTO and "malformed hello" in reply.message
