"""Admin actions on any GPU or lease of the fleet, from any server:
`POST /api/v1/servers/{name}/gpus/{index}/{drain|undrain|clear}` and
`POST /api/v1/servers/{name}/leases/{id}/end` (docs/api.md, "Fleet").

Each server acts only on its own GPUs (its lease manager holds them), so an action for another
server is passed on to that server's HTTP API with the caller's own token: a token is valid on
every server of the fleet, so the other server checks the caller's role and audits the action
under the caller's name, as if called directly. An action for this server is the plain local one.
Either way the reply's `server` names the server that acted.

The forward goes where the target registered (pool/membership.py, the servers table): its
`http_address` (what `http_advertise` says others must use, never a wildcard rewritten to this
machine's loopback) and its `http_scheme`. Over HTTPS the target's certificate must have the
public key it registered (`http_fingerprint`, checked on the TLS session before a byte of the
request, the Authorization header included, is sent), as SSH checks a known host's key: no CA is
involved, so a self-signed certificate works and a changed one is refused. Plain HTTP is used
only to a loopback address, or to a target that registered plain HTTP itself (its `http_tls =
"off"`, warned there at every start).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from typing import Any

from aiohttp import web

from gpupoold.config.identity import is_loopback
from gpupoold.config.settings import parse_address
from gpupoold.http import api
from gpupoold.http.auth import ApiError
from gpupoold.http.keys import STORE
from gpupoold.store.database import Store
from gpupoold.tls_identity import fingerprint_of_der_cert, fingerprints_equal

log = logging.getLogger("gpupoold.http")

FORWARD_TIMEOUT_S = 30.0
MAX_REPLY = 4 << 20  # an action's reply is one GPU or lease view
GPU_ACTIONS = {"drain": api.drain_gpu, "undrain": api.undrain_gpu, "clear": api.clear_gpu}


def _whole(text: str, what: str, minimum: int) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise ApiError(400, f"{what} must be a whole number, got {text!r}",
                       f"use a whole number, {minimum} or more") from None
    if value < minimum:
        raise ApiError(400, f"{what} must be {minimum} or more, got {value}",
                       f"use a whole number, {minimum} or more")
    return value


async def _target(request: web.Request) -> dict[str, Any] | None:
    return await target_server(request.app[STORE], request.match_info["name"])


async def target_server(store: Store, name: str) -> dict[str, Any] | None:
    """The named server's row; None when it is this server (ApiError: not one to act on)."""
    if name == store.server:
        return None
    servers = {s["name"]: s for s in await store.servers()}
    if name not in servers:
        raise ApiError(404, f"no server {name!r} in this fleet",
                       f"GET /api/v1/servers lists them: {', '.join(sorted(servers)) or 'none'}")
    server = servers[name]
    if server["state"] != "up":
        raise ApiError(409, f"server {name!r} is down ({server['down_reason'] or 'no reason'})",
                       "its GPUs come back with it; nothing to do there now")
    if not server.get("http_address") or server.get("http_scheme") not in ("http", "https"):
        raise ApiError(409, f"server {name!r} registered no HTTP address the other servers can "
                       f"use", "upgrade gpupoold there and restart it (it registers its "
                       "`http_advertise` address, scheme and certificate at start)")
    return dict(server)


def _named(response: web.Response, server: str) -> web.Response:
    """`response` (a JSON object) with `server`: the server that acted."""
    try:
        data = json.loads(response.text or "")
    except ValueError:
        return response
    if isinstance(data, dict):
        data["server"] = server
        return web.json_response(data, status=response.status)
    return response


def _request_bytes(host: str, path: str, authorization: str, body: bytes) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"User-Agent: gpupoold-fleet\r\n")
    if authorization:
        head += f"Authorization: {authorization}\r\n"
    return head.encode("latin-1") + b"\r\n" + body


def _parse_reply(raw: bytes) -> tuple[int, bytes]:
    """(status, body) of an HTTP/1.1 reply read to the end (Connection: close)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError("the reply has no end of headers")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ValueError(f"not an HTTP reply: {lines[0][:80]!r}")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out, rest = b"", body
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    elif "content-length" in headers:
        body = body[:int(headers["content-length"])]
    return int(parts[1]), body


async def _exchange(server: dict[str, Any], path: str, authorization: str,
                    body: bytes) -> tuple[int, bytes]:
    """Send the action to `server` as it registered; (status, body) of its reply."""
    name, address = str(server["name"]), str(server["http_address"])
    scheme = str(server["http_scheme"])
    host, port = parse_address(address)
    ctx: ssl.SSLContext | None = None
    if scheme == "https":
        pin = str(server.get("http_fingerprint") or "")
        if not pin:
            raise ApiError(502, f"server {name!r} registered HTTPS without a certificate "
                           "fingerprint: nothing to check its identity against",
                           "restart gpupoold there so that it registers it")
        # No CA and no names: the pin below is the check (as SSH checks a known host's key).
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif not is_loopback(host):
        log.warning("fleet action for server %s sent over PLAIN HTTP to %s: it registered plain "
                    "HTTP (http_tls = \"off\" there); the caller's token crosses the network in "
                    "clear", name, address)
    reader, writer = await asyncio.open_connection(host, port, ssl=ctx,
                                                   server_hostname=host if ctx else None)
    try:
        if ctx is not None:
            tls = writer.get_extra_info("ssl_object")
            der = tls.getpeercert(binary_form=True) if tls is not None else None
            got = fingerprint_of_der_cert(der) if der else "(no certificate)"
            if not fingerprints_equal(got, pin):
                log.error("fleet action for server %s refused: %s presents the key %s, but the "
                          "server registered %s; the caller's token was not sent",
                          name, address, got, pin)
                raise ApiError(502, f"server {name!r} at {address} presents a certificate whose "
                               f"key ({got}) is not the one it registered ({pin}): refused, "
                               "the caller's token was not sent",
                               "someone else may answer at that address; if the server's "
                               "identity was changed, restart it so that it registers the new "
                               "one")
        writer.write(_request_bytes(address, path, authorization, body))
        await writer.drain()
        raw = await reader.read(MAX_REPLY)
        while chunk := await reader.read(MAX_REPLY):
            raw += chunk
            if len(raw) > MAX_REPLY:
                raise ValueError(f"the reply is larger than {MAX_REPLY} bytes")
        return _parse_reply(raw)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (OSError, ssl.SSLError):
            pass


async def _forward(request: web.Request, server: dict[str, Any], path: str) -> web.Response:
    status, data = await forward(server, path, request.headers.get("Authorization", ""),
                                 await request.read() or b"{}")
    return web.json_response(data, status=status)


async def forward(server: dict[str, Any], path: str, authorization: str,
                  body: bytes) -> tuple[int, Any]:
    """POST `body` (JSON) to `path` of `server` (a row of `target_server`) with the caller's
    `authorization`: (status, its JSON reply with `server`). ApiError 502: it did not answer."""
    name = str(server["name"])
    url = f"{server['http_scheme']}://{server['http_address']}{path}"
    try:
        status, raw = await asyncio.wait_for(_exchange(server, path, authorization, body),
                                             FORWARD_TIMEOUT_S)
    except (TimeoutError, OSError, ssl.SSLError, ValueError) as exc:
        raise ApiError(502, f"server {name!r} ({url}) did not answer: "
                       f"{str(exc) or type(exc).__name__}",
                       "check that its HTTP listener is reachable from this server at the "
                       "address it registered (its `http_advertise` setting)") from None
    text = raw.decode(errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        data = {"error": text.strip()[:500] or f"HTTP {status}"}
    if isinstance(data, dict):
        data["server"] = name
    return status, data


async def gpu_action(request: web.Request) -> web.Response:
    action = request.match_info["action"]
    if action not in GPU_ACTIONS:
        raise ApiError(404, f"no GPU action {action!r}", "drain, undrain or clear")
    index = _whole(request.match_info["index"], "the GPU index", 0)
    server = await _target(request)
    if server is None:
        return _named(await GPU_ACTIONS[action](request), request.app[STORE].server)
    return await _forward(request, server, f"/api/v1/gpus/{index}/{action}")


async def end_lease(request: web.Request) -> web.Response:
    lease_id = _whole(request.match_info["id"], "the lease id", 1)
    server = await _target(request)
    if server is None:
        return _named(await api.end_lease(request), request.app[STORE].server)
    return await _forward(request, server, f"/api/v1/leases/{lease_id}/end")
