"""HTTPS on the HTTP listener (gpupoold/tls.py): a real aiohttp server with the context that
`http_ssl_context` builds from the settings, clients with and without client certificates
(certificates made by trustme), and the error for every wrong setting."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import trustme
from aiohttp import web
from cryptography.hazmat.primitives import serialization

from gpupoold.config.settings import Settings
from gpupoold.tls import TlsSettingError, http_ssl_context


@dataclass
class Pki:
    ca: trustme.CA
    cert: Path
    key: Path
    client_ca: Path
    client: trustme.LeafCert  # signed by client_ca
    stranger: trustme.LeafCert  # signed by another CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.private_key_pem.write_to_path(str(d / "server.key"))
    with open(d / "server.pem", "wb") as f:  # the chain, leaf first
        for blob in server.cert_chain_pems:
            f.write(blob.bytes())
    client_ca = trustme.CA()
    client_ca.cert_pem.write_to_path(str(d / "client-ca.pem"))
    return Pki(ca, d / "server.pem", d / "server.key", d / "client-ca.pem",
               client_ca.issue_cert("alice@example.com"),
               trustme.CA().issue_cert("mallory@example.com"))


async def hello(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "tls": request.transport is not None
                              and request.transport.get_extra_info("sslcontext") is not None})


@asynccontextmanager
async def https_server(settings: Settings) -> AsyncIterator[str]:
    """An aiohttp server on a free loopback port with the settings' TLS, as serve.py runs it."""
    app = web.Application()
    app.router.add_get("/healthz", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=http_ssl_context(settings))
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"https://{host}:{port}"
    finally:
        await runner.cleanup()


def client_context(pki: Pki, cert: trustme.LeafCert | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    pki.ca.configure_trust(ctx)
    if cert is not None:
        cert.configure_cert(ctx)
    return ctx


async def fetch(url: str, ctx: ssl.SSLContext) -> dict[str, object]:
    async with aiohttp.ClientSession() as session, session.get(url + "/healthz", ssl=ctx) as resp:
        assert resp.status == 200
        body: dict[str, object] = await resp.json()
        return body


def test_no_tls_settings_means_plain_http() -> None:
    assert http_ssl_context(Settings()) is None


def test_context_is_tls12_or_newer_and_no_client_cert_by_default(pki: Pki) -> None:
    ctx = http_ssl_context(Settings(http_tls_cert=pki.cert, http_tls_key=pki.key))
    assert ctx is not None
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert ctx.verify_mode == ssl.CERT_NONE


async def test_https_serves_a_client_that_trusts_the_ca(pki: Pki) -> None:
    settings = Settings(http_tls_cert=pki.cert, http_tls_key=pki.key)
    async with https_server(settings) as url:
        assert await fetch(url, client_context(pki)) == {"ok": True, "tls": True}
        # A client that does not trust the server's CA refuses the connection.
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await fetch(url, ssl.create_default_context())


async def test_tls_1_2_and_1_3_clients_connect(pki: Pki) -> None:
    settings = Settings(http_tls_cert=pki.cert, http_tls_key=pki.key)
    async with https_server(settings) as url:
        for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
            ctx = client_context(pki)
            ctx.minimum_version = ctx.maximum_version = version
            assert await fetch(url, ctx) == {"ok": True, "tls": True}


async def test_client_ca_requires_a_certificate_it_signed(pki: Pki) -> None:
    settings = Settings(http_tls_cert=pki.cert, http_tls_key=pki.key,
                        http_tls_client_ca=pki.client_ca)
    ctx = http_ssl_context(settings)
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED
    async with https_server(settings) as url:
        assert await fetch(url, client_context(pki, pki.client)) == {"ok": True, "tls": True}
        with pytest.raises(aiohttp.ClientError):  # no client certificate
            await fetch(url, client_context(pki))
        with pytest.raises(aiohttp.ClientError):  # signed by a CA the server does not trust
            await fetch(url, client_context(pki, pki.stranger))
        # The server is still fine after refusing them.
        assert await fetch(url, client_context(pki, pki.client)) == {"ok": True, "tls": True}


def _error(**kw: object) -> str:
    with pytest.raises(TlsSettingError) as e:
        http_ssl_context(Settings(**kw))  # type: ignore[arg-type]
    return str(e.value)


def test_cert_without_key_names_the_missing_setting(pki: Pki) -> None:
    msg = _error(http_tls_cert=pki.cert)
    assert "'http_tls_key' is not set" in msg
    msg = _error(http_tls_key=pki.key)
    assert "'http_tls_cert' is not set" in msg


def test_client_ca_without_https(pki: Pki) -> None:
    msg = _error(http_tls_client_ca=pki.client_ca)
    assert "'http_tls_client_ca' needs HTTPS" in msg and "http_tls_cert" in msg


def test_missing_files_name_their_setting(pki: Pki, tmp_path: Path) -> None:
    nowhere = tmp_path / "nope.pem"
    assert "setting 'http_tls_cert'" in _error(http_tls_cert=nowhere, http_tls_key=pki.key)
    assert "setting 'http_tls_key'" in _error(http_tls_cert=pki.cert, http_tls_key=nowhere)
    msg = _error(http_tls_cert=pki.cert, http_tls_key=pki.key, http_tls_client_ca=nowhere)
    assert "setting 'http_tls_client_ca'" in msg and "does not exist" in msg
    assert "is not a file" in _error(http_tls_cert=tmp_path, http_tls_key=pki.key)


def test_key_of_another_certificate(pki: Pki, tmp_path: Path) -> None:
    other = tmp_path / "other.key"
    pki.ca.issue_cert("other.example").private_key_pem.write_to_path(str(other))
    msg = _error(http_tls_cert=pki.cert, http_tls_key=other)
    assert "'http_tls_cert' / 'http_tls_key'" in msg and "must belong to the certificate" in msg


def test_not_pem(pki: Pki, tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    assert "'http_tls_cert' / 'http_tls_key'" in _error(http_tls_cert=junk, http_tls_key=pki.key)
    msg = _error(http_tls_cert=pki.cert, http_tls_key=pki.key, http_tls_client_ca=junk)
    assert "setting 'http_tls_client_ca'" in msg and "no usable PEM CA certificate" in msg


def test_encrypted_key_is_refused_without_prompting(pki: Pki, tmp_path: Path) -> None:
    key = serialization.load_pem_private_key(pki.key.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                            serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    msg = _error(http_tls_cert=pki.cert, http_tls_key=encrypted)
    assert "setting 'http_tls_key'" in msg and "encrypted" in msg and "openssl pkey" in msg
