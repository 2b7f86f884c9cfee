"""The pages (pool, leases, queue, tokens) and logging in and out."""

from __future__ import annotations

import logging

from aiohttp import web

from gpupoold.dashboard.access import login_redirect, page, page_viewer, refused, set_cookie, viewer
from gpupoold.dashboard.history import IDLE_WINDOW_S
from gpupoold.dashboard.payload import charts, state_payload
from gpupoold.dashboard.sessions import COOKIE, Session, Viewer, csrf_ok
from gpupoold.dashboard.state import DASHBOARD
from gpupoold.http.keys import AUTH, COUNTERS, SETTINGS, STORE

log = logging.getLogger("gpupoold.dashboard")

HISTORY_ROWS = 50


async def root(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui/")


async def overview(request: web.Request) -> web.Response:
    v, new = await page_viewer(request)
    payload = state_payload(request.app)
    return page(request, "overview.html", v, new, state=payload,
                 charts=charts(request.app, payload["gpus"]), idle_minutes=int(IDLE_WINDOW_S // 60))


async def leases_page(request: web.Request) -> web.Response:
    v, new = await page_viewer(request)
    payload = state_payload(request.app)
    ended = await request.app[STORE].leases("ended", HISTORY_ROWS, None)
    history = []
    for r in ended:
        history.append({
            "id": r.id, "gpu": r.gpu_index, "token": r.token_name, "host": r.client_host,
            "pid": r.client_pid, "program": r.program, "started": r.started,
            "duration": (r.ended - r.started) if r.ended is not None else None,
            "bytes": r.bytes_h2d + r.bytes_d2h, "bytes_h2d": r.bytes_h2d,
            "bytes_d2h": r.bytes_d2h, "end_reason": r.end_reason or "n/a",
            "end_detail": r.end_detail or "",
            "scrub": ("pending" if r.scrub_ok is None else "passed" if r.scrub_ok else "failed"),
        })
    return page(request, "leases.html", v, new, state=payload, history=history)


async def queue_page(request: web.Request) -> web.Response:
    v, new = await page_viewer(request)
    return page(request, "queue.html", v, new, state=state_payload(request.app))


async def tokens_page(request: web.Request) -> web.Response:
    v, new = await page_viewer(request)
    if v.session is None:
        login_redirect(request)
    if not v.admin:
        return refused(request, 403, "the tokens page needs an admin session",
                       "log in with an admin token", v)
    return await render_tokens(request, v, new)


async def render_tokens(request: web.Request, v: Viewer, new: Session | None, *, status: int = 200,
                  secret: str = "", created: str = "", error: str = "") -> web.Response:
    tokens = await request.app[STORE].list_tokens()
    resp = page(request, "tokens.html", v, new, tokens=[t.to_json() for t in tokens],
                 secret=secret, created=created, error=error)
    resp.set_status(status)
    return resp


async def login_form(request: web.Request) -> web.Response:
    v = await viewer(request)
    return request.app[DASHBOARD].render(
        "login.html", viewer=v or Viewer(None, "anonymous", "anonymous"), page="login",
        error="", anonymous=request.app[SETTINGS].http_anonymous_read)


async def login(request: web.Request) -> web.Response:
    form = await request.post()
    token = form.get("token")
    token = token.strip() if isinstance(token, str) else ""
    dash = request.app[DASHBOARD]
    nobody = Viewer(None, "anonymous", "anonymous")
    if not token:
        return dash.render("login.html", status=400, viewer=nobody, page="login",
                           error="paste a token into the field (an administrator creates one "
                                 "with `gpupoold token create --name NAME`)",
                           anonymous=request.app[SETTINGS].http_anonymous_read)
    decision = await request.app[AUTH].check(token, request.remote or "")
    if not decision.ok:
        request.app[COUNTERS].inc("http_auth_refused", reason=decision.reason or "refused")
        log.info("dashboard login from %s refused: %s", request.remote or "?", decision.reason)
        return dash.render("login.html", status=401, viewer=nobody, page="login",
                           error=decision.message or "the token was refused",
                           anonymous=request.app[SETTINGS].http_anonymous_read)
    old = request.cookies.get(COOKIE)
    if old:
        dash.sessions.end(old)  # a fresh id at every login
    session = dash.sessions.create(token, decision.identity, decision.role)
    log.info("dashboard login: '%s' (%s) from %s", decision.identity, decision.role,
             request.remote or "?")
    resp = web.HTTPSeeOther("/ui/")
    set_cookie(request, resp, session)
    raise resp


async def logout(request: web.Request) -> web.Response:
    dash = request.app[DASHBOARD]
    sid = request.cookies.get(COOKIE)
    session = dash.sessions.get(sid)
    if session is not None:
        form = await request.post()
        if not csrf_ok(session, form.get("csrf")):
            return refused(request, 403, "the form's CSRF token is missing or wrong",
                           "reload the page and log out again")
        dash.sessions.end(session.sid)
    resp = web.HTTPSeeOther("/ui/login")
    resp.del_cookie(COOKIE, path="/ui")
    raise resp
