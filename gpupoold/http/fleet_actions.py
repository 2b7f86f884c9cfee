"""Admin actions on any GPU or lease of the fleet, from any server:
`POST /api/v1/servers/{name}/gpus/{index}/{drain|undrain|clear}` and
`POST /api/v1/servers/{name}/leases/{id}/end` (docs/api.md, "Fleet").

Each server acts only on its own GPUs (its lease manager holds them), so an action for another
server is passed on to that server's HTTP API (its `http` address in the servers table), with
the caller's own token: a token is valid on every server of the fleet, so the other server
checks the caller's role and audits the action under the caller's name, as if called directly.
An action for this server is the plain local one.
"""

from __future__ import annotations

import json

import aiohttp
from aiohttp import web

from gpupoold.http import api
from gpupoold.http.auth import ApiError
from gpupoold.http.keys import SETTINGS, STORE

FORWARD_TIMEOUT_S = 30.0
GPU_ACTIONS = {"drain": api.drain_gpu, "undrain": api.undrain_gpu, "clear": api.clear_gpu}


async def _target(request: web.Request) -> dict[str, object] | None:
    """The named server's row; None when it is this server."""
    name = request.match_info["name"]
    store = request.app[STORE]
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
    if not server["http"]:
        raise ApiError(409, f"server {name!r} registered no HTTP address", "")
    return server


async def _forward(request: web.Request, server: dict[str, object], path: str) -> web.Response:
    scheme = "https" if request.app[SETTINGS].http_tls_cert is not None else "http"
    host = str(server["http"]).replace("0.0.0.0", "127.0.0.1") if str(
        server["http"]).startswith("0.0.0.0:") else str(server["http"])
    url = f"{scheme}://{host}{path}"
    headers = {"Authorization": request.headers.get("Authorization", ""),
               "Content-Type": "application/json"}
    body = await request.read()
    try:
        async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S)) as session, \
                session.post(url, data=body or b"{}", headers=headers) as reply:
            text = await reply.text()
            status = reply.status
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise ApiError(502, f"server {server['name']!r} ({url}) did not answer: {exc}",
                       "check that its HTTP listener ('http') is reachable from this server") \
            from None
    try:
        data = json.loads(text)
    except ValueError:
        data = {"error": text.strip()[:500] or f"HTTP {status}"}
    return web.json_response(data, status=status)


async def gpu_action(request: web.Request) -> web.Response:
    action = request.match_info["action"]
    if action not in GPU_ACTIONS:
        raise ApiError(404, f"no GPU action {action!r}", "drain, undrain or clear")
    server = await _target(request)
    if server is None:
        return await GPU_ACTIONS[action](request)
    return await _forward(request, server,
                          f"/api/v1/gpus/{request.match_info['index']}/{action}")


async def end_lease(request: web.Request) -> web.Response:
    server = await _target(request)
    if server is None:
        return await api.end_lease(request)
    return await _forward(request, server, f"/api/v1/leases/{request.match_info['id']}/end")
