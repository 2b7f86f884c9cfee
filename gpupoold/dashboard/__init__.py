"""The web dashboard: server-rendered pages under `/ui/`, login sessions, CSRF and live updates.

Pages are jinja2 templates (autoescape on) from `templates/` in this package; our own JavaScript
and CSS are served from its `static/` at `/ui/static/` (they ship inside the package, as
Datasette's do). The routes are declared with the role `SESSION`
(http/auth.py): the Bearer-token middleware lets them through and the handlers here check the
dashboard's own session instead:

- `POST /ui/login` takes a user or admin token (form field `token`), checks it like the API
  does, and starts a session: a random id in the cookie `gpupool_session` (HttpOnly,
  SameSite=Strict, Path=/ui, Secure over HTTPS). Sessions live in memory (a restart logs
  everybody out) and end after `SESSION_IDLE_S` without a request, at logout, or when the token
  is revoked or expires (it is checked again at every page and action).
- Before any of this, http/browser_guard.py refuses a POST whose Origin (else Referer) is another
  site's (login CSRF included) and a request for a host name that is not this server's (DNS
  rebinding), and sets `request.secure` behind a proxy of `trusted_proxies` (the cookie's Secure).
- Each session has its own CSRF token, put in every admin form as the hidden field `csrf`.
  Admin actions need an admin session AND that token, else 403 with a page that says why; a form
  posted without `confirm=yes` (set by the page's confirm() dialog) gets a confirmation page.
- With `http_anonymous_read`, pages are readable without a session (no admin controls);
  otherwise a page without a session redirects to the login page. With `auth = none` every
  visitor gets an admin session automatically (as in the API).
- `GET /ui/events`: server-sent events, `event: state` with the same views as the API (gpus,
  active leases, queue, summary) whenever they change and at least every `EVENT_EVERY_S`.
  `GET /ui/fleet/events`: the Fleet page's, `event: fleet` with the fleet view and each
  server's health (fleet_live.py).
- The Fleet page's actions, `POST /ui/servers/{server}/gpus/{index}/{drain,undrain,clear}` and
  `/ui/servers/{server}/leases/{id}/end`, act here for this server and are passed on to the
  other's API with the session's token otherwise (http/fleet_actions.py, as the API's are).

Lease history comes from the store (its own thread); nothing here blocks the event loop.

The modules: `sessions` (sessions, CSRF tokens, who is looking), `state` (what the dashboard
keeps per application), `access` (the request's viewer, rendering and refusing), `payload` (the
state and charts a page shows), `pages`, `actions` (admin forms), `live` (the event stream and
the history sampler), `fleet_live` (the Fleet page's data and stream), `formatting` (numbers
and times), `utilisation` and `timeline` (the Utilisation page: a lease timeline and
busy-versus-leased charts, drawn as inline SVG); this module mounts them.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from gpupoold.dashboard.actions import (
    Handler,
    create_token,
    end_lease,
    fleet_end_lease,
    fleet_gpu_action,
    gpu_action,
    revoke_token,
)
from gpupoold.dashboard.fleet_live import fleet_events
from gpupoold.dashboard.live import dashboard_ctx, events
from gpupoold.dashboard.pages import (
    fleet_page,
    history_page,
    leases_page,
    login,
    login_form,
    logout,
    overview,
    queue_page,
    root,
    tokens_page,
)
from gpupoold.dashboard.payload import state_payload
from gpupoold.dashboard.sessions import COOKIE, Sessions, Viewer
from gpupoold.dashboard.state import DASHBOARD, Dashboard, web_dir
from gpupoold.dashboard.utilisation import utilisation_page
from gpupoold.http.auth import PUBLIC, SESSION, declare_roles

__all__ = ["COOKIE", "DASHBOARD", "Dashboard", "Sessions", "UI_ROUTES", "Viewer",
           "dashboard_ctx", "setup_dashboard", "state_payload", "web_dir"]

UI_ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("GET", "/", root),
    ("GET", "/ui/", overview),
    ("GET", "/ui/leases", leases_page),
    ("GET", "/ui/history", history_page),
    ("GET", "/ui/utilisation", utilisation_page),
    ("GET", "/ui/queue", queue_page),
    ("GET", "/ui/fleet", fleet_page),
    ("GET", "/ui/tokens", tokens_page),
    ("GET", "/ui/login", login_form),
    ("POST", "/ui/login", login),
    ("POST", "/ui/logout", logout),
    ("GET", "/ui/events", events),
    ("POST", "/ui/gpus/{index}/drain", gpu_action("drain")),
    ("POST", "/ui/gpus/{index}/undrain", gpu_action("undrain")),
    ("POST", "/ui/gpus/{index}/clear", gpu_action("clear")),
    ("POST", "/ui/leases/{id}/end", end_lease),
    ("GET", "/ui/fleet/events", fleet_events),
    ("POST", "/ui/servers/{server}/gpus/{index}/drain", fleet_gpu_action("drain")),
    ("POST", "/ui/servers/{server}/gpus/{index}/undrain", fleet_gpu_action("undrain")),
    ("POST", "/ui/servers/{server}/gpus/{index}/clear", fleet_gpu_action("clear")),
    ("POST", "/ui/servers/{server}/leases/{id}/end", fleet_end_lease),
    ("POST", "/ui/tokens", create_token),
    ("POST", "/ui/tokens/{name}/revoke", revoke_token),
)


def setup_dashboard(app: web.Application, root: Path | None = None) -> None:
    """Mount the dashboard (after routes.setup_routes). `dashboard_ctx` runs its sampler."""
    dash = Dashboard(root or web_dir())
    app[DASHBOARD] = dash
    for method, path, handler in UI_ROUTES:
        if method == "GET":
            app.router.add_get(path, handler)
        else:
            app.router.add_route(method, path, handler)
    app.router.add_static("/ui/static", dash.root / "static", append_version=False)
    declare_roles(app, [(m, p, SESSION) for m, p, _ in UI_ROUTES]
                  + [("GET", "/ui/static", PUBLIC)])

    async def end_streams(_app: web.Application) -> None:
        dash.closing = True
        dash.notify()

    app.on_shutdown.append(end_streams)
