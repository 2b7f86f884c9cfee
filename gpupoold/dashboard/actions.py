"""Admin actions from the pages: drain, undrain, clear, end a lease (on this server, or from the
Fleet page on any server of the fleet), create and revoke tokens. Each needs an admin session
and the session's CSRF token, and a confirmation."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gpupoold.dashboard.access import refused, viewer
from gpupoold.dashboard.pages import render_tokens
from gpupoold.dashboard.sessions import Viewer, csrf_ok
from gpupoold.dashboard.state import DASHBOARD
from gpupoold.http.auth import ApiError
from gpupoold.http.fleet_actions import forward, target_server
from gpupoold.http.keys import LEASES, STORE
from gpupoold.pool.leases import LeaseError
from gpupoold.store.database import NotFound, TokenExists
from gpupoold.store.tokens import check_token_name, parse_expiry

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _admin_form(request: web.Request) -> tuple[Viewer | None, Any, web.Response | None]:
    """(viewer, form, None) for an admin session with the right CSRF token, else a 403."""
    v = await viewer(request)
    if v is None or not v.admin:
        who = "no session" if v is None or v.session is None else f"'{v.name}' is a {v.role}"
        return v, None, refused(request, 403, f"this action needs an admin session ({who})",
                                "log in with an admin token at /ui/login", v)
    form = await request.post()
    assert v.session is not None
    if not csrf_ok(v.session, form.get("csrf")):
        return v, None, refused(request, 403, "the form's CSRF token is missing or wrong",
                                "reload the page and try again (the form was not made by this "
                                "session's page)", v)
    return v, form, None


def _confirm(request: web.Request, v: Viewer, form: Any, question: str) -> web.Response | None:
    """A confirmation page unless the form says confirm=yes."""
    if form.get("confirm") == "yes":
        return None
    fields = [(k, val) for k, val in form.items() if k not in ("confirm", "csrf")
              and isinstance(val, str)]
    return request.app[DASHBOARD].render("confirm.html", viewer=v, page="confirm",
                                         question=question, action=request.path, fields=fields)


def _back(form: Any, default: str = "/ui/") -> web.HTTPSeeOther:
    nxt = form.get("next") if form is not None else None
    if isinstance(nxt, str) and nxt.startswith("/ui/") and "//" not in nxt and "\\" not in nxt:
        return web.HTTPSeeOther(nxt)
    return web.HTTPSeeOther(default)


async def _numbered_action(request: web.Request, key: str, what: str, where: str,
                           question: Callable[[int], str],
                           act: Callable[[int, Viewer, Any], Awaitable[Any]], check: str,
                           back: str) -> web.Response:
    """What the GPU and lease buttons share: an admin's form, a whole number in the path (`key`),
    a confirmation, the action, a refusal that says what to check, and back to the page."""
    v, form, refusal = await _admin_form(request)
    if refusal is not None:
        return refusal
    assert v is not None
    try:
        number = int(request.match_info[key])
    except ValueError:
        return refused(request, 400, f"the {what} must be a whole number",
                       f"use the buttons on {where}", v)
    ask = _confirm(request, v, form, question(number))
    if ask is not None:
        return ask
    try:
        refusal = await act(number, v, form)  # a page that says why not, from a fleet action
    except LeaseError as exc:
        return refused(request, exc.status, str(exc), check, v)
    if isinstance(refusal, web.Response):
        return refusal
    request.app[DASHBOARD].notify()
    raise _back(form, back)


def gpu_action(name: str) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        fn = getattr(request.app[LEASES], name)
        return await _numbered_action(
            request, "index", "GPU index", "the pool overview",
            lambda index: f"{name.capitalize()} GPU {index}?",
            lambda index, v, _form: fn(index, v.name), "check the GPU's state on the overview",
            "/ui/")
    handler.__name__ = f"ui_{name}"
    return handler


async def end_lease(request: web.Request) -> web.Response:
    async def end(lease_id: int, v: Viewer, form: Any) -> None:
        reason = form.get("reason")
        reason = reason.strip()[:500] if isinstance(reason, str) else ""
        await request.app[LEASES].end_lease(lease_id, v.name, reason or "ended from the dashboard")

    return await _numbered_action(
        request, "id", "lease id", "the leases page",
        lambda lease_id: f"End lease {lease_id}? The client loses its GPU.", end,
        "the lease may have ended already", "/ui/leases")


async def _on_server(request: web.Request, v: Viewer, server: str, local: Callable[[], Awaitable[Any]],
                     path: str, body: dict[str, Any]) -> web.Response | None:
    """Do an action of the Fleet page on `server`: `local()` when it is this server, else POST
    `body` to `path` of that server's API with the session's own token, as the API's fleet
    actions do (http/fleet_actions.py), so that server checks the role and audits it under the
    session's name. None when done, else a page that says why not."""
    store = request.app[STORE]
    check = f"check server {server}'s state on the Fleet page"
    try:
        target = await target_server(store, server)
        if target is None:
            await local()
            return None
        assert v.session is not None
        auth = f"Bearer {v.session.token}" if v.session.token else ""  # none with auth = none
        status, data = await forward(target, path, auth, json.dumps(body).encode())
    except ApiError as exc:
        return refused(request, exc.status, exc.message, exc.hint or check, v)
    except LeaseError as exc:
        return refused(request, exc.status, str(exc), check, v)
    if status >= 400:
        reply = data if isinstance(data, dict) else {}
        return refused(request, status, f"server {server}: {reply.get('error') or status}",
                       str(reply.get("hint") or check), v)
    return None


def fleet_gpu_action(name: str) -> Handler:
    """Drain, undrain or clear GPU `index` of fleet server `server` (the Fleet page's buttons)."""
    async def handler(request: web.Request) -> web.Response:
        server = request.match_info["server"]

        async def act(index: int, v: Viewer, _form: Any) -> web.Response | None:
            return await _on_server(request, v, server,
                                    lambda: getattr(request.app[LEASES], name)(index, v.name),
                                    f"/api/v1/gpus/{index}/{name}", {})

        return await _numbered_action(
            request, "index", "GPU index", "the Fleet page",
            lambda index: f"{name.capitalize()} GPU {index} of server {server}?", act,
            "check the GPU's state on the Fleet page", "/ui/fleet")
    handler.__name__ = f"ui_fleet_{name}"
    return handler


async def fleet_end_lease(request: web.Request) -> web.Response:
    """End lease `id`, running on fleet server `server` (the Fleet page's button)."""
    server = request.match_info["server"]

    async def act(lease_id: int, v: Viewer, form: Any) -> web.Response | None:
        reason = form.get("reason")
        reason = reason.strip()[:500] if isinstance(reason, str) else ""
        reason = reason or "ended from the dashboard"
        return await _on_server(
            request, v, server, lambda: request.app[LEASES].end_lease(lease_id, v.name, reason),
            f"/api/v1/leases/{lease_id}/end", {"reason": reason})

    return await _numbered_action(
        request, "id", "lease id", "the Fleet page",
        lambda lease_id: f"End lease {lease_id} on server {server}? The client loses its GPU.",
        act, "the lease may have ended already", "/ui/fleet")


async def create_token(request: web.Request) -> web.Response:
    v, form, refusal = await _admin_form(request)
    if refusal is not None:
        return refusal
    assert v is not None
    name = str(form.get("name") or "").strip()
    role = str(form.get("role") or "user")
    expires_text = str(form.get("expires") or "never").strip() or "never"
    try:
        check_token_name(name)
        if role not in ("user", "admin"):
            raise ValueError(f"unknown role {role!r}: use user or admin")
        expires = parse_expiry(expires_text)
    except ValueError as exc:
        return await render_tokens(request, v, None, status=400, error=f"cannot create {name!r}: {exc}")
    ask = _confirm(request, v, form, f"Create the {role} token {name!r} (expires: {expires_text})?")
    if ask is not None:
        return ask
    try:
        record, secret = await request.app[STORE].create_token(name, role, expires, v.name)
    except TokenExists:
        return await render_tokens(request, v, None, status=409,
                             error=f"a token named {name!r} already exists: choose another name "
                                   "or revoke the old one first")
    return await render_tokens(request, v, None, status=201, secret=secret, created=record.name)


async def revoke_token(request: web.Request) -> web.Response:
    v, form, refusal = await _admin_form(request)
    if refusal is not None:
        return refusal
    assert v is not None
    name = request.match_info["name"]
    ask = _confirm(request, v, form, f"Revoke the token {name!r}? Its clients are refused from now on.")
    if ask is not None:
        return ask
    try:
        await request.app[STORE].revoke_token(name, v.name)
    except NotFound:
        return await render_tokens(request, v, None, status=404, error=f"no token named {name!r}")
    raise web.HTTPSeeOther("/ui/tokens")
