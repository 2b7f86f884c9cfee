"""The HTTP API's handlers (`/healthz` and `/api/v1/...`): thin JSON views over the lease manager
(live state) and the store (records). Routes and their roles are declared in http/routes.py; who may
call what is checked before a handler runs (http/auth.py). docs/api.md is the reference.

Handlers validate their input and raise `ApiError` (a 400 saying which parameter is wrong and
what it accepts); `LeaseError` from the lease manager becomes its own status with its message.
Operator actions are audited by the objects that perform them: the lease manager records drain,
undrain, clear and lease ends, the store records token creation and revocation; the handlers pass
the caller's token name as the actor.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from gpupoold import __version__
from gpupoold.http.auth import ApiError, caller
from gpupoold.http.keys import (
    COUNTERS,
    INVENTORY,
    LEASES,
    REMOTING,
    SETTINGS,
    STORE,
    USAGE,
    VIEWS,
    remoting_address,
    tls_view,
)
from gpupoold.pool.fleet_view import fleet_view
from gpupoold.pool.leases import LeaseError, LeaseManager
from gpupoold.pool.privacy import private_view
from gpupoold.pool.report import GROUPINGS, build_report
from gpupoold.pool.report_sources import lease_facts, usage_of
from gpupoold.pool.views import PoolViews
from gpupoold.store.database import LeaseFilter, NotFound, TokenExists
from gpupoold.store.tokens import WEIGHT_MAX, check_token_name, parse_expiry

LEASE_STATES = ("active", "ended", "all")
TOKEN_ROLES = ("user", "admin")
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
MAX_REASON = 500  # characters of an operator's reason for ending a lease


# ---------------------------------------------------------------------------------- helpers
def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


def _shown(request: web.Request, data: Any, status: int = 200) -> web.Response:
    """A view of leases or waiters as the caller may see it: the clients' command lines whole
    for their owner's token and admins, the program's name for everyone else
    (pool/privacy.py)."""
    who = caller(request)
    return _json(private_view(data, who.identity, who.role), status)


def _int(text: str, what: str, minimum: int, maximum: int | None = None) -> int:
    """A whole number from a path or query parameter, or a 400 naming the parameter."""
    accepted = (f"from {minimum} to {maximum}" if maximum is not None else f"{minimum} or more")
    try:
        value = int(text, 10)
    except ValueError:
        raise ApiError(400, f"{what} must be a whole number, got {text!r}",
                       f"use a whole number, {accepted}") from None
    if value < minimum or (maximum is not None and value > maximum):
        raise ApiError(400, f"{what} must be {accepted}, got {value}",
                       f"use a whole number, {accepted}")
    return value


def _query(request: web.Request, allowed: Iterable[str]) -> dict[str, str]:
    """The query parameters, refusing unknown or repeated ones (a typo must not be ignored)."""
    allowed = tuple(allowed)
    out: dict[str, str] = {}
    for key, value in request.query.items():
        if key not in allowed:
            takes = ", ".join(allowed) if allowed else "no parameters"
            raise ApiError(400, f"unknown query parameter '{key}'",
                           f"{request.path} takes: {takes} (docs/api.md)")
        if key in out:
            raise ApiError(400, f"query parameter '{key}' given more than once",
                           "give each parameter once")
        out[key] = value
    return out


def _paging(query: dict[str, str]) -> tuple[int, int | None]:
    limit = _int(query.get("limit", str(DEFAULT_LIMIT)), "limit", 1, MAX_LIMIT)
    before = _int(query["before"], "before", 1) if "before" in query else None
    return limit, before


async def _body(request: web.Request, allowed: Iterable[str]) -> dict[str, Any]:
    """The JSON object in the request body ({} when there is none), refusing unknown keys."""
    allowed = tuple(allowed)
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}",
                       "send a JSON object, e.g. {\"reason\": \"maintenance\"}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                       f"send an object with the keys: {', '.join(allowed)}")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ApiError(400, f"unknown field(s) in the request body: {', '.join(unknown)}",
                       f"{request.method} {request.path} takes: {', '.join(allowed)}")
    return body


def _str_field(body: dict[str, Any], key: str, default: str | None = None) -> str:
    value = body.get(key, default)
    if value is None:
        raise ApiError(400, f"the field '{key}' is required", "see docs/api.md for the body")
    if not isinstance(value, str):
        raise ApiError(400, f"the field '{key}' must be a string, got {json.dumps(value)}",
                       "see docs/api.md for the body")
    return value


def _gpu_index(request: web.Request) -> int:
    return _int(request.match_info["index"], "the GPU index", 0)


def _lease_id(request: web.Request) -> int:
    return _int(request.match_info["id"], "the lease id", 1)


def _lease_json(record: Any, live: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A stored lease record; an active one also carries the lease manager's live view (client,
    bytes and calls so far, duration, worker pid)."""
    out = record.to_json()
    view = live.get(record.id)
    out["active"] = view is not None
    if view is not None:
        out.update(view)
    return out


def _actor(request: web.Request) -> str:
    return caller(request).identity or "anonymous"


def _leases(request: web.Request) -> LeaseManager:
    return request.app[LEASES]


def _views(request: web.Request) -> PoolViews:
    return request.app[VIEWS]


async def _lease_action(coro: Any) -> Any:
    try:
        return await coro
    except LeaseError as exc:
        raise ApiError(exc.status, str(exc), _lease_hint(exc.status)) from None


def _lease_hint(status: int) -> str:
    if status == 404:
        return "list GPUs with GET /api/v1/gpus and active leases with GET /api/v1/leases?state=active"
    return "check the GPU's state with GET /api/v1/gpus"


def _view(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except LeaseError as exc:
        raise ApiError(exc.status, str(exc), _lease_hint(exc.status)) from None


# ------------------------------------------------------------------------------ the handlers
async def healthz(request: web.Request) -> web.Response:
    app = request.app
    s = app[VIEWS].summary()
    # A GPU the watchdog found stuck (it cannot move on by itself) makes the server unhealthy
    # until it is repaired: a load balancer or monitor sees it, with the reason.
    inventory = app[INVENTORY]
    body = {"ok": not s["stuck"], "version": __version__, "remoting": app[REMOTING].address,
            "gpus": s["gpus"], "leases": s["leases"], "queue": s["queue"],
            # A simulated GPU runs no kernel: a monitor must be able to tell it from a real one.
            "simulated": sum(1 for g in inventory.gpus if g.simulated)}
    if inventory.fallback_reason:  # real mode found no GPU; `fallback_to_simulated` served one
        body["fallback"] = inventory.fallback_reason
    if s["stuck"]:
        body["stuck"] = s["stuck"]
    return _json(body, status=200 if body["ok"] else 503)


async def status(request: web.Request) -> web.Response:
    _query(request, ())
    app = request.app
    views = app[VIEWS]
    s = views.summary()
    who = caller(request)
    return _shown(request, {
        "version": __version__, "time": time.time(), "remoting": app[REMOTING].address,
        "auth": app[SETTINGS].auth, "you": {"name": who.identity, "role": who.role},
        "gpus": s["gpus"], "states": s["states"], "leases": s["leases"], "queue": s["queue"],
        # idle detach: leases without a GPU now, and the device memory they hold in host memory
        "detached": s["detached"], "detached_bytes": s["detached_bytes"],
        "active_leases": views.active_leases(), "counters": app[COUNTERS].snapshot(),
        # the remoting port's TLS: on/off, the fingerprint clients pin (http/keys.py)
        **tls_view(app),
    })


async def list_gpus(request: web.Request) -> web.Response:
    _query(request, ())
    return _shown(request, {"gpus": _views(request).gpu_views()})


async def fleet(request: web.Request) -> web.Response:
    """The whole fleet (pool/fleet_view.py): servers with their GPUs, leases anywhere, the queue."""
    _query(request, ())
    return _shown(request, await fleet_view(_views(request), request.app[STORE],
                                            remoting_address(request.app)))


async def list_servers(request: web.Request) -> web.Response:
    """The servers sharing this server's store: up (heartbeating) or down, and since when."""
    _query(request, ())
    servers = await request.app[STORE].servers()
    me = request.app[STORE].server
    for s in servers:
        s["this"] = s["name"] == me
    return _json({"servers": servers})


async def get_gpu(request: web.Request) -> web.Response:
    _query(request, ())
    return _shown(request, _view(_views(request).gpu_view, _gpu_index(request)))


async def drain_gpu(request: web.Request) -> web.Response:
    index = _gpu_index(request)
    slot = await _lease_action(_leases(request).drain(index, _actor(request)))
    return _shown(request, _views(request).gpu(slot))


async def undrain_gpu(request: web.Request) -> web.Response:
    index = _gpu_index(request)
    slot = await _lease_action(_leases(request).undrain(index, _actor(request)))
    return _shown(request, _views(request).gpu(slot))


async def clear_gpu(request: web.Request) -> web.Response:
    index = _gpu_index(request)
    slot = await _lease_action(_leases(request).clear(index, _actor(request)))
    return _shown(request, _views(request).gpu(slot))


def _time(text: str, what: str) -> float:
    """A query parameter in Unix time (seconds, a fraction allowed), or a 400 naming it."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise ApiError(400, f"{what} must be a time in Unix seconds, got {text!r}",
                       f"e.g. {what}=1767225600")
    return value


def lease_filter(query: dict[str, str]) -> LeaseFilter:
    """The lease filters of a query (`token`, `user`, `gpu`, `since`, `until`)."""
    return LeaseFilter(
        token=query.get("token") or None, user=query.get("user") or None,
        gpu=_int(query["gpu"], "gpu", 0) if query.get("gpu") else None,
        since=_time(query["since"], "since") if query.get("since") else None,
        until=_time(query["until"], "until") if query.get("until") else None)


async def list_leases(request: web.Request) -> web.Response:
    query = _query(request, ("state", "limit", "before", "token", "user", "gpu", "since",
                             "until"))
    state = query.get("state", "all")
    if state not in LEASE_STATES:
        raise ApiError(400, f"unknown lease state {state!r}",
                       f"state is one of: {', '.join(LEASE_STATES)}")
    limit, before = _paging(query)
    records = await request.app[STORE].leases(state, limit, before, lease_filter(query))
    live = {view["id"]: view for view in _views(request).active_leases()}
    return _shown(request, {"leases": [_lease_json(r, live) for r in records],
                            "next_before": records[-1].id if len(records) == limit else None})


async def get_lease(request: web.Request) -> web.Response:
    _query(request, ())
    lease_id = _lease_id(request)
    record = await request.app[STORE].get_lease(lease_id)
    if record is None:
        raise ApiError(404, f"no lease {lease_id}", "list leases with GET /api/v1/leases")
    live = {view["id"]: view for view in _views(request).active_leases()}
    out = _lease_json(record, live)
    # Its idle-detach transitions (detached, attached), oldest first.
    out["events"] = await request.app[STORE].lease_events(lease_id)
    return _shown(request, out)


async def end_lease(request: web.Request) -> web.Response:
    lease_id = _lease_id(request)
    body = await _body(request, ("reason",))
    reason = _str_field(body, "reason", "").strip()
    if len(reason) > MAX_REASON:
        raise ApiError(400, f"the reason is {len(reason)} characters long (at most {MAX_REASON})",
                       "give a shorter reason")
    lease = await _lease_action(_leases(request).end_lease(lease_id, _actor(request), reason))
    view = _views(request).lease(lease)
    # 202: the worker has been told to end the lease; the record is closed (end reason
    # "revoked") when it has exited.
    return _shown(request, view, status=202)


async def list_queue(request: web.Request) -> web.Response:
    _query(request, ())
    return _shown(request, {"queue": _views(request).queue_view()})


async def list_tokens(request: web.Request) -> web.Response:
    _query(request, ())
    tokens = await request.app[STORE].list_tokens()
    return _json({"tokens": [t.to_json() for t in tokens]})


async def create_token(request: web.Request) -> web.Response:
    body = await _body(request, ("name", "role", "expires", "weight"))
    name = _str_field(body, "name")
    try:
        check_token_name(name)
    except ValueError as exc:
        raise ApiError(400, f"bad token name {name!r}: {exc}", "choose another name") from None
    role = _str_field(body, "role", "user")
    if role not in TOKEN_ROLES:
        raise ApiError(400, f"unknown role {role!r}", f"role is one of: {', '.join(TOKEN_ROLES)}")
    expires_text = body.get("expires", "never")
    if expires_text is None:
        expires_text = "never"
    if not isinstance(expires_text, str):
        raise ApiError(400, f"the field 'expires' must be a string, got {json.dumps(expires_text)}",
                       'use "never", a duration such as "30d" or "12h", or an ISO 8601 date')
    try:
        expires = parse_expiry(expires_text)
    except ValueError as exc:
        raise ApiError(400, f"bad expiry {expires_text!r}: {exc}",
                       'use "never", a duration such as "30d" or "12h", or an ISO 8601 date') from None
    weight = body.get("weight", 1)
    if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= WEIGHT_MAX:
        raise ApiError(400, f"bad weight {json.dumps(weight)}: a token's share weight is a whole "
                       f"number from 1 to {WEIGHT_MAX}", "leave it out for 1, the default")
    try:
        record, secret = await request.app[STORE].create_token(name, role, expires,
                                                               _actor(request), weight)
    except TokenExists:
        raise ApiError(409, f"a token named {name!r} already exists",
                       "choose another name, or revoke the old token first "
                       f"(DELETE /api/v1/tokens/{name})") from None
    return _json({"token": record.to_json(), "secret": secret,
                  "note": "the secret is shown only this once: store it now"}, status=201)


async def revoke_token(request: web.Request) -> web.Response:
    _query(request, ())
    name = request.match_info["name"]
    try:
        record = await request.app[STORE].revoke_token(name, _actor(request))
    except NotFound:
        raise ApiError(404, f"no token named {name!r}",
                       "list tokens with GET /api/v1/tokens") from None
    return _json({"token": record.to_json()})


async def audit_log(request: web.Request) -> web.Response:
    limit, before = _paging(_query(request, ("limit", "before")))
    entries = await request.app[STORE].audit_log(limit, before)
    return _json({"audit": [e.to_json() for e in entries],
                  "next_before": entries[-1].id if len(entries) == limit else None})


REPORT_DEFAULT_S = 7 * 86400.0  # a report without `from` covers the week before `to`
REPORT_MAX_LEASES = 10_000_000  # leases of one period read for the waits (a bound, not a page)


async def report(request: web.Request) -> web.Response:
    """The usage report (pool/report.py) of [from, to), grouped by gpu, token or server: every
    server's figures on a shared store. Admin only: it names every token's usage."""
    query = _query(request, ("from", "to", "by"))
    until = _time(query["to"], "to") if query.get("to") else time.time()
    since = _time(query["from"], "from") if query.get("from") else until - REPORT_DEFAULT_S
    by = query.get("by", "gpu")
    if by not in GROUPINGS:
        raise ApiError(400, f"unknown grouping by={by!r}", f"by is one of: {', '.join(GROUPINGS)}")
    if not until > since:
        raise ApiError(400, "the report's period is empty: `to` must come after `from`",
                       "e.g. from=1767225600&to=1767830400 (Unix seconds)")
    gpus, minutes = await usage_of(request.app[STORE], request.app.get(USAGE),
                                   lambda: [g.index for g in request.app[INVENTORY].gpus],
                                   since, until)
    records = await request.app[STORE].leases("all", REPORT_MAX_LEASES, None,
                                              LeaseFilter(since=since, until=until))
    leases = lease_facts(records)
    return _json({"report": build_report(since, until, by, gpus, minutes, leases)})
