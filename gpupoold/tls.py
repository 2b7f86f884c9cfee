"""TLS contexts: HTTPS for the HTTP listener (`http_tls_*` settings) and the remoting listener's
first TLS session (`tls_*` settings, `remoting_ssl_context`; gpupoold/remoting/tls_session.py).

The remoting port speaks TLS by default (`tls = "on"`): with the operator's own `tls_cert` /
`tls_key` when they are set, else with the server's own identity, a key and a self-signed
certificate made at the first start in `<state_dir>/identity/` (gpupoold/tls_identity.py), whose
fingerprint clients pin. `tls = "off"` is plain TCP, warned at every start (`remoting_identity`
returns None).

    http_tls_cert       PEM certificate chain (leaf first)      } both, or neither (plain HTTP)
    http_tls_key        PEM private key, unencrypted            }
    http_tls_client_ca  PEM CA bundle: clients must present a certificate it signed (mutual TLS)

TLS 1.2 is the oldest version offered. Client certificates are checked against
`http_tls_client_ca` only, never the system's CA store: the operator decides who may connect. A
client certificate is an additional gate, not an identity: API calls still need a token.

Every mistake raises `TlsSettingError` naming the setting and saying what to do; `gpupoold serve`
turns it into a start-up error. The files are read once, at start-up.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from gpupoold.config.settings import Settings
from gpupoold.tls_identity import Identity, IdentityError, ensure_identity, fingerprint_of_pem


class TlsSettingError(Exception):
    """The `http_tls_*` settings cannot make a TLS context; the message names the setting."""


def _check_file(setting: str, path: Path) -> None:
    if not path.exists():
        raise TlsSettingError(f"setting '{setting}': {path} does not exist")
    if not path.is_file():
        raise TlsSettingError(f"setting '{setting}': {path} is not a file")
    if not os.access(path, os.R_OK):
        raise TlsSettingError(f"setting '{setting}': {path} is not readable by this user "
                              f"(uid {os.getuid()}): fix its owner or mode")


def _no_password(key: Path, prefix: str = "http_tls") -> bytes:
    # Called by OpenSSL only for an encrypted key. Without it OpenSSL would prompt on the
    # terminal, which hangs a daemon.
    raise TlsSettingError(
        f"setting '{prefix}_key': {key} is encrypted with a passphrase; gpupoold needs it "
        f"unencrypted (readable only by the gpupoold user): `openssl pkey -in {key} -out "
        f"PLAIN.key`, then point {prefix}_key at PLAIN.key")


def server_context(cert: Path, key: Path, client_ca: Path | None,
                   prefix: str = "http_tls") -> ssl.SSLContext:
    """A TLS server context (TLS 1.2+) for `cert`/`key`; with `client_ca`, client certificates
    signed by it are required. `prefix` names the settings in messages (`http_tls`, `tls`)."""
    _check_file(f"{prefix}_cert", cert)
    _check_file(f"{prefix}_key", key)
    if client_ca is not None:
        _check_file(f"{prefix}_client_ca", client_ca)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key, password=lambda: _no_password(key, prefix))
    except ssl.SSLError as exc:
        raise TlsSettingError(
            f"settings '{prefix}_cert' / '{prefix}_key': cannot use {cert} with {key} "
            f"({exc.reason or exc}): both must be PEM files and the key must belong to the "
            f"certificate (the first certificate in {cert.name})") from None
    except OSError as exc:
        raise TlsSettingError(f"settings '{prefix}_cert' / '{prefix}_key': cannot read {cert} "
                              f"or {key}: {exc.strerror or exc}") from None
    if client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=client_ca)
        except ssl.SSLError as exc:
            raise TlsSettingError(
                f"setting '{prefix}_client_ca': {client_ca} has no usable PEM CA certificate "
                f"({exc.reason or exc})") from None
        except OSError as exc:
            raise TlsSettingError(f"setting '{prefix}_client_ca': cannot read {client_ca}: "
                                  f"{exc.strerror or exc}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _files(settings: Settings, prefix: str, needs: str) -> tuple[str, str, str | None] | None:
    """(cert, key, client CA) of the `{prefix}_cert`, `_key`, `_client_ca` settings, None when
    neither certificate nor key is set; TlsSettingError for a half-made set (`needs`: what the
    settings turn on, for the message)."""
    cert, key, ca = (getattr(settings, f"{prefix}_{n}") for n in ("cert", "key", "client_ca"))
    if cert is None and key is None:
        if ca is not None:
            raise TlsSettingError(f"setting '{prefix}_client_ca' needs {needs}: set "
                                  f"'{prefix}_cert' and '{prefix}_key' as well, or remove "
                                  f"'{prefix}_client_ca'")
        return None
    if cert is None or key is None:
        have, missing = (f"{prefix}_key", f"{prefix}_cert") if cert is None else (
            f"{prefix}_cert", f"{prefix}_key")
        raise TlsSettingError(f"setting '{missing}' is not set: {needs} needs both "
                              f"'{prefix}_cert' and '{prefix}_key' ('{have}' is set)")
    return cert, key, ca


def http_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The HTTP listener's TLS context, or None for plain HTTP (no `http_tls_*` set)."""
    files = _files(settings, "http_tls", "HTTPS")
    return None if files is None else server_context(*files)


@dataclass(frozen=True)
class RemotingIdentity:
    """What the remoting port presents: the certificate and key files (the daemon's session and
    the workers' load the same), the client CA if any, the fingerprint clients pin."""

    cert: Path
    key: Path
    client_ca: Path | None
    fingerprint: str
    own: bool  # the operator's own tls_cert; False: the identity made in the state directory
    created: bool  # made by this call (the first start)


PLAIN_TCP_WARNING = (
    "the remoting port speaks PLAIN TCP (tls = \"off\"): every client's token and data cross "
    "the network in clear; remove `tls = \"off\"` to serve TLS with this server's identity")


def remoting_identity(settings: Settings) -> RemotingIdentity | None:
    """The remoting port's TLS identity, None with `tls = "off"` (plain TCP). Without `tls_cert`
    the identity of the state directory, made at the first call (tls_identity.ensure_identity).
    TlsSettingError (naming the setting or the file) when it cannot be made or read."""
    files = _files(settings, "tls", "TLS on the remoting port")
    if settings.tls == "off":
        if files is not None:
            raise TlsSettingError("settings 'tls' = \"off\" and 'tls_cert' contradict each "
                                  "other: remove 'tls_cert'/'tls_key' for plain TCP, or remove "
                                  "`tls = \"off\"` to serve TLS with that certificate")
        return None
    if files is not None:
        cert, key, ca = (Path(f) if f is not None else None for f in files)
        assert cert is not None and key is not None
        _check_file("tls_cert", cert)
        return RemotingIdentity(cert, key, ca, certificate_fingerprint("tls_cert", cert),
                                own=True, created=False)
    if settings.tls_client_ca is not None:  # pragma: no cover - _files refuses it
        raise TlsSettingError("setting 'tls_client_ca' needs 'tls_cert' and 'tls_key'")
    ident = state_identity(settings, "the server's TLS identity")
    return RemotingIdentity(ident.cert_path, ident.key_path, None, ident.fingerprint, own=False,
                            created=ident.created)


def certificate_fingerprint(setting: str, cert: Path) -> str:
    """The fingerprint of the PEM certificate that `setting` names; TlsSettingError if none."""
    try:
        return fingerprint_of_pem(Path(cert).read_bytes())
    except (ValueError, OSError) as exc:
        raise TlsSettingError(f"setting '{setting}': {cert} has no PEM certificate gpupoold "
                              f"can read ({exc})") from None


def state_identity(settings: Settings, what: str) -> Identity:
    """The identity of the state directory (made at the first call, kept after), for `what`
    uses it; TlsSettingError naming the setting when it cannot be made or read."""
    try:
        Path(settings.state_dir).mkdir(parents=True, exist_ok=True, mode=0o750)
        return ensure_identity(Path(settings.state_dir))
    except IdentityError as exc:
        raise TlsSettingError(f"{what} (setting 'state_dir'): {exc}") from None
    except OSError as exc:
        raise TlsSettingError(f"setting 'state_dir': cannot create {settings.state_dir}: "
                              f"{exc.strerror or exc}") from None


def remoting_ssl_context(settings: Settings,
                         identity: RemotingIdentity | None = None) -> ssl.SSLContext | None:
    """The remoting listener's TLS context (the daemon's part of a client's connection: hello,
    queue), or None for plain TCP (`tls = "off"`). The workers load the same files for the
    data path (`workers.WorkerTls`). `identity`: one `remoting_identity` already returned."""
    if identity is None:
        identity = remoting_identity(settings)
    if identity is None:
        return None
    ctx = server_context(identity.cert, identity.key, identity.client_ca, prefix="tls")
    # One TLS session per connection, closed at the hand-over: no session tickets.
    ctx.num_tickets = 0
    return ctx
