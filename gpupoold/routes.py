"""Every HTTP route of gpupoold, in one place (docs/user-guide.md lists them)."""

from __future__ import annotations

from aiohttp import web

from gpupoold import handlers


def setup_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", handlers.healthz)
    app.router.add_get("/api/v1/gpus", handlers.list_gpus)
    app.router.add_get("/api/v1/sessions", handlers.list_sessions)
