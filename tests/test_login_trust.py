"""What `gpupool login` sends before the server's identity is settled (nothing but the TLS
handshake), and the pins of a fleet's members, learnt from the info reply of a server the user
just pinned. The servers here are stand-ins: TLS listeners with an identity of their own (made
by gpupoold's tls_identity) that record every byte a client sends inside TLS and answer an info
request with a reply the test writes (its fleet_servers list)."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import gpupool_protocol as gp
import pytest
from gpupool import config as cc
from gpupool.wire.frames import read_exactly
from test_login import cli_env, gpupool, user_file

from gpupoold.tls_identity import ensure_identity

TOKEN = "gpt_0123456789ab_stand-in-token"


class StandIn:
    """A TLS (or, with tls=False, plain) listener that records what each connection sent after
    the handshake and answers an info frame with `reply(self)`."""

    def __init__(self, folder: Path, name: str, tls: bool = True) -> None:
        self.name = name
        self.received: list[bytes] = []  # per connection, what came inside TLS
        self.handshakes = 0
        self.reply: gp.InfoReply | None = None
        self.ctx: ssl.SSLContext | None = None
        self.fingerprint = ""
        if tls:
            ident = ensure_identity(folder / name)
            self.fingerprint = ident.fingerprint
            self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.ctx.load_cert_chain(ident.cert_path, ident.key_path)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, raw: socket.socket) -> None:
        raw.settimeout(10)
        got = bytearray()
        try:
            conn = self.ctx.wrap_socket(raw, server_side=True) if self.ctx else raw
            with self.lock:
                self.handshakes += 1
            with conn:
                head = read_exactly(conn, gp.HEADER.size)
                got += head
                length, op, _, req = gp.parse_header(head, gp.MAX_BODY)
                got += read_exactly(conn, length)
                if op == gp.Info.OP and self.reply is not None:
                    conn.sendall(gp.encode_frame(self.reply, req))
        except (OSError, EOFError, ssl.SSLError, gp.ProtocolError):
            pass
        finally:
            with self.lock:
                self.received.append(bytes(got))
            raw.close()

    def sent_to_it(self) -> bytes:
        with self.lock:
            return b"".join(self.received)

    def close(self) -> None:
        self.sock.close()


def reply_of(me: StandIn, fleet: list[StandIn], extra: list[gp.InfoFleetServer] = ()  # type: ignore[assignment]
             ) -> gp.InfoReply:
    """An info reply of server `me` in a fleet of `fleet` (one GPU each)."""
    return gp.InfoReply(
        result=0, major=gp.MAJOR, minor=gp.MINOR, server=f"gpupoold stand-in {me.name}",
        gpus=1, matching=1, free_matching=1, version="0.1.0", host=me.name,
        remoting=me.address, auth="tokens", you_name="tests", you_role="user",
        fingerprint=me.fingerprint,
        fleet_gpus=[gp.InfoFleetGpu(server=s.name, address=s.address, server_state="up",
                                    this=int(s is me), index=0, name="Stand-in GPU",
                                    uuid=f"GPU-{s.name}", memory_total=1 << 30, state="free",
                                    available=1) for s in fleet],
        fleet_servers=[gp.InfoFleetServer(server=s.name, address=s.address, server_state="up",
                                          this=int(s is me), fingerprint=s.fingerprint)
                       for s in fleet] + list(extra))


@pytest.fixture
def stand_ins(tmp_path: Path) -> Iterator[list[StandIn]]:
    made: list[StandIn] = []
    yield made
    for s in made:
        s.close()


def test_nothing_but_the_handshake_before_the_identity_is_settled(
        stand_ins: list[StandIn], tmp_path: Path) -> None:
    a = StandIn(tmp_path, "a")
    stand_ins.append(a)
    a.reply = reply_of(a, [a])
    env = cli_env(tmp_path)
    # No terminal to ask, no --fingerprint: the handshake, then nothing.
    proc = gpupool(env, "login", a.address, "--token", TOKEN)
    assert proc.returncode == 1 and "cannot be confirmed without a terminal" in proc.stderr
    assert a.handshakes == 1 and a.sent_to_it() == b""
    # A --fingerprint that is not its key: the same.
    proc = gpupool(env, "login", a.address, "--token", TOKEN, "--fingerprint",
                   "SHA256:" + "A" * 43)
    assert proc.returncode == 1 and "you gave: nothing was sent" in proc.stderr
    assert a.handshakes == 2 and a.sent_to_it() == b""
    assert not user_file(tmp_path).exists()
    # Its key: the token goes, in an info frame, over a second (pinned) connection.
    proc = gpupool(env, "login", a.address, "--token", TOKEN, "--fingerprint", a.fingerprint)
    assert proc.returncode == 0, proc.stderr
    assert a.handshakes == 4 and TOKEN.encode() in a.sent_to_it()
    assert a.received[-2:][0] == b""  # the identity connection itself: nothing


def test_login_pins_the_fleet_it_lists(stand_ins: list[StandIn], tmp_path: Path) -> None:
    """Server a lists b (TLS, its identity) and c (no identity: plain TCP): b is pinned with the
    same token, c is not; `gpupool status` then reaches b with b's own pin and shows the fleet
    once. A member the file already pins with another key is left as it is, loudly."""
    a, b = StandIn(tmp_path, "a"), StandIn(tmp_path, "b")
    stand_ins += [a, b]
    c_address = "127.0.0.1:9"
    no_tls = gp.InfoFleetServer(server="c", address=c_address, server_state="up", this=0,
                                fingerprint="")
    a.reply = reply_of(a, [a, b], [no_tls])
    b.reply = reply_of(b, [a, b], [no_tls])
    env = cli_env(tmp_path)
    proc = gpupool(env, "login", a.address, "--token", TOKEN, "--fingerprint", a.fingerprint)
    assert proc.returncode == 0, proc.stderr
    assert (f"pinned 1 other server of its fleet, as {a.address} listed them over the pinned "
            f"connection, with the same token: b at {b.address} ({b.fingerprint})") in \
        proc.stdout, proc.stdout
    assert b.handshakes == 0  # learnt from a, not asked
    data, _ = cc.read_file(user_file(tmp_path))
    assert data["servers"] == [
        {"address": a.address, "token": TOKEN, "tls_fingerprint": a.fingerprint},
        {"address": b.address, "token": TOKEN, "tls_fingerprint": b.fingerprint}]

    proc = gpupool(env, "status")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert f"{a.address}: gpupoold stand-in a (protocol {gp.MAJOR}.{gp.MINOR}, TLSv1.3, pinned " \
           "identity)" in out, out
    assert f"{b.address}: gpupoold stand-in b" in out
    assert TOKEN.encode() in b.sent_to_it()  # b was reached, with its pin checked (below)
    assert out.count("Fleet: 2 servers") == 1 and "  Fleet: as above" in out, out

    # Logging in again: b is already pinned with the key a lists.
    proc = gpupool(env, "login", a.address, "--token", TOKEN)
    assert proc.returncode == 0, proc.stderr
    assert f"already pinned in its fleet: b at {b.address}" in proc.stdout

    # The file pins another key for b: never overwritten from a's list, and said loudly.
    other = "SHA256:" + "A" * 43
    data["servers"][1]["tls_fingerprint"] = other
    cc.write_file(user_file(tmp_path), data)
    proc = gpupool(env, "login", a.address, "--token", TOKEN)
    assert proc.returncode == 0, proc.stderr
    assert (f"WARNING: the fleet lists b at {b.address} with the identity {b.fingerprint}, but "
            f"{user_file(tmp_path)} pins {other} for it: left as it is") in proc.stderr
    assert cc.read_file(user_file(tmp_path))[0]["servers"][1]["tls_fingerprint"] == other
    # ... and status refuses b, with nothing sent to it.
    before = len(b.received)
    proc = gpupool(env, "status")
    assert proc.returncode == 1
    assert f"{b.address}: not trusted: WARNING: THE IDENTITY OF SERVER {b.address} HAS " \
           "CHANGED" in proc.stdout, proc.stdout
    assert b.received[before:] == [b""]


def test_a_plain_login_pins_no_fleet(stand_ins: list[StandIn], tmp_path: Path) -> None:
    """Over plain TCP nothing vouches for the reply, so its list of members is not pinned."""
    a, b = StandIn(tmp_path, "a", tls=False), StandIn(tmp_path, "b")
    stand_ins += [a, b]
    a.reply = reply_of(a, [a, b])
    env = cli_env(tmp_path)
    proc = gpupool(env, "login", a.address, "--token", TOKEN, "--plain")
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: plain TCP" in proc.stderr and "fleet" not in proc.stdout
    data, _ = cc.read_file(user_file(tmp_path))
    assert data["servers"] == [{"address": a.address, "token": TOKEN, "tls": False}]
