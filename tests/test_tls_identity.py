"""The server's TLS identity (gpupoold/tls_identity.py): made once, kept, and its fingerprint
computed as `ssh-keygen -l` would (SHA-256 of the SubjectPublicKeyInfo, unpadded base64)."""

from __future__ import annotations

import base64
import hashlib
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gpupoold import tls_identity as ti


def test_made_once_with_a_private_key_and_kept_across_calls(tmp_path: Path) -> None:
    first = ti.ensure_identity(tmp_path)
    assert first.created
    assert stat.S_IMODE(first.key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(first.key_path.parent.stat().st_mode) == 0o700
    again = ti.ensure_identity(tmp_path)
    assert not again.created
    assert again.fingerprint == first.fingerprint
    assert again.key_path.read_bytes() == first.key_path.read_bytes()
    # The pair loads into an ordinary TLS server context.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(first.cert_path, first.key_path)


def test_fingerprint_is_the_sha256_of_the_public_key_info(tmp_path: Path) -> None:
    ident = ti.ensure_identity(tmp_path)
    cert = x509.load_pem_x509_certificate(ident.cert_path.read_bytes())
    spki = cert.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo)
    want = "SHA256:" + base64.b64encode(hashlib.sha256(spki).digest()).decode().rstrip("=")
    assert ident.fingerprint == want
    assert ti.valid_fingerprint(ident.fingerprint)
    der = cert.public_bytes(serialization.Encoding.DER)
    assert ti.fingerprint_of_der_cert(der) == want


def test_a_lost_certificate_is_remade_over_the_same_key(tmp_path: Path) -> None:
    first = ti.ensure_identity(tmp_path)
    first.cert_path.unlink()
    assert ti.load_identity(tmp_path) is None
    again = ti.ensure_identity(tmp_path)
    assert again.fingerprint == first.fingerprint  # the pin names the key


def test_two_state_dirs_have_two_identities(tmp_path: Path) -> None:
    a = ti.ensure_identity(tmp_path / "a")
    b = ti.ensure_identity(tmp_path / "b")
    assert a.fingerprint != b.fingerprint


def test_a_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    ident = ti.ensure_identity(tmp_path)
    ident.key_path.chmod(0o644)
    with pytest.raises(ti.IdentityError, match="chmod 600"):
        ti.ensure_identity(tmp_path)


@pytest.mark.parametrize("text,ok", [
    ("SHA256:" + "A" * 43, True),
    ("SHA256:" + "A" * 42, False),
    ("SHA256:" + "A" * 43 + "=", False),
    ("sha256:" + "A" * 43, False),
    ("SHA256:" + "*" * 43, False),
    ("", False),
])
def test_fingerprint_format(text: str, ok: bool) -> None:
    assert ti.valid_fingerprint(text) is ok


def test_fingerprints_compare_equal_only_when_identical() -> None:
    assert ti.fingerprints_equal("SHA256:abc", "SHA256:abc")
    assert not ti.fingerprints_equal("SHA256:abc", "SHA256:abd")
