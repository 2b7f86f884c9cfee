"""The web dashboard: server-rendered pages under `/ui/`, login sessions, CSRF and live updates.

Pages are jinja2 templates (autoescape on) from `web/templates/`; our own JavaScript and CSS are
served from `web/static/` at `/ui/static/`. The routes are declared with the role `SESSION`
(http_auth.py): the Bearer-token middleware lets them through and the handlers here check the
dashboard's own session instead:

- `POST /ui/login` takes a user or admin token (form field `token`), checks it like the API
  does, and starts a session: a random id in the cookie `gpupool_session` (HttpOnly,
  SameSite=Strict, Path=/ui, Secure over HTTPS). Sessions live in memory (a restart logs
  everybody out) and end after `SESSION_IDLE_S` without a request, at logout, or when the token
  is revoked or expires (it is checked again at every page and action).
- Each session has its own CSRF token, put in every admin form as the hidden field `csrf`.
  Admin actions need an admin session AND that token, else 403 with a page that says why; a form
  posted without `confirm=yes` (set by the page's confirm() dialog) gets a confirmation page.
- With `http_anonymous_read`, pages are readable without a session (no admin controls);
  otherwise a page without a session redirects to the login page. With `auth = none` every
  visitor gets an admin session automatically (as in the API).
- `GET /ui/events`: server-sent events, `event: state` with the same views as the API (gpus,
  active leases, queue, summary) whenever they change and at least every `EVENT_EVERY_S`.

Lease history comes from the store (its own thread); nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

from gpupoold import __version__
from gpupoold.events import GpuChanged
from gpupoold.history import IDLE_WINDOW_S, History, polyline
from gpupoold.http_auth import PUBLIC, SESSION, declare_roles
from gpupoold.keys import AUTH, COUNTERS, EVENTS, LEASES, SETTINGS, STORE, TELEMETRY, VIEWS
from gpupoold.leases import LeaseError
from gpupoold.metrics import METRICS_KEY
from gpupoold.store import NotFound, TokenExists
from gpupoold.tokens import check_token_name, parse_expiry

log = logging.getLogger("gpupoold.dashboard")

COOKIE = "gpupool_session"
SESSION_IDLE_S = 12 * 3600.0
EVENT_EVERY_S = 2.0  # an SSE state event at least this often
EVENT_POLL_S = 0.5  # how often a stream looks for changes the lease manager does not announce
STREAM_BACKLOG = 64  # announced changes a stream may fall behind before it loses the oldest
RECHECK_TOKEN_S = 30.0  # an open event stream re-checks its session's token this often
HISTORY_ROWS = 50
MAX_SESSIONS = 10000
STATES = ("free", "leased", "scrubbing", "quarantined", "drained")
CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# ------------------------------------------------------------------------------ web/ files
def web_dir() -> Path:
    """The `web/` folder: beside the package in a source checkout, else the installed
    `gpupoold_web` package (pyproject.toml maps web/ to it)."""
    here = Path(__file__).resolve().parent.parent / "web"
    if (here / "templates").is_dir():
        return here
    import gpupoold_web  # type: ignore[import-not-found]

    return Path(gpupoold_web.__file__).resolve().parent


# ------------------------------------------------------------------------------ sessions
@dataclass
class Session:
    sid: str
    token: str  # kept in memory only, to notice a revoked or expired token
    identity: str
    role: str
    csrf: str
    created: float = field(default_factory=time.monotonic)
    seen: float = field(default_factory=time.monotonic)


class Sessions:
    def __init__(self, idle_s: float = SESSION_IDLE_S) -> None:
        self.idle_s = idle_s
        self._by_id: dict[str, Session] = {}

    def create(self, token: str, identity: str, role: str) -> Session:
        self.expire()
        if len(self._by_id) >= MAX_SESSIONS:  # drop the least recently used
            oldest = min(self._by_id.values(), key=lambda s: s.seen)
            self._by_id.pop(oldest.sid, None)
        s = Session(secrets.token_urlsafe(32), token, identity, role, secrets.token_urlsafe(32))
        self._by_id[s.sid] = s
        return s

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        s = self._by_id.get(sid)
        if s is None:
            return None
        now = time.monotonic()
        if now - s.seen > self.idle_s:
            self._by_id.pop(sid, None)
            return None
        s.seen = now
        return s

    def end(self, sid: str) -> None:
        self._by_id.pop(sid, None)

    def expire(self) -> None:
        now = time.monotonic()
        for sid in [k for k, s in self._by_id.items() if now - s.seen > self.idle_s]:
            del self._by_id[sid]

    def __len__(self) -> int:
        return len(self._by_id)


@dataclass(frozen=True)
class Viewer:
    """Who looks at a page: a session, or the anonymous reader."""

    session: Session | None
    name: str
    role: str  # "admin", "user" or "anonymous"

    @property
    def admin(self) -> bool:
        return self.session is not None and self.role == "admin"

    @property
    def csrf(self) -> str:
        return self.session.csrf if self.session is not None else ""


class Dashboard:
    """What the dashboard keeps per application: templates, sessions, history, change signal."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(root / "templates")),
            autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
            lstrip_blocks=True)
        self.env.filters["bytes"] = human_bytes
        self.env.filters["when"] = when
        self.env.filters["duration"] = duration
        self.sessions = Sessions()
        self.history: History | None = None
        self.changed = asyncio.Event()  # replaced at every notify(): each stream waits on its own
        self.closing = False  # the daemon stops: event streams end
        # One queue per open event stream. A GPU state change puts the state of that moment in
        # every queue, so a stream sends each change in order even when the next one follows
        # within milliseconds (a simulated scrub takes ~20 ms): a snapshot taken when the stream
        # gets round to it would skip `scrubbing`.
        self.streams: set[asyncio.Queue[dict[str, Any]]] = set()

    def notify(self) -> None:
        """Something changed: wake every event stream."""
        self.changed.set()
        self.changed = asyncio.Event()

    def publish(self, payload: dict[str, Any]) -> None:
        """Queue `payload` (the state at a change) for every open stream, then wake them. A
        stream that has fallen STREAM_BACKLOG changes behind loses its oldest ones."""
        for q in self.streams:
            if q.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
            q.put_nowait(payload)
        self.notify()

    def render(self, name: str, status: int = 200, **ctx: Any) -> web.Response:
        text = self.env.get_template(name).render(version=__version__, **ctx)
        return web.Response(text=text, status=status, content_type="text/html",
                            charset="utf-8", headers=SECURITY_HEADERS)


SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Frame-Options": "DENY",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
                    "Cache-Control": "no-store"}

DASHBOARD = web.AppKey("gpupool_dashboard", Dashboard)


# ------------------------------------------------------------------------------ formatting
def human_bytes(n: Any) -> str:
    if not isinstance(n, int | float):
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def when(t: Any) -> str:
    if not isinstance(t, int | float):
        return "n/a"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def duration(s: Any) -> str:
    if not isinstance(s, int | float):
        return "n/a"
    s = int(s)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h {m:02d}m {sec:02d}s" if h else (f"{m}m {sec:02d}s" if m else f"{sec}s")


# ------------------------------------------------------------------------------ views
def state_payload(app: web.Application) -> dict[str, Any]:
    """The JSON of an `event: state` (and the pages' data): the API's views, each GPU with
    `idle` (leased and 0 % for the last 5 minutes) added."""
    views = app[VIEWS]
    gpus = views.gpu_views()
    history = app[DASHBOARD].history
    now = time.time()
    for g in gpus:
        lease = g.get("lease")
        started = lease.get("started") if isinstance(lease, dict) else None
        g["idle"] = bool(history is not None and g.get("state") == "leased"
                         and history.idle(g["index"], started, now))
    return {"time": now, "gpus": gpus, "leases": views.active_leases(),
            "queue": views.queue_view(), "summary": views.summary()}


def _stable(payload: dict[str, Any]) -> str:
    """The payload without what moves by itself (clock, durations, waiting times): a change
    here is worth an event at once."""
    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()
                    if k not in ("time", "duration_s", "waiting_s", "at")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return json.dumps(strip(payload), sort_keys=True, default=str)


CHART_W, CHART_H = 300.0, 60.0


def charts(app: web.Application, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    history = app[DASHBOARD].history
    end = time.time()
    start = end - (history.span if history is not None else 3600.0)
    out: dict[str, Any] = {"width": CHART_W, "height": CHART_H, "util": {}, "mem": {},
                           "copy": "", "copy_top": 0.0, "copy_last": None}
    if history is None:
        return out
    # The time axis spans the last hour, or less while the daemon has less history (at least
    # a minute): a young daemon's few points would otherwise sit in the last pixel.
    first = [p.at for g in gpus for p in history.gpu(g["index"])[:1]]
    first += [p.at for p in history.pool()[:1]]
    if first:
        start = max(start, min(min(first), end - 60.0))
    for g in gpus:
        pts = history.gpu(g["index"])
        out["util"][g["index"]] = polyline([(p.at, p.util) for p in pts], CHART_W, CHART_H,
                                           100.0, start, end)
        last = next((p.util for p in reversed(pts) if p.util is not None), None)
        out.setdefault("util_last", {})[g["index"]] = last
    pool = history.pool()
    top = max((p.copy_bps for p in pool), default=0.0)
    out["copy_top"] = top
    out["copy_last"] = pool[-1].copy_bps if pool else None
    out["copy"] = polyline([(p.at, p.copy_bps) for p in pool], CHART_W, CHART_H,
                           top if top > 0 else 1.0, start, end)
    return out


def chart_update(app: web.Application, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    """What the page's script needs to redraw the charts: the polylines and the captions'
    values as text (the same formatting as the page's)."""
    c = charts(app, gpus)
    util_last = c.get("util_last") or {}
    return {"util": {str(i): pts for i, pts in c["util"].items()},
            "util_now": {str(i): (f"{v} %" if v is not None else "not reported")
                         for i, v in util_last.items()},
            "copy": c["copy"], "copy_top": f"{human_bytes(c['copy_top'])}/s",
            "copy_now": (f"{human_bytes(c['copy_last'])}/s" if c["copy_last"] is not None
                         else "no data yet")}


# ------------------------------------------------------------------------------ who is it
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


def _set_cookie(request: web.Request, resp: web.StreamResponse, session: Session) -> None:
    resp.set_cookie(COOKIE, session.sid, httponly=True, samesite="Strict", path="/ui",
                    secure=request.secure, max_age=int(SESSION_IDLE_S))


async def _auto_session(request: web.Request, v: Viewer) -> tuple[Viewer, Session | None]:
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
    return await _auto_session(request, v)


def _page(request: web.Request, name: str, v: Viewer, new: Session | None,
          **ctx: Any) -> web.Response:
    resp = request.app[DASHBOARD].render(name, viewer=v, page=name.removesuffix(".html"), **ctx)
    if new is not None:
        _set_cookie(request, resp, new)
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


# ------------------------------------------------------------------------------ pages
async def root(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui/")


async def overview(request: web.Request) -> web.Response:
    v, new = await page_viewer(request)
    payload = state_payload(request.app)
    return _page(request, "overview.html", v, new, state=payload,
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
    return _page(request, "leases.html", v, new, state=payload, history=history)


async def queue_page(request: web.Request) -> web.Response:
    v, new = await page_viewer(request)
    return _page(request, "queue.html", v, new, state=state_payload(request.app))


async def tokens_page(request: web.Request) -> web.Response:
    v, new = await page_viewer(request)
    if v.session is None:
        login_redirect(request)
    if not v.admin:
        return refused(request, 403, "the tokens page needs an admin session",
                       "log in with an admin token", v)
    return await _tokens(request, v, new)


async def _tokens(request: web.Request, v: Viewer, new: Session | None, *, status: int = 200,
                  secret: str = "", created: str = "", error: str = "") -> web.Response:
    tokens = await request.app[STORE].list_tokens()
    resp = _page(request, "tokens.html", v, new, tokens=[t.to_json() for t in tokens],
                 secret=secret, created=created, error=error)
    resp.set_status(status)
    return resp


# ------------------------------------------------------------------------------ login
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
    _set_cookie(request, resp, session)
    raise resp


async def logout(request: web.Request) -> web.Response:
    dash = request.app[DASHBOARD]
    sid = request.cookies.get(COOKIE)
    session = dash.sessions.get(sid)
    if session is not None:
        form = await request.post()
        if not _csrf_ok(session, form.get("csrf")):
            return refused(request, 403, "the form's CSRF token is missing or wrong",
                           "reload the page and log out again")
        dash.sessions.end(session.sid)
    resp = web.HTTPSeeOther("/ui/login")
    resp.del_cookie(COOKIE, path="/ui")
    raise resp


def _csrf_ok(session: Session, sent: Any) -> bool:
    return isinstance(sent, str) and bool(sent) and hmac.compare_digest(sent, session.csrf)


# ------------------------------------------------------------------------------ admin actions
async def _admin_form(request: web.Request) -> tuple[Viewer | None, Any, web.Response | None]:
    """(viewer, form, None) for an admin session with the right CSRF token, else a 403."""
    v = await viewer(request)
    if v is None or not v.admin:
        who = "no session" if v is None or v.session is None else f"'{v.name}' is a {v.role}"
        return v, None, refused(request, 403, f"this action needs an admin session ({who})",
                                "log in with an admin token at /ui/login", v)
    form = await request.post()
    assert v.session is not None
    if not _csrf_ok(v.session, form.get("csrf")):
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


def _gpu_action(name: str) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        v, form, refusal = await _admin_form(request)
        if refusal is not None:
            return refusal
        assert v is not None
        try:
            index = int(request.match_info["index"])
        except ValueError:
            return refused(request, 400, "the GPU index must be a whole number",
                           "use the buttons on the pool overview", v)
        ask = _confirm(request, v, form, f"{name.capitalize()} GPU {index}?")
        if ask is not None:
            return ask
        fn = getattr(request.app[LEASES], name)
        try:
            await fn(index, v.name)
        except LeaseError as exc:
            return refused(request, exc.status, str(exc), "check the GPU's state on the overview", v)
        request.app[DASHBOARD].notify()
        raise _back(form)
    handler.__name__ = f"ui_{name}"
    return handler


async def end_lease(request: web.Request) -> web.Response:
    v, form, refusal = await _admin_form(request)
    if refusal is not None:
        return refusal
    assert v is not None
    try:
        lease_id = int(request.match_info["id"])
    except ValueError:
        return refused(request, 400, "the lease id must be a whole number",
                       "use the buttons on the leases page", v)
    ask = _confirm(request, v, form, f"End lease {lease_id}? The client loses its GPU.")
    if ask is not None:
        return ask
    reason = form.get("reason")
    reason = reason.strip()[:500] if isinstance(reason, str) else ""
    try:
        await request.app[LEASES].end_lease(lease_id, v.name, reason or "ended from the dashboard")
    except LeaseError as exc:
        return refused(request, exc.status, str(exc), "the lease may have ended already", v)
    request.app[DASHBOARD].notify()
    raise _back(form, "/ui/leases")


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
        return await _tokens(request, v, None, status=400, error=f"cannot create {name!r}: {exc}")
    ask = _confirm(request, v, form, f"Create the {role} token {name!r} (expires: {expires_text})?")
    if ask is not None:
        return ask
    try:
        record, secret = await request.app[STORE].create_token(name, role, expires, v.name)
    except TokenExists:
        return await _tokens(request, v, None, status=409,
                             error=f"a token named {name!r} already exists: choose another name "
                                   "or revoke the old one first")
    return await _tokens(request, v, None, status=201, secret=secret, created=record.name)


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
        return await _tokens(request, v, None, status=404, error=f"no token named {name!r}")
    raise web.HTTPSeeOther("/ui/tokens")


# ------------------------------------------------------------------------------ live updates
async def events(request: web.Request) -> web.StreamResponse:
    v = await viewer(request)
    if v is None:
        return refused(request, 401, "the event stream needs a session",
                       "log in at /ui/login (or enable http_anonymous_read)")
    dash = request.app[DASHBOARD]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-store", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    last_text, last_sent, checked = "", 0.0, time.monotonic()
    queued: asyncio.Queue[dict[str, Any]] = asyncio.Queue(STREAM_BACKLOG)
    dash.streams.add(queued)
    try:
        await resp.write(b"retry: 2000\n\n")
        while not dash.closing:
            changed = dash.changed  # taken first: a change while we write is not missed
            payloads = []
            while not queued.empty():  # every announced change, in order
                payloads.append(queued.get_nowait())
            payloads.append(state_payload(request.app))  # and what holds now
            now = time.monotonic()
            for payload in payloads:
                stable = _stable(payload)
                if stable != last_text or now - last_sent >= EVENT_EVERY_S:
                    if payload is payloads[-1]:  # the current one carries the charts too
                        payload = {**payload, "charts": chart_update(request.app,
                                                                     payload["gpus"])}
                    data = json.dumps(payload, separators=(",", ":"), default=str)
                    await resp.write(f"event: state\ndata: {data}\n\n".encode())
                    last_text, last_sent = stable, now
            if v.session is not None and now - checked >= RECHECK_TOKEN_S:
                checked = now
                if await viewer(request) is None or dash.sessions.get(v.session.sid) is None:
                    break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), EVENT_POLL_S)
    except ConnectionResetError:
        pass  # the page was closed
    finally:
        dash.streams.discard(queued)
    return resp


# ------------------------------------------------------------------------------ wiring
UI_ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("GET", "/", root),
    ("GET", "/ui/", overview),
    ("GET", "/ui/leases", leases_page),
    ("GET", "/ui/queue", queue_page),
    ("GET", "/ui/tokens", tokens_page),
    ("GET", "/ui/login", login_form),
    ("POST", "/ui/login", login),
    ("POST", "/ui/logout", logout),
    ("GET", "/ui/events", events),
    ("POST", "/ui/gpus/{index}/drain", _gpu_action("drain")),
    ("POST", "/ui/gpus/{index}/undrain", _gpu_action("undrain")),
    ("POST", "/ui/gpus/{index}/clear", _gpu_action("clear")),
    ("POST", "/ui/leases/{id}/end", end_lease),
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


def copy_bytes_total(app: web.Application) -> int:
    metrics = app.get(METRICS_KEY)
    total = 0
    if metrics is not None:
        total += metrics.ended.bytes_h2d + metrics.ended.bytes_d2h
    for lease in app[LEASES].active():
        total += lease.worker.stats.bytes_h2d + lease.worker.stats.bytes_d2h
    return total


def sample(app: web.Application) -> None:
    """One history point from the telemetry cache and the lease manager (no I/O)."""
    dash = app[DASHBOARD]
    if dash.history is None:
        return
    telemetry = app.get(TELEMETRY)
    points = []
    for g in app[VIEWS].gpu_views():
        live = telemetry.live(g["index"]) if telemetry is not None else g.get("live") or {}
        points.append((g["index"], live.get("gpu_util"), live.get("memory_used")))
    dash.history.record(time.time(), points, copy_bytes_total(app))


async def dashboard_ctx(app: web.Application) -> AsyncIterator[None]:
    """The history sampler and the lease manager's change signal (after telemetry_ctx)."""
    dash = app[DASHBOARD]
    interval = app[SETTINGS].telemetry_interval
    dash.history = History(interval)

    def on_change(_event: GpuChanged) -> None:
        if dash.streams:  # the state of this moment, for every open stream
            dash.publish(state_payload(app))
        else:
            dash.notify()

    unsubscribe = app[EVENTS].subscribe(GpuChanged, on_change)

    async def run() -> None:
        while True:
            try:
                sample(app)
            except Exception:
                log.exception("dashboard history sample failed")
            await asyncio.sleep(interval)

    task = asyncio.create_task(run(), name="dashboard-history")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        unsubscribe()
