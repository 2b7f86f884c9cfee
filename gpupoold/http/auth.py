"""Who may call which HTTP route: the Bearer-token middleware, roles, and the JSON error format.

Every route declares its role once, in http/routes.py's table (`ROUTES`):

- `PUBLIC`: no token (only `/healthz`, for load balancers and monitoring);
- `USER`: any valid token, user or admin (the read-only views);
- `ADMIN`: an admin token (operator actions, tokens, the audit log);
- `METRICS`: as `USER`, and also no token when the setting `metrics_anonymous` is on (only
  `/metrics`, for a Prometheus that scrapes without credentials);
- `SESSION`: the web dashboard's pages (`/ui/...`, gpupoold/dashboard/): no Bearer token here, the
  dashboard checks its own login session (cookie) and CSRF token in the handler.

`auth_middleware` looks up the matched route's role, reads `Authorization: Bearer <token>`, asks
`app[AUTH].check(token, peer)` and answers 401 (no or bad token, with `WWW-Authenticate: Bearer`)
or 403 (a user token on an admin route) before the handler runs. A route that somebody registers
without declaring a role is treated as admin-only: forgetting a role can only refuse too much.
With `http_anonymous_read`, USER routes answer GET/HEAD without a token (a token that *is* sent
is still checked: a wrong one is refused rather than silently ignored). Every refusal is counted
in `app[COUNTERS]` as `http_auth_refused` with its reason.

The same middleware turns every error into the API's JSON error body
`{"error": "what happened", "hint": "what to do"}`: `ApiError` raised by handlers, aiohttp's own
HTTP errors (404, 405, 413...) and, logged with its traceback, any unexpected exception (500).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import hdrs, web

from gpupoold.auth.authenticator import AuthDecision
from gpupoold.http.keys import AUTH, COUNTERS, SETTINGS
from gpupoold.store.database import NotFound, TokenExists, store_errors

log = logging.getLogger("gpupoold.http")

PUBLIC, USER, ADMIN, METRICS, SESSION = "public", "user", "admin", "metrics", "session"
ROLES = (PUBLIC, USER, ADMIN, METRICS, SESSION)
READ_METHODS = frozenset({hdrs.METH_GET, hdrs.METH_HEAD})

# {(method, path as declared in the route table): role}; filled by routes.setup_routes.
ROUTE_ROLES = web.AppKey("gpupool_route_roles", dict)
# The caller, as the middleware authenticated it (handlers read it with `caller(request)`).
DECISION = web.RequestKey("gpupool_auth_decision", AuthDecision)

ANONYMOUS_READER = AuthDecision(ok=True, identity="anonymous", role="anonymous")
NO_TOKEN_NEEDED = AuthDecision(ok=True, identity="anonymous", role="")

TOKEN_HINT = ("send the header `Authorization: Bearer <token>`; an administrator creates tokens "
              "with `gpupoold token create --name NAME` on the server (or POST /api/v1/tokens)")
ADMIN_HINT = ("use an admin token: an administrator creates one with `gpupoold token create "
              "--name NAME --role admin`; on the server, `gpupoold` commands use the local admin "
              "token in the state directory")
REFUSED_TEXT = {
    "missing": "this endpoint needs an API token and the request has none",
    "malformed": "the API token is malformed",
    "unknown": "the API token is not known to this server",
    "revoked": "the API token has been revoked",
    "expired": "the API token has expired",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """An error answer: HTTP `status` with the JSON body {"error": message, "hint": hint}."""

    def __init__(self, status: int, message: str, hint: str = "",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.hint = hint
        self.headers = headers or {}

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.hint, self.headers)


def error_response(status: int, message: str, hint: str = "",
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message, "hint": hint}, status=status, headers=headers)


def caller(request: web.Request) -> AuthDecision:
    """Who is calling (set by the middleware; routes without a token get "anonymous")."""
    return request.get(DECISION, NO_TOKEN_NEEDED)


def route_role(request: web.Request) -> str | None:
    """The declared role of the matched route; None when no route matched (404, 405)."""
    match = request.match_info
    if match.http_exception is not None:
        return None
    route = match.route
    resource = route.resource
    if resource is None:
        return None
    method = hdrs.METH_GET if route.method == hdrs.METH_HEAD else route.method
    roles: dict[tuple[str, str], str] = request.app.get(ROUTE_ROLES, {})
    return roles.get((method, resource.canonical), ADMIN)


def bearer_token(header: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None when it is not that form."""
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or any(c.isspace() for c in token):
        return None
    return token


def _refuse(request: web.Request, status: int, reason: str, message: str,
            hint: str) -> web.Response:
    request.app[COUNTERS].inc("http_auth_refused", reason=reason)
    log.info("HTTP %s %s from %s refused (%s): %s", request.method, request.path,
             request.remote or "?", reason, message)
    headers = {hdrs.WWW_AUTHENTICATE: 'Bearer realm="gpupool"'} if status == 401 else None
    return error_response(status, message, hint, headers)


async def authorize(request: web.Request) -> web.Response | None:
    """None when the request may go on (with request[DECISION] set), else the refusal."""
    role = route_role(request)
    if role is None or role in (PUBLIC, SESSION):
        return None
    header = request.headers.get(hdrs.AUTHORIZATION)
    settings = request.app[SETTINGS]
    if (header is None and role in (USER, METRICS) and request.method in READ_METHODS
            and (settings.http_anonymous_read
                 or (role == METRICS and settings.metrics_anonymous))):
        request[DECISION] = ANONYMOUS_READER
        return None
    if header is None:
        token = ""
    else:
        parsed = bearer_token(header)
        if parsed is None:
            return _refuse(request, 401, "malformed",
                           "the Authorization header must be `Bearer <token>`", TOKEN_HINT)
        token = parsed
    decision = await request.app[AUTH].check(token, request.remote or "")
    if not decision.ok:
        if decision.remembered:  # refused from memory, the store not asked (auth/refused.py)
            request.app[COUNTERS].inc("http_admission_refused", reason="token_remembered")
        reason = decision.reason or "refused"
        message = decision.message or REFUSED_TEXT.get(reason, "the API token was refused")
        return _refuse(request, 401, reason, message, TOKEN_HINT)
    if role == ADMIN and decision.role != ADMIN:
        return _refuse(request, 403, "forbidden",
                       f"{request.method} {request.path} needs an admin token; token "
                       f"'{decision.identity}' has the role '{decision.role}'", ADMIN_HINT)
    request[DECISION] = decision
    return None


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own errors (no such route, method not allowed, body too large) as JSON."""
    headers = {}
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        headers[hdrs.ALLOW] = allowed
        return error_response(405, f"{request.method} is not allowed on {request.path}",
                              f"this path takes: {allowed}", headers)
    if exc.status == 404:
        return error_response(404, f"no such endpoint: {request.method} {request.path}",
                              "the endpoints are listed in docs/api.md (all under /api/v1/)")
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return error_response(413, exc.text or exc.reason, "send a smaller request body")
    message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
    return error_response(exc.status, message, "")


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        refusal = await authorize(request)
        if refusal is not None:
            return refusal
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error(request, exc)
    except Exception as exc:
        if isinstance(exc, store_errors()) and not isinstance(exc, (NotFound, TokenExists)):
            # The database is unreachable (a token cannot be checked): not a bug, a wait.
            why = str(exc).strip() or type(exc).__name__
            log.warning("HTTP %s %s: the database cannot be reached (%s)", request.method,
                        request.path, why)
            return error_response(503, f"gpupoold cannot reach its database right now ({why})",
                                  "try again in a moment: gpupoold reconnects by itself; the "
                                  "leases already running go on")
        log.exception("HTTP %s %s failed", request.method, request.path)
        return error_response(500, "internal error in gpupoold",
                              "this is a bug: the daemon's log has the details; please report it")


def declare_roles(app: web.Application, table: Iterable[tuple[str, str, str]]) -> None:
    """Record (method, path, role) triples for the middleware (used by routes.setup_routes and
    dashboard.setup_dashboard; a later call adds to what earlier ones declared)."""
    roles: dict[tuple[str, str], str] = dict(app.get(ROUTE_ROLES, {}))
    for method, path, role in table:
        if role not in ROLES:
            raise ValueError(f"route {method} {path}: unknown role {role!r}")
        roles[(method, path)] = role
    app[ROUTE_ROLES] = roles
