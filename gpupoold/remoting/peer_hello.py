"""peer_hello: how one server of a fleet asks another for a link between two parts of a spread
lease (issue 37, item 3; docs/protocol.md, "Server-to-server links").

Both sides live here, so that the signed text is written once: the sending gpupoold builds and
signs the frame (`make_peer_hello`, called by remoting/peer_links.py), the receiving gpupoold's
listener checks it (`PeerHelloChecker`). The signature is by the sender's remoting TLS key over
`signed_text`: the fields in a fixed text form and both servers' fingerprints, so that a hello
can be replayed neither to another server nor, within its time window, for another link
(link_id is remembered for REPLAY_WINDOW_S).

The checks, in order: the listener speaks TLS; the frame decodes (magic, major version); the
certificate's key is a server of the fleet (servers table, kept in memory: FLEET_TTL_S) and
signed the text (GP_EAUTH otherwise, which counts as a failed login); that server is up; the
time is within CLOCK_SKEW_S of ours; link_id is new for that spread_group; that server holds
part from_part of spread_group (an open lease there); this server holds part to_part with a live
worker (GP_EREFUSED otherwise).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import gpupool_protocol as gp

from gpupoold.remoting.handshake import Refusal, parse_first_frame
from gpupoold.tls_identity import fingerprint_of_der_cert, fingerprints_equal

log = logging.getLogger(__name__)

SIGNED_PREFIX = b"gpupool peer_hello v1\n"
CLOCK_SKEW_S = 120.0  # the most the two servers' clocks may differ
REPLAY_WINDOW_S = 600.0  # a link_id is refused again for this long
MAX_REMEMBERED = 100_000  # link_ids remembered at most (the oldest forgotten first)
FLEET_TTL_S = 5.0  # the fleet's servers, as the checks know them, are at most this old...
FLEET_MISS_S = 2.0  # ...and a key they do not know reads them again at most this often
PLAIN_TCP = ("servers on plain TCP (tls = \"off\") make no links between them: turn TLS on on "
             "both for copies from server to server")


@dataclass(frozen=True)
class PartServer:
    """Where a part of a spread lease runs: its server's name and registration (servers table)."""

    server: str
    remoting: str
    fingerprint: str
    up: bool


@dataclass(frozen=True)
class PeerRequest:
    """An accepted peer_hello: the link the sending server asks for, to the local lease."""

    lease_id: int
    spread_group: int
    from_part: int
    to_part: int
    link_id: int
    sender: str  # the sending server's name
    sender_fp: str = field(default="", compare=False)  # its key's fingerprint


class PeerRefused(Exception):
    """A peer_hello refused (`result`: GP_EAUTH or GP_EREFUSED; the message says why)."""

    def __init__(self, result: int, message: str, link_id: int | None = None,
                 spread_group: int = 0) -> None:
        super().__init__(message)
        self.result = result
        self.message = message
        self.link_id = link_id  # set once the sender is authenticated (its worker may hear why)
        self.spread_group = spread_group  # (with link_id) the lease whose link it was


def signed_text(msg: gp.PeerHello, sender_fp: str, receiver_fp: str) -> bytes:
    """The bytes the sender signs and the receiver verifies (docs/protocol.md): the prefix, then
    one `name value` line each, in this order; time with 3 decimals."""
    lines = (f"to {receiver_fp}", f"from {sender_fp}", f"version {msg.major}.{msg.minor}",
             f"spread_group {msg.spread_group}", f"from_part {msg.from_part}",
             f"to_part {msg.to_part}", f"link_id {msg.link_id}", f"time {msg.time:.3f}")
    return SIGNED_PREFIX + "".join(line + "\n" for line in lines).encode()


def load_private_key(pem: bytes) -> Any:
    """The remoting identity's private key (EC, Ed25519, Ed448 or RSA); ValueError otherwise."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa

    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, (ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey,
                            ed448.Ed448PrivateKey, rsa.RSAPrivateKey)):
        raise ValueError(f"a {type(key).__name__} cannot sign a peer_hello (EC, Ed25519, Ed448 "
                         "or RSA keys can)")
    return key


def sign(key: Any, data: bytes) -> bytes:
    """Signature of `data` by `key` (load_private_key): ECDSA or RSA-PSS with SHA-256, EdDSA."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    if isinstance(key, ec.EllipticCurvePrivateKey):
        return bytes(key.sign(data, ec.ECDSA(hashes.SHA256())))
    if isinstance(key, rsa.RSAPrivateKey):
        return bytes(key.sign(data, _pss(), hashes.SHA256()))
    return bytes(key.sign(data))


def verify(cert_der: bytes, signature: bytes, data: bytes) -> bool:
    """Whether `signature` over `data` is by the key of the DER certificate `cert_der`."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa

    try:
        public = x509.load_der_x509_certificate(cert_der).public_key()
        if isinstance(public, ec.EllipticCurvePublicKey):
            public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public, rsa.RSAPublicKey):
            public.verify(signature, data, _pss(), hashes.SHA256())
        elif isinstance(public, (ed25519.Ed25519PublicKey, ed448.Ed448PublicKey)):
            public.verify(signature, data)
        else:
            return False
        return True
    except Exception as exc:  # a bad signature, or a key cryptography cannot use
        if not isinstance(exc, (InvalidSignature, ValueError, TypeError)):
            log.info("peer_hello: the certificate's key cannot verify a signature (%s: %s)",
                     type(exc).__name__, exc)
        return False


def _pss() -> Any:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    return padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32)


def make_peer_hello(key: Any, cert_der: bytes, receiver_fp: str, spread_group: int,
                    from_part: int, to_part: int, link_id: int,
                    now: float | None = None) -> gp.PeerHello:
    """The signed peer_hello of the sending server (its key and certificate)."""
    msg = gp.PeerHello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR,
                       spread_group=spread_group, from_part=from_part, to_part=to_part,
                       link_id=link_id, time=time.time() if now is None else now,
                       certificate=cert_der)
    msg.signature = sign(key, signed_text(msg, fingerprint_of_der_cert(cert_der), receiver_fp))
    return msg


class PeerHelloChecker:
    """The receiving server's checks of a peer_hello. `fingerprint`: this server's own (None:
    plain TCP, every peer_hello refused); `servers()`: the fleet's servers (the store's rows);
    `part_server(group, part)`: where a part runs (None: nowhere); `local_part(group, part)`: the
    id of this server's lease of that part with a live worker, or None.

    The servers are read from the store at most every FLEET_TTL_S (a key not among them: again
    after FLEET_MISS_S), so that a stranger's peer_hellos cost no store round trip each."""

    def __init__(self, fingerprint: str | None,
                 servers: Callable[[], Awaitable[list[dict[str, Any]]]],
                 part_server: Callable[[int, int], Awaitable[PartServer | None]],
                 local_part: Callable[[int, int], int | None],
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.fingerprint = fingerprint
        self._servers = servers
        self._part_server = part_server
        self._local_part = local_part
        self._clock = clock
        self._monotonic = monotonic
        # (spread_group, link_id) -> when it was first accepted (insertion order)
        self._seen: dict[tuple[int, int], float] = {}
        self._fleet: list[dict[str, Any]] = []
        self._fleet_at = -1e18  # monotonic time of the last read
        self._fleet_lock = asyncio.Lock()

    async def _sender(self, sender_fp: str) -> dict[str, Any] | None:
        """The servers row of the fleet with key `sender_fp` (the one that is up, if two
        claim it); None: no server of the fleet has it."""
        found = self._named(sender_fp)
        age = self._monotonic() - self._fleet_at
        if age >= FLEET_TTL_S or (found is None and age >= FLEET_MISS_S):
            async with self._fleet_lock:  # one read for all the hellos that come meanwhile
                if self._monotonic() - self._fleet_at >= min(age, FLEET_MISS_S):
                    self._fleet = list(await self._servers())
                    self._fleet_at = self._monotonic()
            found = self._named(sender_fp)
        return found

    def _named(self, sender_fp: str) -> dict[str, Any] | None:
        named = [s for s in self._fleet if s.get("fingerprint")
                 and fingerprints_equal(s["fingerprint"], sender_fp)]
        named.sort(key=lambda s: s.get("state") != "up")
        return named[0] if named else None

    async def check(self, body: bytes, tls_client_fp: str | None = None) -> PeerRequest:
        """The link a peer_hello asks for; PeerRefused saying why not. `tls_client_fp`: the
        fingerprint of the TLS client certificate, where the listener asked for one
        (tls_client_ca): it must be the hello's own (None: not asked; the signature alone
        authenticates)."""
        if not self.fingerprint:
            raise PeerRefused(gp.GP_EREFUSED, "this server speaks plain TCP: " + PLAIN_TCP)
        msg = parse_first_frame(body, gp.PeerHello, "peer_hello", "gpupoold version")
        if isinstance(msg, Refusal):
            raise PeerRefused(msg.result, msg.message)
        try:
            sender_fp = fingerprint_of_der_cert(bytes(msg.certificate))
        except Exception as exc:  # not a certificate, or a key type cryptography does not know
            raise PeerRefused(gp.GP_EAUTH, "the peer_hello's certificate cannot be read "
                              f"({type(exc).__name__}: {exc}); a server's TLS identity is an EC, "
                              "Ed25519, Ed448 or RSA key") from None
        sender = await self._sender(sender_fp)
        if sender is None:
            raise PeerRefused(gp.GP_EAUTH, f"the key {sender_fp} is not a server of this fleet "
                              "(no server registered it in the fleet's database)")
        text = signed_text(msg, sender_fp, self.fingerprint)
        if not verify(bytes(msg.certificate), bytes(msg.signature), text):
            raise PeerRefused(gp.GP_EAUTH, f"the peer_hello of server {sender['name']} is not "
                              "signed by its key, or not for this server")
        if tls_client_fp is not None and not fingerprints_equal(tls_client_fp, sender_fp):
            raise PeerRefused(gp.GP_EAUTH, f"server {sender['name']} signed the peer_hello with "
                              f"{sender_fp}, and its TLS client certificate is {tls_client_fp}: "
                              "a server's tls_cert must be its client certificate too")
        if sender.get("state") != "up":  # (authenticated: no failed login)
            raise PeerRefused(gp.GP_EREFUSED, f"server {sender['name']} ({sender_fp}) is marked "
                              "down in the fleet's database; links to it wait until it is up")
        now = self._clock()
        if not abs(now - msg.time) <= CLOCK_SKEW_S:
            raise PeerRefused(gp.GP_EREFUSED, f"the peer_hello of server {sender['name']} is "
                              f"dated {msg.time - now:+.0f} s from this server's clock (at most "
                              f"{CLOCK_SKEW_S:g} s apart): synchronise the servers' clocks (NTP)")
        self._remember(msg.spread_group, msg.link_id, sender["name"], now)
        where = await self._part_server(msg.spread_group, msg.from_part)
        if where is None or where.server != sender["name"]:
            raise PeerRefused(gp.GP_EREFUSED, f"server {sender['name']} holds no part "
                              f"{msg.from_part} of spread lease {msg.spread_group}"
                              + (f" (server {where.server} does)" if where else ""), msg.link_id,
                              msg.spread_group)
        lease_id = self._local_part(msg.spread_group, msg.to_part)
        if lease_id is None:
            raise PeerRefused(gp.GP_EREFUSED, f"this server holds no running part {msg.to_part} "
                              f"of spread lease {msg.spread_group}", msg.link_id,
                              msg.spread_group)
        return PeerRequest(lease_id, msg.spread_group, msg.from_part, msg.to_part, msg.link_id,
                           sender["name"], sender_fp)

    def _remember(self, group: int, link_id: int, sender: str, now: float) -> None:
        """Refuse a link_id of that spread lease seen within REPLAY_WINDOW_S; remember it
        otherwise (another lease's link of the same id is not a replay: the ids are the
        clients')."""
        while self._seen:  # oldest first: stop at the first one kept
            old, when = next(iter(self._seen.items()))
            if now - when <= REPLAY_WINDOW_S and len(self._seen) < MAX_REMEMBERED:
                break
            del self._seen[old]
        if (group, link_id) in self._seen:
            raise PeerRefused(gp.GP_EREFUSED, f"link {link_id} of server {sender} was already "
                              "asked for (a replayed peer_hello)")
        self._seen[(group, link_id)] = now
