"""Who is asking (a session, the anonymous reader, or nobody), the cookie, and the two ways a
page answers: rendered for its viewer, or refused with what happened and what to do."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from gpupoold.dashboard.sessions import COOKIE, SESSION_IDLE_S, Session, Viewer
from gpupoold.dashboard.state import DASHBOARD
from gpupoold.http.keys import AUTH, COUNTERS, SETTINGS

log = logging.getLogger("gpupoold.dashboard")


async def viewer(request: web.Request) -> Viewer | None:
    """The session of the request (checked: idle time, token still valid), the anonymous
    reader when allowed, else None."""
    dash = request.app[DASHBOARD]
    sid = request.cookies.get(COOKIE)
    session = dash.sessions.get(sid)
    if session is not None:
        decision = await request.app[AUTH].check(session.token, request.remote or "")
        if decision.ok:
            session.role = decision.role
            return Viewer(session, session.identity, session.role)
        dash.sessions.end(session.sid)
        log.info("dashboard session of '%s' ended: %s", session.identity,
                 decision.reason or "token refused")
    settings = request.app[SETTINGS]
    if settings.auth == "none":
        return Viewer(None, "anonymous", "admin-auto")
    if settings.http_anonymous_read:
        return Viewer(None, "anonymous", "anonymous")
    return None


def set_cookie(request: web.Request, resp: web.StreamResponse, session: Session) -> None:
    resp.set_cookie(COOKIE, session.sid, httponly=True, samesite="Strict", path="/ui",
                    secure=request.secure, max_age=int(SESSION_IDLE_S))


async def auto_session(request: web.Request, v: Viewer) -> tuple[Viewer, Session | None]:
    """With `auth = none`, an admin session for the visitor (CSRF needs one)."""
    if v.role != "admin-auto":
        return v, None
    s = request.app[DASHBOARD].sessions.create("", "anonymous", "admin")
    return Viewer(s, "anonymous", "admin"), s


def login_redirect(request: web.Request) -> web.Response:
    raise web.HTTPSeeOther("/ui/login")


async def page_viewer(request: web.Request) -> tuple[Viewer, Session | None]:
    v = await viewer(request)
    if v is None:
        login_redirect(request)
        raise AssertionError("unreachable")  # pragma: no cover
    return await auto_session(request, v)


def page(request: web.Request, name: str, v: Viewer, new: Session | None,
          **ctx: Any) -> web.Response:
    resp = request.app[DASHBOARD].render(name, viewer=v, page=name.removesuffix(".html"), **ctx)
    if new is not None:
        set_cookie(request, resp, new)
    return resp


def refused(request: web.Request, status: int, what: str, hint: str,
            v: Viewer | None = None) -> web.Response:
    if status in (401, 403):
        request.app[COUNTERS].inc("http_auth_refused", reason="dashboard")
    log.info("dashboard %s %s from %s refused: %s", request.method, request.path,
             request.remote or "?", what)
    return request.app[DASHBOARD].render(
        "error.html", status=status, viewer=v or Viewer(None, "anonymous", "anonymous"),
        page="error", title="Refused" if status == 403 else "Error", message=what, hint=hint)
