"""The pages (pool, leases, queue, lease history, tokens) and logging in and out."""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from gpupoold.dashboard.access import login_redirect, page, page_viewer, refused, set_cookie, viewer
from gpupoold.dashboard.fleet_live import fleet_payload
from gpupoold.dashboard.history import IDLE_WINDOW_S
from gpupoold.dashboard.payload import charts, day_charts, shown, state_payload
from gpupoold.dashboard.sessions import COOKIE, Session, Viewer, csrf_ok
from gpupoold.dashboard.state import DASHBOARD
from gpupoold.http.keys import AUTH, COUNTERS, SETTINGS, STORE
from gpupoold.store.database import LeaseFilter

log = logging.getLogger("gpupoold.dashboard")

HISTORY_ROWS = 50
HISTORY_PAGE_ROWS = 100
# The history page's time filter: (value, label, seconds back; None: any time).
PERIODS = (("day", "in the last day", 86400.0), ("hour", "in the last hour", 3600.0),
           ("week", "in the last week", 7 * 86400.0), ("all", "at any time", None))


async def root(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui/")


async def overview(request: web.Request) -> web.Response:
    v, new = await page_viewer(request)
    payload = shown(v, state_payload(request.app))
    return page(request, "overview.html", v, new, state=payload,
                charts=charts(request.app, payload["gpus"]),
                day=await day_charts(request.app, payload["gpus"]),
                idle_minutes=int(IDLE_WINDOW_S // 60))


async def leases_page(request: web.Request) -> web.Response:
    v, new = await page_viewer(request)
    payload = shown(v, state_payload(request.app))
    ended = await request.app[STORE].leases("ended", HISTORY_ROWS, None)
    history = []
    for r in ended:
        history.append({
            "id": r.id, "gpu": _gpus_of(r), "token": r.token_name, "host": r.client_host,
            "pid": r.client_pid, "program": r.program, "started": r.started,
            "duration": (r.ended - r.started) if r.ended is not None else None,
            "bytes": r.bytes_h2d + r.bytes_d2h, "bytes_h2d": r.bytes_h2d,
            "bytes_d2h": r.bytes_d2h, "end_reason": r.end_reason or "n/a",
            "end_detail": r.end_detail or "",
            "scrub": ("pending" if r.scrub_ok is None else "passed" if r.scrub_ok else "failed"),
        })
    return page(request, "leases.html", v, new, state=payload, history=shown(v, history))


def _gpus_of(r: Any) -> str:
    """The GPU column of a lease record: every GPU of a lease of several (issue 37), device 0
    first, else its one GPU."""
    return ", ".join(str(i) for i in r.gpus) if len(r.gpus) > 1 else str(r.gpu_index)


def _history_row(r: Any) -> dict[str, Any]:
    return {"id": r.id, "gpu": _gpus_of(r), "token": r.token_name, "host": r.client_host,
            "user": r.client_user, "pid": r.client_pid, "program": r.program,
            "started": r.started, "queued_s": r.queued_s,
            "duration": (r.ended - r.started) if r.ended is not None else None,
            "bytes": r.bytes_h2d + r.bytes_d2h,
            "end_reason": r.end_reason or ("running" if r.ended is None else "n/a"),
            "end_detail": r.end_detail or "",
            "scrub": ("pending" if r.scrub_ok is None else "passed" if r.scrub_ok else "failed"),
            "detaches": r.detaches, "detached_s": r.detached_s}


async def history_page(request: web.Request) -> web.Response:
    """The lease history from the database, filtered by token, client user, GPU and when the
    lease started (GET parameters of the page's own form; a wrong one is said, not ignored)."""
    v, new = await page_viewer(request)
    q = request.query
    period = q.get("period", "day")
    back = {value: seconds for value, _, seconds in PERIODS}
    problem = ""
    if period not in back:
        problem, period = f"unknown period {period!r}: showing the last day", "day"
    gpu: int | None = None
    if q.get("gpu", "").strip():
        try:
            gpu = int(q["gpu"])
            if gpu < 0:
                raise ValueError
        except ValueError:
            problem = f"GPU must be a GPU index (0, 1, ...), not {q['gpu']!r}: any GPU shown"
    before: int | None = None
    if q.get("before", "").isdigit():
        before = int(q["before"])
    seconds = back[period]
    filters = LeaseFilter(token=q.get("token", "").strip() or None,
                          user=q.get("user", "").strip() or None, gpu=gpu,
                          since=time.time() - seconds if seconds is not None else None)
    records = await request.app[STORE].leases("all", HISTORY_PAGE_ROWS, before, filters)
    next_before = records[-1].id if len(records) == HISTORY_PAGE_ROWS else None
    keep = {k: q[k] for k in ("token", "user", "gpu", "period") if q.get(k)}
    next_url = "/ui/history?" + urlencode({**keep, "before": next_before}) if next_before else ""
    return page(request, "history.html", v, new,
                rows=shown(v, [_history_row(r) for r in records]),
                filters=filters, period=period, periods=[(p, label) for p, label, _ in PERIODS],
                problem=problem, next_before=next_before, next_url=next_url)


async def queue_page(request: web.Request) -> web.Response:
    v, new = await page_viewer(request)
    return page(request, "queue.html", v, new, state=shown(v, state_payload(request.app)))


async def fleet_page(request: web.Request) -> web.Response:
    """Every server sharing this one's store, with its GPUs and health; the leases and the
    queue of all (kept current by dashboard/fleet_live.py's stream)."""
    v, new = await page_viewer(request)
    view = await fleet_payload(request.app, probe=False)  # the page's stream probes
    return page(request, "fleet.html", v, new, fleet=shown(v, view))


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
