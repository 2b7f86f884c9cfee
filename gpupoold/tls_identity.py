"""This server's TLS identity: a key and a self-signed certificate made at the first start, kept in
`<state_dir>/identity/` (`server.key` 0600, `server.crt`), and the fingerprint clients pin.

SSH is the model: encryption from the first connection without a certificate authority, the
server's key shown once (`gpupoold fingerprint`) and pinned by the client (`gpupool login`). The
fingerprint is `SHA256:` and the unpadded base64 of the SHA-256 of the certificate's
SubjectPublicKeyInfo (DER), as `ssh-keygen -l` prints a key's: it names the key, not the
certificate, so a certificate renewed over the same key keeps every client's pin.

The key is ECDSA P-256: the handshake is one of a client's costs per process, and P-256
signatures are the cheapest that every TLS 1.2+ stack accepts. The files are made once and never
rewritten; a lost or deleted key means a new identity, which every client refuses until it is
pinned again (docs/operator-guide.md, "The server's identity").
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import os
import socket
from dataclasses import dataclass
from pathlib import Path

IDENTITY_DIR = "identity"
CERT_FILE = "server.crt"
KEY_FILE = "server.key"
FINGERPRINT_PREFIX = "SHA256:"


class IdentityError(Exception):
    """The identity cannot be made or read; the message says which file and what to do."""


@dataclass(frozen=True)
class Identity:
    cert_path: Path
    key_path: Path
    fingerprint: str
    created: bool  # made by this call (the first start)

    def cert_pem(self) -> bytes:
        return self.cert_path.read_bytes()


def fingerprint_of_spki(spki_der: bytes) -> str:
    """`SHA256:<base64 without padding>` of a DER SubjectPublicKeyInfo."""
    digest = hashlib.sha256(spki_der).digest()
    return FINGERPRINT_PREFIX + base64.b64encode(digest).decode().rstrip("=")


def fingerprint_of_der_cert(der: bytes) -> str:
    """The fingerprint of a DER certificate's public key (what a TLS peer presents)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_der_x509_certificate(der)
    spki = cert.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo)
    return fingerprint_of_spki(spki)


def fingerprint_of_pem(pem: bytes) -> str:
    """The fingerprint of the first certificate of a PEM file (an operator's own `tls_cert`)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(pem)
    return fingerprint_of_der_cert(cert.public_bytes(serialization.Encoding.DER))


def fingerprints_equal(a: str, b: str) -> bool:
    """Constant-time comparison of two fingerprints (the same text)."""
    return hmac.compare_digest(a.encode(), b.encode())


def valid_fingerprint(text: str) -> bool:
    """`SHA256:` and 43 base64 characters (32 bytes, unpadded)."""
    if not text.startswith(FINGERPRINT_PREFIX) or len(text) != len(FINGERPRINT_PREFIX) + 43:
        return False
    try:
        return len(base64.b64decode(text[len(FINGERPRINT_PREFIX):] + "=", validate=True)) == 32
    except ValueError:
        return False


def _certificate_pem(key: object) -> bytes:
    """A self-signed certificate for `key` (an ECDSA private key), PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    assert isinstance(key, ec.EllipticCurvePrivateKey)
    host = socket.gethostname() or "gpupoold"
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"gpupoold {host}"[:64])])
    now = datetime.datetime.now(datetime.UTC)
    # Clients check the pin, not names or dates; a long validity keeps strict TLS stacks (and
    # Prometheus with the exported certificate as its CA) from refusing it after a year.
    sans: list[x509.GeneralName] = [x509.DNSName(host), x509.DNSName("localhost")]
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=365 * 30))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


def _make(cert_path: Path, key_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    # The key is written 0600 from its first byte (O_EXCL: never over an existing file), then the
    # certificate; a start that dies in between leaves a key without a certificate, which the
    # next start completes rather than replacing the key.
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
        f.flush()
        os.fsync(f.fileno())
    _write_cert(cert_path, _certificate_pem(key))


def _write_cert(cert_path: Path, pem: bytes) -> None:
    tmp = cert_path.with_suffix(".tmp")
    tmp.write_bytes(pem)
    os.chmod(tmp, 0o644)
    os.replace(tmp, cert_path)


def _complete(cert_path: Path, key_path: Path) -> None:
    """A certificate for a key left without one (a start interrupted between the two files)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise IdentityError(f"{key_path} is not the ECDSA key gpupoold makes; move it away and "
                            f"start again to make a new identity (clients must pin it again)")
    _write_cert(cert_path, _certificate_pem(key))


def identity_paths(state_dir: Path) -> tuple[Path, Path]:
    folder = Path(state_dir) / IDENTITY_DIR
    return folder / CERT_FILE, folder / KEY_FILE


def load_identity(state_dir: Path) -> Identity | None:
    """The identity of `state_dir`, or None when none was made yet (read-only: for
    `gpupoold fingerprint` and other commands that must not create one)."""
    cert_path, key_path = identity_paths(state_dir)
    try:
        pem = cert_path.read_bytes()
    except FileNotFoundError:
        return None
    except PermissionError:
        raise IdentityError(f"cannot read {cert_path}: permission denied (run as the gpupoold "
                            f"user or with sudo)") from None
    try:
        return Identity(cert_path, key_path, fingerprint_of_pem(pem), created=False)
    except ValueError as exc:
        raise IdentityError(f"{cert_path} is not a PEM certificate ({exc}); move it away and "
                            f"start gpupoold again to make it anew from {key_path}") from None


def ensure_identity(state_dir: Path) -> Identity:
    """The identity of `state_dir`, made at the first call: <state_dir>/identity/server.key
    (0600) and server.crt. Later calls (restarts, upgrades) read the same files."""
    cert_path, key_path = identity_paths(state_dir)
    folder = cert_path.parent
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        created = False
        if not key_path.exists():
            _make(cert_path, key_path)
            created = True
        elif not cert_path.exists():
            _complete(cert_path, key_path)
        mode = key_path.stat().st_mode & 0o777
        if mode & 0o077:
            raise IdentityError(f"{key_path} is readable by others (mode {mode:o}): "
                                f"`chmod 600 {key_path}`, and make a new identity if anyone "
                                f"else may have read it")
    except FileExistsError:
        # Another process made it between our check and our create: read theirs.
        created = False
    except PermissionError as exc:
        raise IdentityError(f"cannot create the server identity in {folder}: {exc.strerror} "
                            f"(the state directory must be writable by the gpupoold user)"
                            ) from None
    ident = load_identity(state_dir)
    if ident is None:  # pragma: no cover - made just above
        raise IdentityError(f"{cert_path} is missing after it was made")
    return Identity(ident.cert_path, ident.key_path, ident.fingerprint, created)
