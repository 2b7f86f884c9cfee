"""Server-to-server links of a spread lease, gpupoold's side (issue 37, item 3): the signed text
of peer_hello for every key type an identity can have (remoting/peer_hello.py), the receiving
server's checks, the rendezvous of a link's peer_hello with its worker's accept and the sending
side's lookup, pinning and TLS close (remoting/peer_links.py) through an in-process listener,
then raw peer_hello frames to a real gpupoold on PostgreSQL, which refuses each with words.

The full path with real workers (h_peer.c) is test_spread_copy's (part C of the design)."""

from __future__ import annotations

import asyncio
import datetime
import os
import re
import socket
import ssl
import time
from pathlib import Path
from typing import Any

import gpupool_protocol as gp
import pytest
from test_info import InProcessDaemon, StandInLeases
from test_usage import new_lease

from gpupoold.remoting import peer_hello as ph
from gpupoold.remoting import peer_links
from gpupoold.remoting.peer_hello import (
    PartServer,
    PeerHelloChecker,
    PeerRefused,
    PeerRequest,
    make_peer_hello,
    signed_text,
    verify,
)
from gpupoold.remoting.peer_links import LinkFailed, PeerIdentity, PeerLinks
from gpupoold.store.database import ServerRegistration, StoreDB
from gpupoold.tls_identity import ensure_identity, fingerprint_of_der_cert, fingerprint_of_pem


# ------------------------------------------------------------------------------ identities
def make_identity(folder: Path, kind: str) -> tuple[Any, bytes, Path, Path]:
    """A key of `kind` and its self-signed certificate (DER), written as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
    from cryptography.x509.oid import NameOID

    key: Any = {"ec": lambda: ec.generate_private_key(ec.SECP384R1()),
                "ed25519": ed25519.Ed25519PrivateKey.generate,
                "ed448": ed448.Ed448PrivateKey.generate,
                "rsa": lambda: rsa.generate_private_key(65537, 2048)}[kind]()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"peer {kind}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .sign(key, None if kind.startswith("ed") else hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / "server.crt", folder / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return key, cert.public_bytes(serialization.Encoding.DER), cert_path, key_path


RECEIVER = "SHA256:" + "B" * 43


@pytest.mark.parametrize("kind", ["ec", "ed25519", "ed448", "rsa"])
def test_the_signed_text_binds_every_field_and_both_servers(tmp_path: Path, kind: str) -> None:
    key, der, _, key_path = make_identity(tmp_path, kind)
    msg = make_peer_hello(ph.load_private_key(key_path.read_bytes()), der, RECEIVER, 7, 0, 1,
                          0xFEED, now=1767225600.25)
    sender = fingerprint_of_der_cert(der)
    text = signed_text(msg, sender, RECEIVER)
    assert text == (b"gpupool peer_hello v1\nto " + RECEIVER.encode() + b"\nfrom "
                    + sender.encode() + b"\nversion %d.%d\nspread_group 7\nfrom_part 0\n"
                    b"to_part 1\nlink_id 65261\ntime 1767225600.250\n" % (gp.MAJOR, gp.MINOR))
    assert verify(der, msg.signature, text)
    # any field changed, or the hello shown to another server: the signature fails
    for field, value in (("spread_group", 8), ("from_part", 1), ("to_part", 0),
                         ("link_id", 0xFEEE), ("time", msg.time + 1)):
        other = gp.PeerHello.decode(msg.encode())
        setattr(other, field, value)
        assert not verify(der, msg.signature, signed_text(other, sender, RECEIVER)), field
    assert not verify(der, msg.signature, signed_text(msg, sender, "SHA256:" + "C" * 43))
    assert not verify(der, b"\0" + msg.signature[1:], text)


def test_the_state_identity_signs_too(tmp_path: Path) -> None:
    """The identity gpupoold makes itself (ECDSA P-256) signs a hello its checker accepts."""
    ident = ensure_identity(tmp_path)
    der = ssl.PEM_cert_to_DER_cert(ident.cert_path.read_text())
    msg = make_peer_hello(ph.load_private_key(ident.key_path.read_bytes()), der, RECEIVER, 1, 0,
                          1, 5)
    assert verify(der, msg.signature, signed_text(msg, ident.fingerprint, RECEIVER))


# ------------------------------------------------------------------------- the checks alone
class Fleet:
    """The store's answers the checker reads: servers, and where each part runs."""

    def __init__(self, sender_fp: str) -> None:
        self.servers = [{"name": "a", "fingerprint": sender_fp, "state": "up"},
                        {"name": "b", "fingerprint": RECEIVER, "state": "up"}]
        self.parts = {(7, 0): PartServer("a", "127.0.0.1:1", sender_fp, True)}
        self.local = {(7, 1): 42}

    async def list_servers(self) -> list[dict[str, Any]]:
        return self.servers

    async def part(self, group: int, part: int) -> PartServer | None:
        return self.parts.get((group, part))

    def checker(self, clock: float = 1000.0) -> PeerHelloChecker:
        return PeerHelloChecker(RECEIVER, self.list_servers, self.part,
                                lambda g, p: self.local.get((g, p)), clock=lambda: clock)


async def refusal(checker: PeerHelloChecker, msg: gp.PeerHello) -> tuple[int, str]:
    with pytest.raises(PeerRefused) as exc:
        await checker.check(msg.encode())
    return exc.value.result, exc.value.message


async def test_the_receiving_checks_refuse_with_words(tmp_path: Path) -> None:
    key, der, _, _ = make_identity(tmp_path / "a", "ec")
    fleet = Fleet(fingerprint_of_der_cert(der))
    checker = fleet.checker()

    def hello(**kw: Any) -> gp.PeerHello:
        fields: dict[str, Any] = {"spread_group": 7, "from_part": 0, "to_part": 1,
                                  "link_id": 11, "now": 1000.0, **kw}
        return make_peer_hello(key, der, RECEIVER, **fields)

    assert await checker.check(hello().encode()) == PeerRequest(42, 7, 0, 1, 11, "a")
    result, words = await refusal(checker, hello())  # the same link again
    assert (result, "already asked for") == (gp.GP_EREFUSED, words[words.index("already"):][:17])
    stranger = make_identity(tmp_path / "x", "ec")
    result, words = await refusal(checker, make_peer_hello(stranger[0], stranger[1], RECEIVER, 7,
                                                           0, 1, 12, now=1000.0))
    assert result == gp.GP_EAUTH and "not a server of this fleet" in words
    forged = hello(link_id=13)
    forged.link_id = 14  # signed for 13
    result, words = await refusal(checker, forged)
    assert result == gp.GP_EAUTH and "not signed by its key" in words
    result, words = await refusal(checker, hello(link_id=15, now=1000.0 - 121))
    assert result == gp.GP_EREFUSED and "synchronise the servers' clocks" in words
    result, words = await refusal(checker, hello(link_id=16, from_part=1))
    assert result == gp.GP_EREFUSED and "server a holds no part 1 of spread lease 7" in words
    result, words = await refusal(checker, hello(link_id=17, to_part=2))
    assert result == gp.GP_EREFUSED and "this server holds no running part 2" in words
    fleet.servers[0]["state"] = "down"  # (authenticated: refused, not a failed login)
    result, words = await refusal(checker, hello(link_id=18))
    assert result == gp.GP_EREFUSED and "marked down" in words
    fleet.servers[0]["name"] = "old"  # the same key twice (a renamed server): the one up
    fleet.servers.append({"name": "a", "fingerprint": fleet.servers[0]["fingerprint"],
                          "state": "up"})
    checker._fleet_at = -1e18
    assert (await checker.check(hello(link_id=18).encode())).sender == "a"
    plain = PeerHelloChecker(None, fleet.list_servers, fleet.part, lambda g, p: 42)
    result, words = await refusal(plain, hello(link_id=19))
    assert result == gp.GP_EREFUSED and "plain TCP" in words


async def test_a_link_id_is_remembered_for_ten_minutes(tmp_path: Path) -> None:
    key, der, _, _ = make_identity(tmp_path, "ed25519")
    fleet = Fleet(fingerprint_of_der_cert(der))
    now = [1000.0]
    checker = PeerHelloChecker(RECEIVER, fleet.list_servers, fleet.part,
                               lambda g, p: fleet.local.get((g, p)), clock=lambda: now[0])
    await checker.check(make_peer_hello(key, der, RECEIVER, 7, 0, 1, 21, now=now[0]).encode())
    now[0] += ph.REPLAY_WINDOW_S - 1
    assert (await refusal(checker, make_peer_hello(key, der, RECEIVER, 7, 0, 1, 21,
                                                   now=now[0])))[0] == gp.GP_EREFUSED
    now[0] += 2  # past the window: that link_id (a fresh hello) is forgotten
    await checker.check(make_peer_hello(key, der, RECEIVER, 7, 0, 1, 21, now=now[0]).encode())


# ------------------------------------------------------------------------- the rendezvous
def links(lease: tuple[int, int] = (7, 1)) -> PeerLinks:
    async def nowhere(group: int, part: int) -> PartServer | None:
        return None
    return PeerLinks("b", None, lambda session: lease if session == 42 else None, nowhere)


async def test_accept_and_peer_hello_meet_in_either_order() -> None:
    broker = links()
    for hello_first in (False, True):
        link = 100 + hello_first
        req = PeerRequest(42, 7, 0, 1, link, "a")
        ours, theirs = socket.socketpair()
        if hello_first:
            arrived = asyncio.ensure_future(broker.arrived(req))
            await asyncio.sleep(0.05)
            accept = asyncio.ensure_future(broker.accept(42, link, 0))
        else:
            accept = asyncio.ensure_future(broker.accept(42, link, 0))
            await asyncio.sleep(0.05)
            arrived = asyncio.ensure_future(broker.arrived(req))
        (await arrived).deliver(os.dup(ours.fileno()))
        fd = await accept
        with socket.socket(fileno=fd) as got:
            theirs.sendall(b"record")
            assert got.recv(6) == b"record"
        ours.close()
        theirs.close()
    assert not broker._waiting


async def test_a_link_nobody_completes_fails_with_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_links, "PEER_ACCEPT_WAIT_S", 0.2)
    broker = links()
    with pytest.raises(LinkFailed, match="no server connected for link 5 from part 0"):
        await broker.accept(42, 5, 0)
    with pytest.raises(PeerRefused, match="the worker of part 1 did not ask for link 6"):
        await broker.arrived(PeerRequest(42, 7, 0, 1, 6, "a"))
    # the worker names another part than the server that connected
    accept = asyncio.ensure_future(broker.accept(42, 8, 3))
    await asyncio.sleep(0.05)
    with pytest.raises(PeerRefused, match="asked for from part 3"):
        await broker.arrived(PeerRequest(42, 7, 0, 1, 8, "a"))
    with pytest.raises(LinkFailed, match="asked for from part 3"):
        await accept
    # an authenticated refusal reaches the waiting worker at once
    accept = asyncio.ensure_future(broker.accept(42, 9, 0))
    await asyncio.sleep(0.05)
    broker.refused(7, 9, "the link was refused here: too late")
    with pytest.raises(LinkFailed, match="too late"):
        await accept
    # plain TCP, an unknown session, a lease not spread
    with pytest.raises(LinkFailed, match="plain TCP"):
        await broker.connect(42, 10, 0)
    with pytest.raises(LinkFailed, match="session 41 is not running"):
        await broker.connect(41, 10, 0)
    with pytest.raises(LinkFailed, match="not spread"):
        await links((0, 0)).accept(42, 10, 0)
    msg, fd = await peer_links.answer(broker, 42, gp.WorkerPeerConnect(session_id=42, link_id=10,
                                                                       to_part=0))
    assert (msg.code, fd) == (peer_links.CUDA_ERROR_NOT_SUPPORTED, None) and "plain" in msg.error
    msg, _ = await peer_links.answer(broker, 42, gp.WorkerPeerAccept(session_id=43, link_id=1))
    assert msg.code == 801 and "session 43, which it does not serve" in msg.error


async def test_a_key_that_cannot_sign_is_said(tmp_path: Path) -> None:
    """A tls_key gpupoold cannot read to sign: the link is refused with the files named,
    before any connection."""
    _, _, cert, key = make_identity(tmp_path, "ec")
    key.write_text("-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n")

    async def there(group: int, part: int) -> PartServer | None:
        return PartServer("b", "127.0.0.1:1", RECEIVER, True)

    broker = PeerLinks("a", PeerIdentity(cert, key, "SHA256:x"), lambda s: (7, 0), there)
    with pytest.raises(LinkFailed, match=re.escape(f"{key}) cannot sign a peer_hello: ")):
        await broker.connect(1, 5, 1)


# --------------------------------------------- both sides through an in-process listener
async def test_a_link_through_a_listener_hands_plain_sockets_to_both_workers(
        tmp_path: Path) -> None:
    """Server a's broker connects to server b's listener (TLS, its pinned key), says a signed
    peer_hello, both close TLS; b's worker's accept gets the other end: what a's worker writes
    arrives as it is (no TLS left on the socket). A wrong registered key is refused with
    words, and so is an address where nothing listens."""
    a_ident, b_ident = ensure_identity(tmp_path / "a"), ensure_identity(tmp_path / "b")
    daemon = await InProcessDaemon(StandInLeases(), tls_cert=b_ident.cert_path,
                                   tls_key=b_ident.key_path).start()
    where = {1: PartServer("b", f"{daemon.host}:{daemon.port}", b_ident.fingerprint, True)}

    async def part_server(group: int, part: int) -> PartServer | None:
        return where.get(part) if group == 7 else None

    async def fleet() -> list[dict[str, Any]]:
        return [{"name": "a", "fingerprint": a_ident.fingerprint, "state": "up"}]

    async def a_part(group: int, part: int) -> PartServer | None:
        return PartServer("a", "127.0.0.1:1", a_ident.fingerprint, True) if part == 0 else None

    sender = PeerLinks("a", PeerIdentity(a_ident.cert_path, a_ident.key_path,
                                         a_ident.fingerprint),
                       lambda s: (7, 0) if s == 1 else None, part_server)
    receiver = PeerLinks("b", None, lambda s: (7, 1) if s == 2 else None, part_server)
    daemon.listener.peer_links = receiver
    daemon.listener.peer_checker = PeerHelloChecker(b_ident.fingerprint, fleet, a_part,
                                                    lambda g, p: 2 if (g, p) == (7, 1) else None)
    try:
        accept = asyncio.ensure_future(peer_links.answer(
            receiver, 2, gp.WorkerPeerAccept(session_id=2, link_id=77, from_part=0)))
        sent, send_fd = await peer_links.answer(
            sender, 1, gp.WorkerPeerConnect(session_id=1, link_id=77, to_part=1))
        got, recv_fd = await asyncio.wait_for(accept, 10)
        assert (sent.code, got.code) == (0, 0), (sent.error, got.error)
        assert send_fd is not None and recv_fd is not None
        with socket.socket(fileno=send_fd) as out, socket.socket(fileno=recv_fd) as into:
            out.sendall(b"\x05\x00\x00\x00first record")
            into.settimeout(10)
            data = b""
            while len(data) < 16:
                data += await asyncio.to_thread(into.recv, 16 - len(data))
            assert data == b"\x05\x00\x00\x00first record"
        assert receiver._counters.get("peer_links", side="accept", result="ok") == 1
        # a wrong registered key: refused before anything is sent
        where[1] = PartServer("b", where[1].remoting, a_ident.fingerprint, True)
        with pytest.raises(LinkFailed, match="registers .* for it: another machine answers"):
            await sender.connect(1, 78, 1)
        closed = socket.create_server(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()
        where[1] = PartServer("b", f"127.0.0.1:{port}", b_ident.fingerprint, True)
        with pytest.raises(LinkFailed, match=f"127.0.0.1:{port}\\) could not be reached from this "
                           "server: .*open the remoting port between the fleet's servers"):
            await sender.connect(1, 79, 1)
        # a peer_hello the receiving server refuses: the sender hears its words
        where[1] = PartServer("b", f"{daemon.host}:{daemon.port}", b_ident.fingerprint, True)
        with pytest.raises(LinkFailed, match="refused the link \\(GP_EREFUSED\\): this server "
                           "holds no running part 1"):
            receiver._lease_part = lambda s: None
            daemon.listener.peer_checker._local_part = lambda g, p: None
            await sender.connect(1, 80, 1)
    finally:
        await daemon.listener.close()


# ------------------------------------------------------------------------ a real gpupoold
def _peer_frame(server: Any, msg: gp.PeerHello, tls: bool = True) -> gp.PeerHelloReply:
    sock: Any = socket.create_connection((server.host, server.port), timeout=20)
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        sock = ctx.wrap_socket(sock)
    with sock:
        sock.sendall(gp.encode_frame(msg, 3))
        head = b""
        while len(head) < gp.HEADER.size:
            head += sock.recv(gp.HEADER.size - len(head))
        length, op, flags, req = gp.HEADER.unpack(head)
        body = b""
        while len(body) < length:
            body += sock.recv(length - len(body))
        assert (op, bool(flags & gp.FLAG_REPLY), req) == (gp.PeerHello.OP, True, 3)
        return gp.PeerHelloReply.decode(body)


def test_a_real_gpupoold_refuses_peer_hellos_with_words(
        start_daemon: Any, native_build: Path, pg_url: str, tmp_path: Path) -> None:
    """gpupoold on TLS in a fleet (PostgreSQL) where a registered server `a` holds part 0 of
    spread lease 7 (its rows written here): each wrong peer_hello is refused with words; a plain
    TCP gpupoold refuses any."""
    b = start_daemon("--database", pg_url, simulated=1, build_dir=native_build)
    b_fp = fingerprint_of_pem((b.state_dir / "identity" / "server.crt").read_bytes())
    key, der, _, _ = make_identity(tmp_path / "a", "ec")
    a = StoreDB(pg_url, server="a")
    try:
        a.server_up("127.0.0.1:1", "", time.time(), ServerRegistration(
            fingerprint=fingerprint_of_der_cert(der)))
        a.lease_started(new_lease("alice"), spread=(7, 0, 2))

        def hello(link: int, **kw: Any) -> gp.PeerHello:
            fields: dict[str, Any] = {"spread_group": 7, "from_part": 0, "to_part": 1,
                                      "link_id": link, **kw}
            return make_peer_hello(key, der, b_fp, **fields)

        stranger = make_identity(tmp_path / "x", "ed25519")
        cases = [
            (make_peer_hello(stranger[0], stranger[1], b_fp, 7, 0, 1, 1), gp.GP_EAUTH,
             "is not a server of this fleet"),
            (make_peer_hello(key, der, RECEIVER, 7, 0, 1, 2), gp.GP_EAUTH,
             "not signed by its key, or not for this server"),
            (hello(3, now=time.time() - 600), gp.GP_EREFUSED, "synchronise the servers' clocks"),
            (hello(4, spread_group=8), gp.GP_EREFUSED, "server a holds no part 0 of spread "
             "lease 8"),
            (hello(5), gp.GP_EREFUSED, "this server holds no running part 1 of spread lease 7"),
            (hello(5), gp.GP_EREFUSED, "link 5 of server a was already asked for"),
        ]
        for msg, result, words in cases:
            reply = _peer_frame(b, msg)
            assert (reply.result, words in reply.message) == (result, True), reply.message
        b.wait_for_log(r"peer_hello refused \(GP_EAUTH\): the key", timeout=10)
        plain = start_daemon(simulated=1, build_dir=native_build, tls=False)
        reply = _peer_frame(plain, hello(6), tls=False)
        assert reply.result == gp.GP_EREFUSED and "plain TCP" in reply.message
    finally:
        a.close()


def checker_of_no_fleet(fingerprint: str) -> PeerHelloChecker:
    """The receiving checks of a server whose fleet knows no other server and no part: every
    peer_hello's key is unknown."""
    async def fleet() -> list[dict[str, Any]]:
        return []

    async def nowhere(group: int, part: int) -> PartServer | None:
        return None

    return PeerHelloChecker(fingerprint, fleet, nowhere, lambda g, p: None)


async def test_unknown_keys_count_as_failed_logins(tmp_path: Path) -> None:
    """peer_hellos refused for their key count towards the address's failed logins (as bad
    tokens do), and a blocked address's next one is refused before any check."""
    b_ident = ensure_identity(tmp_path / "b")
    daemon = await InProcessDaemon(StandInLeases(), tls_cert=b_ident.cert_path,
                                   tls_key=b_ident.key_path,
                                   login_failures_per_address=2).start()

    daemon.listener.peer_links = links()
    daemon.listener.peer_checker = checker_of_no_fleet(b_ident.fingerprint)
    key, der, _, _ = make_identity(tmp_path / "x", "ec")
    try:
        said = [await asyncio.to_thread(_peer_frame, daemon, make_peer_hello(
            key, der, b_ident.fingerprint, 7, 0, 1, n)) for n in range(3)]
        assert [r.result for r in said] == [gp.GP_EAUTH] * 3
        assert "not a server of this fleet" in said[1].message
        assert "too many refused logins or peer_hellos from 127.0.0.1" in said[2].message
    finally:
        await daemon.listener.close()


# ------------------------------------------------------------- review fixes (issue 37, item 3)
async def test_a_key_cryptography_cannot_use_is_refused_with_words_and_counted(
        tmp_path: Path) -> None:
    """A certificate whose key type cryptography does not know (UnsupportedAlgorithm, not
    ValueError) is GP_EAUTH with words, counted as a failed login, never a traceback."""
    b_ident = ensure_identity(tmp_path / "b")
    daemon = await InProcessDaemon(StandInLeases(), tls_cert=b_ident.cert_path,
                                   tls_key=b_ident.key_path,
                                   login_failures_per_address=1).start()
    _, der, _, _ = make_identity(tmp_path / "x", "ec")
    secp384r1 = bytes.fromhex("06052b81040022")
    odd = der.replace(secp384r1, bytes.fromhex("06052b8104007f"))  # a curve nobody knows
    assert odd != der
    msg = gp.PeerHello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, spread_group=7,
                       from_part=0, to_part=1, link_id=3, time=time.time(), certificate=odd,
                       signature=b"x" * 64)

    daemon.listener.peer_links = links()
    daemon.listener.peer_checker = checker_of_no_fleet(b_ident.fingerprint)
    try:
        first, second = [await asyncio.to_thread(_peer_frame, daemon, msg) for _ in range(2)]
        assert first.result == gp.GP_EAUTH and "certificate cannot be read" in first.message
        assert "UnsupportedAlgorithm" in first.message
        assert "too many refused logins" in second.message  # the first one counted
    finally:
        await daemon.listener.close()


async def test_the_fleet_is_read_once_for_many_hellos(tmp_path: Path) -> None:
    """Unauthenticated peer_hellos cost no store round trip each: the servers are read at most
    every FLEET_TTL_S, and a key they do not know reads them again at most every FLEET_MISS_S."""
    key, der, _, _ = make_identity(tmp_path / "a", "ec")
    fleet = Fleet(fingerprint_of_der_cert(der))
    stranger = make_identity(tmp_path / "x", "ec")
    reads = [0]
    now = [0.0]

    async def counted() -> list[dict[str, Any]]:
        reads[0] += 1
        return list(fleet.servers)

    checker = PeerHelloChecker(RECEIVER, counted, fleet.part,
                               lambda g, p: fleet.local.get((g, p)), clock=lambda: 1000.0,
                               monotonic=lambda: now[0])
    for n in range(20):
        assert (await refusal(checker, make_peer_hello(stranger[0], stranger[1], RECEIVER, 7, 0,
                                                       1, n, now=1000.0)))[0] == gp.GP_EAUTH
    assert reads[0] == 1
    now[0] += ph.FLEET_MISS_S  # a miss reads again, once
    await refusal(checker, make_peer_hello(stranger[0], stranger[1], RECEIVER, 7, 0, 1, 99,
                                           now=1000.0))
    await checker.check(make_peer_hello(key, der, RECEIVER, 7, 0, 1, 100, now=1000.0).encode())
    assert reads[0] == 2
    now[0] += ph.FLEET_TTL_S  # a known key: read again once they are old
    await checker.check(make_peer_hello(key, der, RECEIVER, 7, 0, 1, 101, now=1000.0).encode())
    assert reads[0] == 3


async def test_link_ids_are_the_leases_own(tmp_path: Path) -> None:
    """Two leases' links of one id: neither a replay of the other, and a refusal of one never
    fails the other's waiting worker."""
    key, der, _, _ = make_identity(tmp_path / "a", "ec")
    fleet = Fleet(fingerprint_of_der_cert(der))
    fleet.parts[(8, 0)] = fleet.parts[(7, 0)]
    fleet.local[(8, 1)] = 43
    checker = fleet.checker()
    for group in (7, 8):
        await checker.check(make_peer_hello(key, der, RECEIVER, group, 0, 1, 5,
                                            now=1000.0).encode())
    broker = PeerLinks("b", None, lambda s: {42: (7, 1), 43: (8, 1)}.get(s), Fleet.part)
    seven = asyncio.ensure_future(broker.accept(42, 5, 0))
    eight = asyncio.ensure_future(broker.accept(43, 5, 0))
    await asyncio.sleep(0.05)
    broker.refused(8, 5, "the link was refused here: no")
    with pytest.raises(LinkFailed, match="no"):
        await eight
    assert not seven.done()
    broker.lease_ended(42)
    with pytest.raises(LinkFailed, match="the lease ended"):
        await seven


async def test_a_lease_end_releases_both_halves_at_once() -> None:
    """lease_ended fails the worker's accept and the peer_hello waiting for it (which gives
    its handshake place back) without their waits running out."""
    broker = links()
    accept = asyncio.ensure_future(broker.accept(42, 5, 0))
    hello = asyncio.ensure_future(broker.arrived(PeerRequest(42, 7, 0, 1, 6, "a")))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    broker.lease_ended(42)
    with pytest.raises(LinkFailed, match="the lease ended"):
        await asyncio.wait_for(accept, 2)
    with pytest.raises(PeerRefused, match="link 6: the lease ended"):
        await asyncio.wait_for(hello, 2)
    assert time.monotonic() - started < peer_links.PEER_ACCEPT_WAIT_S / 2
    assert not broker._waiting


async def test_an_accept_waits_one_deadline_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer_hello came, and the TLS session never ends: the worker's accept gives up at
    ACCEPT_DEADLINE_S from its request, not a second full wait later."""
    monkeypatch.setattr(peer_links, "PEER_ACCEPT_WAIT_S", 0.4)
    monkeypatch.setattr(peer_links, "ACCEPT_DEADLINE_S", 0.5)
    broker = links()
    started = time.monotonic()
    accept = asyncio.ensure_future(broker.accept(42, 5, 0))
    await asyncio.sleep(0.3)
    await broker.arrived(PeerRequest(42, 7, 0, 1, 5, "a"))  # ...and never delivered
    with pytest.raises(LinkFailed, match="not handed over within 0.5 s"):
        await accept
    assert time.monotonic() - started < 0.7 + 0.5  # 0.3 + 0.4 would be the old second wait


def test_a_dial_has_one_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that takes the connection and never speaks TLS: the dial ends at its one
    deadline, and says it connected (not "open the remoting port")."""
    monkeypatch.setattr(peer_links, "DIAL_DEADLINE_S", 0.5)
    mute = socket.create_server(("127.0.0.1", 0))
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        started = time.monotonic()
        with pytest.raises(peer_links.DialBroken, match="not set up within 0.5 s"):
            peer_links._dial(f"127.0.0.1:{mute.getsockname()[1]}", RECEIVER, ctx,
                             lambda: gp.PeerHello())
        assert time.monotonic() - started < 5
    finally:
        mute.close()


async def test_a_restart_keeps_a_spread_part_a_part(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A part of a spread lease taken over after a restart is still that part (its links find
    it by spread_group and part)."""
    import dataclasses

    from test_leases import FakeCleaner, FakeStore, FakeWorker, make_gpu
    from test_takeover_multi_gpu import LEASE, PreviousWorkers, record, until

    from gpupoold.config.settings import Settings
    from gpupoold.gpu.inventory import Inventory
    from gpupoold.pool.counters import Counters
    from gpupoold.pool.leases import LeaseManager

    for module in ("gpupoold.pool.leases", "gpupoold.pool.takeover"):
        monkeypatch.setattr(f"{module}.Worker", FakeWorker)
    inventory = [make_gpu(i) for i in range(2)]
    rec = dataclasses.replace(record((0,), inventory[0]), spread_group=9, part=1, parts=2)
    m = LeaseManager(Inventory(tuple(inventory)), Settings(state_dir=tmp_path),
                     FakeStore(open=[rec], events={}),  # type: ignore[arg-type]
                     PreviousWorkers(inventory[0].uuid), FakeCleaner(),  # type: ignore[arg-type]
                     Counters())
    await m.start()
    try:
        await until("the part taken over", lambda: m.pool.lease(LEASE) is not None)
        lease = m.pool.lease(LEASE)
        assert lease is not None
        assert (lease.req.spread_group, lease.req.part, lease.req.parts) == (9, 1, 2)
    finally:
        await m.close(0.1)


# ------------------------------------------- the worker supervisor at the control socket
class _Proc:
    pid = 4321

    def forget(self) -> None:
        pass


class _Broker:
    """PeerLinks as the supervisor sees it: each answer waits for `go`, then gives the link's
    socket (one end of a socketpair; `far` keeps the other)."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.asked: list[tuple[int | None, Any]] = []
        self.far: list[socket.socket] = []

    async def answer(self, session_id: int | None, ev: Any) -> tuple[Any, int | None]:
        self.asked.append((session_id, ev))
        await self.go.wait()
        near, far = socket.socketpair()
        self.far.append(far)
        fd = os.dup(near.fileno())
        near.close()
        return gp.WorkerPeerConnected(session_id=ev.session_id, link_id=ev.link_id, code=0,
                                      error=""), fd


def _worker(sup: Any, session: int = 42) -> tuple[Any, socket.socket]:
    """A supervisor's Worker on one end of a control socketpair (the test is the worker)."""
    from gpupoold.gpu.inventory import Gpu
    from gpupoold.workers.supervisor import Worker

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    w = Worker(sup, Gpu(index=0, name="sim", uuid="", simulated=True, driver="", ordinal=0),
               _Proc(), ours, -1, time.monotonic())  # type: ignore[arg-type]
    w.session_id = session
    return w, theirs


def _answer(sock: socket.socket) -> tuple[Any, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
    length, op, _, _ = gp.parse_header(data[:gp.HEADER.size], gp.MAX_BODY)
    return gp.REQUESTS[op].decode(data[gp.HEADER.size:]), fds


async def test_the_supervisor_passes_link_requests_and_caps_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """worker_peer_connect on a control socket is decoded, goes to the broker, and its answer
    comes back with the socket, the daemon's copy closed; beyond 4 requests of a worker (and
    PEER_REQUESTS_IN_ALL of all) at once, the next is refused at once with words."""
    from gpupoold.workers import supervisor as sv

    monkeypatch.setattr(sv, "PEER_REQUESTS_IN_ALL", 6)
    sup = sv.WorkerSupervisor(None, tmp_path)
    broker = _Broker()
    sup.peer_links = broker
    one, one_end = _worker(sup, 42)
    two, two_end = _worker(sup, 43)
    one_end.settimeout(5)
    two_end.settimeout(5)
    tasks = [asyncio.ensure_future(w._read_control()) for w in (one, two)]
    try:
        for link in range(5):
            one_end.send(gp.encode_frame(gp.WorkerPeerConnect(session_id=42, link_id=link,
                                                              to_part=1)))
        refused, fds = await asyncio.to_thread(_answer, one_end)  # the 5th, at once
        assert (refused.link_id, refused.code, fds) == (4, 801, [])
        assert "too many link requests: this worker has 4" in refused.error
        for link in range(3):
            two_end.send(gp.encode_frame(gp.WorkerPeerConnect(session_id=43, link_id=link,
                                                              to_part=1)))
        refused, _ = await asyncio.to_thread(_answer, two_end)
        assert refused.link_id == 2 and "this server answers 6 at once" in refused.error
        assert len(broker.asked) == 6 and broker.asked[0][0] == 42
        broker.go.set()
        answers = [await asyncio.to_thread(_answer, one_end) for _ in range(4)]
        assert sorted(a.link_id for a, _ in answers) == [0, 1, 2, 3]
        assert all(a.code == 0 and len(fds) == 1 for a, fds in answers)
        for _, fds in answers:
            os.close(fds[0])  # the worker's copy closed: the far end sees the end, as the
        for far in broker.far[:4]:  # daemon's copy was closed after sending
            far.settimeout(5)
            assert far.recv(1) == b""
    finally:
        for t in tasks:
            t.cancel()
        for w in (one, two):
            for t in list(w._peer_tasks):
                t.cancel()
        await asyncio.sleep(0)
        for far in broker.far:
            far.close()
        for sock in (one_end, two_end, one._sock, two._sock):
            sock.close()


async def test_an_answer_the_worker_does_not_read_is_dropped_and_its_socket_closed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpupoold.workers import supervisor as sv

    monkeypatch.setattr(sv, "PEER_ANSWER_SEND_S", 0.3)
    sup = sv.WorkerSupervisor(None, tmp_path)
    broker = _Broker()
    broker.go.set()
    sup.peer_links = broker
    w, end = _worker(sup)
    while True:  # the worker reads nothing: its control socket is full
        try:
            w._sock.send(b"x" * 4096)
        except BlockingIOError:
            break
    task = asyncio.ensure_future(w._read_control())
    try:
        end.send(gp.encode_frame(gp.WorkerPeerConnect(session_id=42, link_id=1, to_part=1)))
        await until_true(lambda: broker.far and not w._peer_tasks, 5)
        broker.far[0].settimeout(5)
        assert broker.far[0].recv(1) == b""  # nobody holds the link's socket any more
    finally:
        task.cancel()
        end.close()
        w._sock.close()
        for far in broker.far:
            far.close()


async def test_concurrent_sends_on_a_full_control_socket_all_go(tmp_path: Path) -> None:
    """Two answers waiting for room at once both go once the worker reads (one waiter each,
    not one replacing the other's wake-up)."""
    from gpupoold.workers import supervisor as sv

    w, end = _worker(sv.WorkerSupervisor(None, tmp_path))
    filler = 0
    while True:
        try:
            w._sock.send(b"x" * 4096)
            filler += 1
        except BlockingIOError:
            break
    sends = [asyncio.ensure_future(w._send(bytes([n]) * 100, [])) for n in (1, 2)]
    await asyncio.sleep(0.1)
    assert not any(s.done() for s in sends)
    try:
        got = []
        end.settimeout(5)
        while len(got) < filler + 2:
            got.append(await asyncio.to_thread(end.recv, 8192))
        await asyncio.wait_for(asyncio.gather(*sends), 5)
        assert sorted(g[:1] for g in got[filler:]) == [b"\x01", b"\x02"]
    finally:
        for s in sends:
            s.cancel()
        end.close()
        w._sock.close()


async def until_true(check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.02)


async def test_a_tls_client_certificate_asked_for_must_be_the_hellos_key(tmp_path: Path) -> None:
    """With tls_client_ca the listener passes the TLS client certificate's key: another key
    than the one that signed the hello is GP_EAUTH; None (not asked) leaves the signature
    alone to authenticate."""
    key, der, _, _ = make_identity(tmp_path / "a", "ec")
    fp = fingerprint_of_der_cert(der)
    checker = Fleet(fp).checker()

    def hello(link: int) -> bytes:
        return make_peer_hello(key, der, RECEIVER, 7, 0, 1, link, now=1000.0).encode()

    with pytest.raises(PeerRefused, match="its TLS client certificate is none") as exc:
        await checker.check(hello(1), "none")
    assert exc.value.result == gp.GP_EAUTH
    assert (await checker.check(hello(2), fp)).sender_fp == fp
    assert (await checker.check(hello(3), None)).link_id == 3


def test_what_failed_after_the_connection_is_said(tmp_path: Path) -> None:
    """A server that accepts and closes at once: the dial says the other closed it (not "open
    the remoting port"). A certificate file with text before its PEM block still loads."""
    ident = ensure_identity(tmp_path / "a")
    closer = socket.create_server(("127.0.0.1", 0))
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE

        def close_one() -> None:
            conn, _ = closer.accept()
            conn.close()

        import threading
        t = threading.Thread(target=close_one)
        t.start()
        with pytest.raises(peer_links.DialBroken) as exc:
            peer_links._dial(f"127.0.0.1:{closer.getsockname()[1]}", RECEIVER, ctx,
                             lambda: gp.PeerHello())
        t.join()
        assert "open the remoting port" not in str(exc.value)
        assert "closed" in str(exc.value) or "EOF" in str(exc.value), str(exc.value)
    finally:
        closer.close()
    texted = tmp_path / "texted.crt"
    texted.write_bytes(b"Certificate:\n    Data: (as openssl x509 -text writes)\n"
                       + ident.cert_path.read_bytes())
    _, der, _ = peer_links._load_identity(PeerIdentity(texted, ident.key_path, ident.fingerprint))
    assert fingerprint_of_der_cert(der) == ident.fingerprint


def test_an_idle_detached_part_takes_links() -> None:
    """The receiving check's `local_part` (app.py): a part whose lease is idle-detached has no
    slot, and its worker lives and takes the link; a part whose worker has exited does not."""
    from types import SimpleNamespace

    from aiohttp import web

    from gpupoold import app as daemon_app
    from gpupoold.http.keys import LEASES, STORE
    from gpupoold.pool.requirements import Requirements

    loop = asyncio.new_event_loop()
    try:
        alive, gone = loop.create_future(), loop.create_future()
        gone.set_result(None)
        detached = SimpleNamespace(id=5, slot=None, worker=SimpleNamespace(exited=alive),
                                   req=Requirements(spread_group=7, part=1, parts=2))
        ended = SimpleNamespace(id=6, slot=object(), worker=SimpleNamespace(exited=gone),
                                req=Requirements(spread_group=8, part=1, parts=2))
        app = web.Application()
        app[STORE] = SimpleNamespace(servers=None)  # type: ignore[assignment]
        app[LEASES] = SimpleNamespace(  # type: ignore[assignment]
            pool=SimpleNamespace(active=lambda: [detached, ended]))
        checker = daemon_app.peer_checker(app)
        assert checker._local_part(7, 1) == 5
        assert checker._local_part(8, 1) is None
    finally:
        loop.close()


async def test_dials_beyond_their_threads_and_queue_are_busy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every dial thread and queue place taken (a server that never speaks TLS), the next
    link request is refused at once ("busy"); the one dialling ends by its deadline."""
    monkeypatch.setattr(peer_links, "DIAL_THREADS", 1)
    monkeypatch.setattr(peer_links, "DIAL_QUEUE", 0)
    monkeypatch.setattr(peer_links, "DIAL_DEADLINE_S", 1.0)
    ident = ensure_identity(tmp_path / "a")
    mute = socket.create_server(("127.0.0.1", 0))

    async def there(group: int, part: int) -> PartServer | None:
        return PartServer("b", f"127.0.0.1:{mute.getsockname()[1]}", RECEIVER, True)

    broker = PeerLinks("a", PeerIdentity(ident.cert_path, ident.key_path, ident.fingerprint),
                       lambda s: (7, 0), there)
    try:
        first = asyncio.ensure_future(broker.connect(1, 5, 1))
        await until_true(lambda: broker._dialing == 1, 5)
        started = time.monotonic()
        with pytest.raises(LinkFailed, match="busy making 1 links"):
            await broker.connect(1, 6, 1)
        assert time.monotonic() - started < 0.5
        with pytest.raises(LinkFailed, match="the link to server b .* not set up within 1 s"):
            await first
    finally:
        broker.close()
        mute.close()
