"""HTTP handlers: thin views over the application's objects (routes in routes.py)."""

from __future__ import annotations

from aiohttp import web

from gpupoold import __version__
from gpupoold.keys import INVENTORY, REMOTING, SESSIONS


async def healthz(request: web.Request) -> web.Response:
    app = request.app
    return web.json_response({
        "ok": True, "version": __version__, "remoting": app[REMOTING].address,
        "gpus": len(app[INVENTORY].gpus), "sessions": len(app[SESSIONS]),
    })


async def list_gpus(request: web.Request) -> web.Response:
    app = request.app
    gpus = []
    for gpu in app[INVENTORY].gpus:
        item = gpu.to_json()
        item["sessions"] = [s.id for s in app[SESSIONS].on_gpu(gpu.index)]
        gpus.append(item)
    return web.json_response({"gpus": gpus})


async def list_sessions(request: web.Request) -> web.Response:
    return web.json_response({"sessions": [s.to_json() for s in request.app[SESSIONS].all()]})
