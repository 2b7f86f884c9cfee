"""Every HTTP route of gpupoold and the role it needs, in one table (docs/api.md documents them).

A role is declared here and nowhere else: `PUBLIC` (no token), `USER` (any valid token; with
`http_anonymous_read` also none for GET), `ADMIN` (an admin token), `METRICS` (as `USER`, or no
token with `metrics_anonymous`). http/auth.py enforces it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from gpupoold.http import api, fleet_actions, metrics
from gpupoold.http.auth import ADMIN, METRICS, PUBLIC, USER, declare_roles


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    role: str


ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", api.healthz, PUBLIC),
    Route("GET", "/metrics", metrics.metrics_endpoint, METRICS),
    Route("GET", "/api/v1/status", api.status, USER),
    Route("GET", "/api/v1/gpus", api.list_gpus, USER),
    Route("GET", "/api/v1/servers", api.list_servers, USER),
    Route("GET", "/api/v1/fleet", api.fleet, USER),
    Route("POST", "/api/v1/servers/{name}/gpus/{index}/{action}", fleet_actions.gpu_action,
          ADMIN),
    Route("POST", "/api/v1/servers/{name}/leases/{id}/end", fleet_actions.end_lease, ADMIN),
    Route("GET", "/api/v1/gpus/{index}", api.get_gpu, USER),
    Route("POST", "/api/v1/gpus/{index}/drain", api.drain_gpu, ADMIN),
    Route("POST", "/api/v1/gpus/{index}/undrain", api.undrain_gpu, ADMIN),
    Route("POST", "/api/v1/gpus/{index}/clear", api.clear_gpu, ADMIN),
    Route("GET", "/api/v1/leases", api.list_leases, USER),
    Route("GET", "/api/v1/leases/{id}", api.get_lease, USER),
    Route("POST", "/api/v1/leases/{id}/end", api.end_lease, ADMIN),
    Route("GET", "/api/v1/queue", api.list_queue, USER),
    Route("GET", "/api/v1/tokens", api.list_tokens, ADMIN),
    Route("POST", "/api/v1/tokens", api.create_token, ADMIN),
    Route("DELETE", "/api/v1/tokens/{name}", api.revoke_token, ADMIN),
    Route("GET", "/api/v1/audit", api.audit_log, ADMIN),
    Route("GET", "/api/v1/report", api.report, ADMIN),
)


def setup_routes(app: web.Application) -> None:
    """Add the routes and their roles. The app must have `http_auth.auth_middleware`."""
    for r in ROUTES:
        if r.method == "GET":
            app.router.add_get(r.path, r.handler)  # HEAD too, with the same role
        else:
            app.router.add_route(r.method, r.path, r.handler)
    declare_roles(app, [(r.method, r.path, r.role) for r in ROUTES])
