"""The admin commands' client of the daemon's HTTP API (`gpupoold status`, `gpupoold gpu ...`,
`gpupoold lease end`). Used by the CLI process only, never by the daemon: plain blocking urllib.

Every failure becomes an `AdminError` whose message says what happened and what to do: the daemon
is not reachable, TLS does not fit, or the API refused (its `{"error", "hint"}` body).
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from gpupoold.config.settings import format_address, parse_address

DEFAULT_TIMEOUT = 30.0
NOT_RUNNING_HINT = "is gpupoold running? `systemctl status gpupoold`"


class AdminError(Exception):
    """A failed admin request. `status` is the HTTP status (0 when there was no answer)."""

    def __init__(self, message: str, hint: str = "", status: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.status = status

    def __str__(self) -> str:
        return f"{self.message}; {self.hint}" if self.hint else self.message


def base_url(http_setting: str, tls: bool) -> str:
    """The API's base URL for the `http` setting (`HOST:PORT`) or a URL given as is. A wildcard
    listener (0.0.0.0, ::) is reached on loopback."""
    if "://" in http_setting:
        parsed = urllib.parse.urlsplit(http_setting)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"{http_setting!r} is not an http:// or https:// address")
        return http_setting.rstrip("/")
    host, port = parse_address(http_setting)
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"{'https' if tls else 'http'}://{format_address(host, port)}"


def tls_context(cacert: Path | None = None, server_cert: Path | None = None,
                client_cert: Path | None = None, client_key: Path | None = None,
                ) -> ssl.SSLContext:
    """The client TLS context: trust `cacert` if given, else the system CAs plus the daemon's own
    certificate (`http_tls_cert`, when this user can read it: a self-signed one then works on
    the server without options); `client_cert`/`client_key` for mutual TLS."""
    try:
        ctx = ssl.create_default_context(cafile=str(cacert) if cacert else None)
    except (OSError, ssl.SSLError) as exc:
        raise AdminError(f"cannot use --cacert {cacert}: {_why(exc)}",
                         "give a PEM file of the CA that signed the daemon's http_tls_cert") from None
    if cacert is None and server_cert is not None:
        try:
            ctx.load_verify_locations(cafile=str(server_cert))
        except (OSError, ssl.SSLError):
            pass  # not readable here: the system CAs must do
        else:
            # The daemon's own certificate is trusted as it is (the operator configured it),
            # also when the CA that signed it is not in this file.
            ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    if client_cert is not None:
        try:
            ctx.load_cert_chain(str(client_cert), str(client_key) if client_key else None)
        except (OSError, ssl.SSLError) as exc:
            raise AdminError(f"cannot use the client certificate --cert {client_cert}"
                             f"{f' --key {client_key}' if client_key else ''}: {_why(exc)}",
                             "give a PEM certificate signed by the daemon's http_tls_client_ca "
                             "and its unencrypted key") from None
    return ctx


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


class AdminClient:
    def __init__(self, url: str, token: str = "", *, context: ssl.SSLContext | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        # No proxies: an operator's http_proxy must not carry the admin token elsewhere.
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if context is not None:
            handlers.append(urllib.request.HTTPSHandler(context=context))
        self._opener = urllib.request.build_opener(*handlers)

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self.request("POST", path, body if body is not None else {})

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON answer of a 2xx response; AdminError otherwise."""
        url = self.url + path
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                return _decode(resp.status, resp.headers.get_content_type(), resp.read(), url)
        except urllib.error.HTTPError as exc:
            with exc:
                raise _api_error(exc.code, exc.read(), url) from None
        except urllib.error.URLError as exc:
            raise self._unreachable(exc.reason, url) from None
        except (OSError, http.client.HTTPException) as exc:
            raise self._unreachable(exc, url) from None

    def _unreachable(self, reason: object, url: str) -> AdminError:
        where = self.url
        if isinstance(reason, ssl.SSLCertVerificationError):
            return AdminError(
                f"the HTTPS certificate of gpupoold at {where} was not accepted: "
                f"{reason.verify_message or reason}",
                "pass --cacert CA.pem (the CA that signed the daemon's http_tls_cert); the "
                "certificate must name the host in the address (--http)")
        if isinstance(reason, ssl.SSLError):
            return AdminError(
                f"the TLS handshake with {where} failed: {reason.reason or reason}",
                "if the daemon serves plain HTTP, use an http:// address; if it asks for a client "
                "certificate (http_tls_client_ca), pass --cert and --key")
        if isinstance(reason, ConnectionRefusedError):
            return AdminError(f"cannot reach gpupoold at {where}: connection refused",
                              f"{NOT_RUNNING_HINT}; if it listens elsewhere, pass --http "
                              "HOST:PORT or the config file with --config")
        if isinstance(reason, socket.timeout | TimeoutError):
            return AdminError(f"gpupoold at {where} did not answer within {self.timeout:g} s",
                              f"{NOT_RUNNING_HINT}; check --http and any firewall")
        if isinstance(reason, socket.gaierror):
            return AdminError(f"cannot resolve the host of {where}: {reason.strerror}",
                              "check --http (or `http` in the config)")
        if isinstance(reason, http.client.RemoteDisconnected | ConnectionResetError):
            if where.startswith("https://"):
                hint = ("if it requires a client certificate (http_tls_client_ca), pass --cert "
                        "and --key")
            else:
                hint = ("if it serves HTTPS (http_tls_cert), use an https:// address or pass "
                        "its config file with --config")
            return AdminError(f"gpupoold at {where} closed the connection without answering",
                              hint)
        text = _why(reason) if isinstance(reason, BaseException) else str(reason)
        return AdminError(f"cannot reach gpupoold at {where}: {text}", NOT_RUNNING_HINT)


def _decode(status: int, content_type: str, raw: bytes, url: str) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AdminError(f"unexpected answer from {url} (HTTP {status}, {content_type}): not "
                         "JSON", "is this address gpupoold's HTTP API? check --http",
                         status) from None


def _api_error(status: int, raw: bytes, url: str) -> AdminError:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return AdminError(body["error"], str(body.get("hint") or ""), status)
    return AdminError(f"{url} answered HTTP {status} without an error message",
                      "is this address gpupoold's HTTP API? check --http", status)
