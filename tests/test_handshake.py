"""gpupoold/remoting/handshake.py without I/O: decoding the hello with the client's requirements, the
refusal reply, the requirement text for logs and the API, the queue notice."""

from __future__ import annotations

import struct

import gpupool_protocol as gp
import pytest

from gpupoold.remoting.handshake import (
    Refusal,
    format_size,
    parse_hello,
    queue_notice,
    refusal_reply,
    requirements_text,
)


def hello(**kw: object) -> gp.Hello:
    fields: dict[str, object] = dict(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=7,
                                     host="node7", user="ada", program="train.py", token="t")
    fields.update(kw)
    return gp.Hello(**fields)  # type: ignore[arg-type]


def test_parse_hello_reads_the_requirements() -> None:
    body = hello(gpu="GPU-8f3a", model="A100", min_memory=40 << 30, va_base=1 << 45,
                 va_size=1 << 40).encode()
    got = parse_hello(body)
    assert isinstance(got, gp.Hello)
    assert (got.gpu, got.model, got.min_memory) == ("GPU-8f3a", "A100", 40 << 30)
    assert (got.va_base, got.va_size, got.user) == (1 << 45, 1 << 40, "ada")


def test_requirements_sit_between_token_and_window() -> None:
    """The wire layout docs/protocol.md gives, built by hand."""
    def s(text: str) -> bytes:
        return struct.pack("<I", len(text)) + text.encode()
    body = (struct.pack("<IHHII", gp.MAGIC, gp.MAJOR, gp.MINOR, 7, 0) + s("h") + s("u") + s("p")
            + s("tok") + s("1") + s("H100") + struct.pack("<QQQ", 80 * 10**9, 1 << 45, 1 << 40)
            + struct.pack("<I", 500)  # connect_timeout_ms (protocol 1.5)
            + struct.pack("<IQ", 4, 8 << 30)  # gpus, memory (protocol 1.6)
            + struct.pack("<QII", 0xABC, 1, 2))  # spread_group, part, parts (protocol 1.8)
    got = parse_hello(body)
    assert isinstance(got, gp.Hello)
    assert (got.token, got.gpu, got.model, got.min_memory) == ("tok", "1", "H100", 80 * 10**9)
    assert (got.va_size, got.connect_timeout_ms) == (1 << 40, 500)
    assert (got.gpus, got.memory) == (4, 8 << 30)
    assert (got.spread_group, got.part, got.parts) == (0xABC, 1, 2)


def test_an_older_minor_hello_without_the_appended_fields_reads_them_as_0() -> None:
    """A 1.4 client's hello ends before connect_timeout_ms (1.5): served, the field 0; the same
    short body from a client of this version is malformed."""
    full = hello(connect_timeout_ms=500, gpus=2, memory=1 << 30)
    short = hello(minor=4, connect_timeout_ms=500).encode()[:-32]
    got = parse_hello(short)
    assert isinstance(got, gp.Hello)
    assert (got.minor, got.token, got.va_size, got.connect_timeout_ms) == (4, "t", 0, 0)
    assert (got.gpus, got.memory) == (0, 0)
    # A 1.5 client's hello ends after connect_timeout_ms, before gpus and memory (1.6).
    five = parse_hello(hello(minor=5, connect_timeout_ms=500).encode()[:-28])
    assert isinstance(five, gp.Hello)
    assert (five.connect_timeout_ms, five.gpus, five.memory) == (500, 0, 0)
    # A 1.7 client's hello ends before spread_group, part and parts (1.8): not a part.
    seven = parse_hello(hello(minor=7, gpus=2).encode()[:-16])
    assert isinstance(seven, gp.Hello)
    assert (seven.gpus, seven.spread_group, seven.part, seven.parts) == (2, 0, 0, 0)
    mine = parse_hello(full.encode()[:-12])
    assert isinstance(mine, Refusal) and mine.result == gp.GP_EPROTO
    back = parse_hello(full.encode())
    assert isinstance(back, gp.Hello) and back.connect_timeout_ms == 500
    assert (back.gpus, back.memory) == (2, 1 << 30)
    # A whole hello of this layout whose minor field says older (hand-made, a test's) reads as
    # sent: nothing is appended to it (zeros appended first made it 'trailing', malformed).
    whole = parse_hello(hello(minor=0, connect_timeout_ms=500).encode())
    assert isinstance(whole, gp.Hello) and whole.connect_timeout_ms == 500


def test_hello_with_the_old_single_device_field_is_malformed() -> None:
    """A hello of the pre-release layout (one `device_request` string) no longer decodes: it is
    refused as malformed, not misread."""
    def s(text: str) -> bytes:
        return struct.pack("<I", len(text)) + text.encode()
    old = (struct.pack("<IHHII", gp.MAGIC, gp.MAJOR, gp.MINOR, 7, 0) + s("h") + s("u") + s("p")
           + s("") + s("A100") + struct.pack("<QQ", 1 << 45, 1 << 40))
    got = parse_hello(old)
    assert isinstance(got, Refusal)
    assert got.result == gp.GP_EPROTO and got.message.startswith("malformed hello")


@pytest.mark.parametrize(("kw", "text"), [
    ({}, "any GPU"),
    ({"gpu": "1"}, "gpu=1"),
    ({"gpu": "GPU-8f3a-11"}, "gpu=GPU-8f3a-11"),
    ({"model": "A100"}, "model='A100'"),
    ({"min_memory": 40 << 30}, "min_memory=40 GiB"),
    ({"min_memory": 40 * 10**9}, "min_memory=40 GB"),
    ({"min_memory": 1536 << 20}, "min_memory=1536 MiB"),
    ({"min_memory": 1000001}, "min_memory=1000001 bytes"),
    ({"gpu": "1", "model": "A100", "min_memory": 40 << 30},
     "gpu=1 model='A100' min_memory=40 GiB"),
    ({"gpu": " 2 ", "model": "  "}, "gpu=2"),
    # client-chosen text can neither break a log line nor pass for another field
    ({"gpu": "1\nlease 9 ended", "model": "x' min_memory=1"},
     "gpu='1\\nlease 9 ended' model=\"x' min_memory=1\""),
])
def test_requirements_text(kw: dict[str, object], text: str) -> None:
    assert requirements_text(hello(**kw)) == text


def test_format_size_is_exact() -> None:
    assert format_size(2 << 40) == "2 TiB"
    assert format_size(3 * 10**12) == "3 TB"
    assert format_size(512 * 10**6) == "512 MB"
    assert format_size(1) == "1 bytes"


def test_queue_notice() -> None:
    notice = queue_notice(3, 5, 12.4, "gpu1:7070")
    assert notice.code == gp.GP_INFO_QUEUED and notice.code in gp.INFO_CODES
    assert notice.op == 0
    assert notice.text == "waiting for a GPU on gpu1:7070: position 3 of 5 in the queue " \
                          "(waited 12 s)"
    assert gp.Notice.decode(notice.encode()) == notice
    assert gp.RESULT_NAMES[gp.GP_INFO_QUEUED] == "GP_INFO_QUEUED"
    assert gp.GP_EBUSY not in gp.INFO_CODES
    long = queue_notice(1, 1, 0.0, "x" * 5000)
    assert len(long.text.encode()) <= 4095
    gp.Notice.decode(long.encode())  # still a valid notice


def test_refusal_reply_carries_the_message() -> None:
    reply = refusal_reply(Refusal(gp.GP_EBUSY, "no GPU became free in 600 s"))
    back = gp.HelloReply.decode(reply.encode())
    assert back.result == gp.GP_EBUSY and back.message == "no GPU became free in 600 s"
    assert (back.major, back.minor) == (gp.MAJOR, gp.MINOR)
