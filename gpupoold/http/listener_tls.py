"""What the HTTP listener speaks, and where the other servers of a fleet reach it (issue 35).

    http_tls_cert set                 HTTPS with that certificate (any address)
    a loopback address                plain HTTP (only this machine reaches it)
    any other address, http_tls = on  HTTPS with this server's own identity (<state_dir>/identity/,
                                      the remoting port's self-signed certificate)
    any other address, http_tls = off plain HTTP, warned at every start

The listener registers its scheme, the fingerprint of the certificate it presents and the address
the others must use (`http_advertise`, derived like `advertise`: never a wildcard) with the
servers table; http/fleet_actions.py forwards admin actions there with that pin.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from gpupoold.config.identity import WILDCARDS, advertised_http, is_loopback
from gpupoold.config.settings import Settings, parse_address
from gpupoold.tls import (
    certificate_fingerprint,
    http_ssl_context,
    server_context,
    state_identity,
)

PLAIN_HTTP_WARNING = (
    "the HTTP listener on {where} speaks PLAIN HTTP (http_tls = \"off\"): API tokens, including "
    "the admin tokens of fleet actions, cross the network in clear; remove `http_tls = \"off\"` "
    "to serve HTTPS with this server's identity")


@dataclass(frozen=True)
class HttpTls:
    context: ssl.SSLContext | None  # None: plain HTTP
    scheme: str  # "https" or "http"
    fingerprint: str  # of the certificate presented; "" for plain HTTP
    source: str  # for the log: which certificate, or why plain HTTP
    warning: str = ""  # plain HTTP off loopback: said at every start


def listener_host(settings: Settings, sock: socket.socket | None) -> str:
    """The host the HTTP listener binds: the passed socket's (systemd), else the `http` one."""
    if sock is not None:
        return str(sock.getsockname()[0])
    return parse_address(settings.http)[0]


def http_tls(settings: Settings, host: str) -> HttpTls:
    """The HTTP listener's TLS for a listener on `host`; TlsSettingError naming the setting."""
    ctx = http_ssl_context(settings)
    if ctx is not None:
        assert settings.http_tls_cert is not None
        fingerprint = certificate_fingerprint("http_tls_cert", Path(settings.http_tls_cert))
        return HttpTls(ctx, "https", fingerprint, f"http_tls_cert {settings.http_tls_cert}")
    if host not in WILDCARDS and is_loopback(host):
        return HttpTls(None, "http", "", "a loopback address: plain HTTP")
    if settings.http_tls == "off":
        where = f"{host or '*'}"
        return HttpTls(None, "http", "", "http_tls = \"off\"",
                       PLAIN_HTTP_WARNING.format(where=where))
    ident = state_identity(settings, "HTTPS with the server's identity")
    ctx = server_context(ident.cert_path, ident.key_path, settings.http_tls_client_ca)
    return HttpTls(ctx, "https", ident.fingerprint, f"this server's identity ({ident.cert_path})")


def check_http_advertise(settings: Settings, host: str) -> str | None:
    """Why this server cannot start (a message naming the setting), or None: on a shared store
    the others must be able to reach its HTTP listener, and a wildcard address says nothing."""
    if settings.database is None or settings.http_advertise:
        return None
    if advertised_http(None, f"{'[::]' if host == '::' else host or '0.0.0.0'}:1") is not None:
        return None
    return (f"setting 'http_advertise': the HTTP listener is on every address ({host or '*'}) "
            f"and neither this machine's host name ({socket.gethostname()}) nor a default route "
            f"names an address the other servers of the fleet could use: set "
            f"`http_advertise = \"HOST:PORT\"` (an address of this machine they reach)")
