"""The web dashboard (gpupoold/dashboard/) over HTTP, in process: the real app factory
with a simulated GPU and the fake worker of test_daemon.py, token authentication on.

Login and its cookie, the pages and their markup (docs/dashboard.md, "For developers"),
the anonymous view, admin actions refused without an admin session or without the right CSRF
token and done with both, the event stream, logout. The browser side is
tests/test_dashboard_browser.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import gpupool_protocol as gp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_daemon import Daemon, RawClient, hello, settings_for

from gpupoold.app import create_app
from gpupoold.dashboard import COOKIE, DASHBOARD, Dashboard, Sessions, Viewer, web_dir
from gpupoold.dashboard.history import History, polyline
from gpupoold.http.auth import PUBLIC, ROUTE_ROLES, SESSION
from gpupoold.http.keys import STORE, VIEWS

CARD = re.compile(r'<article class="gpu-card[^"]*" data-gpu="(\d+)" data-state="(\w+)" '
                  r'data-idle="([01])"')


class Ui:
    def __init__(self, d: Daemon, admin: str, user: str) -> None:
        self.d = d
        self.client: TestClient = d.client
        self.admin = admin
        self.user = user

    async def login(self, token: str) -> Any:
        resp = await self.client.post("/ui/login", data={"token": token}, allow_redirects=False)
        await resp.read()
        return resp

    async def page(self, path: str = "/ui/", status: int = 200) -> str:
        resp = await self.client.get(path, allow_redirects=False)
        text = await resp.text()
        assert resp.status == status, text
        return text

    async def csrf(self) -> str:
        m = re.search(r'data-csrf="([^"]*)"', await self.page())
        assert m is not None
        return m.group(1)

    async def post(self, path: str, data: dict[str, str]) -> tuple[int, str, Any]:
        resp = await self.client.post(path, data=data, allow_redirects=False)
        return resp.status, await resp.text(), resp.headers

    async def gpus(self) -> list[dict[str, Any]]:
        resp = await self.client.get("/api/v1/gpus",
                                     headers={"Authorization": f"Bearer {self.admin}"})
        assert resp.status == 200
        return (await resp.json())["gpus"]


@pytest.fixture
def make_ui(tmp_path: Path) -> Callable[..., AsyncIterator[Ui]]:
    async def make(**changes: object) -> AsyncIterator[Ui]:
        settings = settings_for(tmp_path, auth="token", **changes)
        async with TestClient(TestServer(create_app(settings))) as client:
            d = Daemon(client)
            deadline = time.monotonic() + 10
            while not all(g["state"] == "free" and g["worker_ready"]
                          for g in d.app[VIEWS].gpu_views()):
                assert time.monotonic() < deadline, "the GPU did not become free"
                await asyncio.sleep(0.02)
            store = d.app[STORE]
            _, admin = await store.create_token("root", "admin", None, actor="test")
            _, user = await store.create_token("alice", "user", None, actor="test")
            try:
                yield Ui(d, admin, user)
            finally:
                while RawClient.opened:
                    await RawClient.opened.pop().close()
    return make


@pytest.fixture
async def ui(make_ui: Callable[..., AsyncIterator[Ui]]) -> AsyncIterator[Ui]:
    async for u in make_ui():
        yield u


# ------------------------------------------------------------------------------------- login
@pytest.mark.parametrize("who", ["user", "admin"])
async def test_login_sets_a_strict_httponly_session_cookie(ui: Ui, who: str) -> None:
    resp = await ui.login(getattr(ui, who))
    assert resp.status == 303 and resp.headers["Location"] == "/ui/"
    cookie = resp.headers["Set-Cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    attrs = [a.strip().lower() for a in cookie.split(";")]
    assert "httponly" in attrs and "samesite=strict" in attrs and "path=/ui" in attrs
    assert "secure" not in attrs  # plain HTTP here
    sid = cookie.split(";")[0].split("=", 1)[1]
    assert len(sid) >= 40 and sid not in (ui.admin, ui.user)  # a random id, never the token
    page = await ui.page()
    cards = CARD.findall(page)
    assert cards == [("0", "free", "0")]
    assert ">free</strong>" in page  # the state in words, not only a colour
    assert ("data-action=\"drain\"" in page) == (who == "admin")
    assert (">Tokens</a>" in page) == (who == "admin")


async def test_a_bad_token_is_refused_with_a_reason(ui: Ui) -> None:
    resp = await ui.login("gp_000000000000_notarealtoken")
    assert resp.status == 401 and "Set-Cookie" not in resp.headers
    await ui.page("/ui/", status=303)  # still no session
    resp = await ui.client.post("/ui/login", data={"token": "nope"})
    text = await resp.text()
    assert resp.status == 401 and "Login refused" in text and "malformed" in text


async def test_without_a_session_pages_redirect_to_login(ui: Ui) -> None:
    for path in ("/ui/", "/ui/leases", "/ui/queue", "/ui/tokens"):
        resp = await ui.client.get(path, allow_redirects=False)
        assert resp.status == 303 and resp.headers["Location"] == "/ui/login", path
    resp = await ui.client.get("/ui/events")
    assert resp.status == 401
    resp = await ui.client.get("/", allow_redirects=False)
    assert resp.status == 302 and resp.headers["Location"] == "/ui/"
    assert "<form method=\"post\" action=\"/ui/login\"" in await ui.page("/ui/login")
    resp = await ui.client.get("/ui/static/dashboard.js")
    assert resp.status == 200 and "EventSource" in await resp.text()


async def test_anonymous_read_shows_cards_without_admin_controls(
        make_ui: Callable[..., AsyncIterator[Ui]]) -> None:
    async for ui in make_ui(http_anonymous_read=True):
        page = await ui.page()
        assert CARD.findall(page) == [("0", "free", "0")]
        assert "data-action=" not in page and 'data-csrf=""' in page
        await ui.page("/ui/leases")
        await ui.page("/ui/queue")
        await ui.page("/ui/tokens", status=303)  # admin only: log in first
        status, text, _ = await ui.post("/ui/gpus/0/drain", {"csrf": "", "confirm": "yes"})
        assert status == 403 and "needs an admin session" in text
        assert (await ui.gpus())[0]["state"] == "free"


# ----------------------------------------------------------------------------- admin actions
async def test_admin_actions_need_an_admin_session_and_the_csrf_token(ui: Ui) -> None:
    # No session at all.
    status, text, _ = await ui.post("/ui/gpus/0/drain", {"confirm": "yes"})
    assert status == 403 and "admin session" in text
    # A user session, even with its own valid CSRF token.
    await ui.login(ui.user)
    csrf = await ui.csrf()
    status, text, _ = await ui.post("/ui/gpus/0/drain", {"csrf": csrf, "confirm": "yes"})
    assert status == 403 and "alice" in text and "user" in text
    # An admin session: without, with a wrong, with another session's CSRF token.
    await ui.login(ui.admin)
    admin_csrf = await ui.csrf()
    assert admin_csrf and admin_csrf != csrf
    for data in ({"confirm": "yes"}, {"csrf": "x" * 43, "confirm": "yes"},
                 {"csrf": csrf, "confirm": "yes"}):
        status, text, _ = await ui.post("/ui/gpus/0/drain", data)
        assert status == 403 and "CSRF" in text, data
    assert (await ui.gpus())[0]["state"] == "free"
    # Right token but not confirmed: a confirmation page, nothing done.
    status, text, _ = await ui.post("/ui/gpus/0/drain", {"csrf": admin_csrf, "next": "/ui/"})
    assert status == 200 and "Please confirm" in text and "Drain GPU 0?" in text
    assert 'name="confirm" value="yes"' in text
    assert (await ui.gpus())[0]["state"] == "free"
    # Both: done.
    status, _, headers = await ui.post("/ui/gpus/0/drain", {"csrf": admin_csrf, "confirm": "yes",
                                                            "next": "/ui/"})
    assert status == 303 and headers["Location"] == "/ui/"
    gpu = (await ui.gpus())[0]
    assert gpu["state"] == "drained" and gpu["draining"] is True
    page = await ui.page()
    assert CARD.findall(page) == [("0", "drained", "0")] and 'data-action="undrain"' in page
    status, _, _ = await ui.post("/ui/gpus/0/undrain", {"csrf": admin_csrf, "confirm": "yes",
                                                        "next": "https://evil.example/"})
    assert (await ui.gpus())[0]["state"] == "free"
    # A quarantine to clear there is not: the refusal says why.
    status, text, _ = await ui.post("/ui/gpus/0/clear", {"csrf": admin_csrf, "confirm": "yes"})
    assert status == 409 and "not quarantined" in text


async def test_the_fleet_page_acts_by_server_name_and_follows_live(ui: Ui) -> None:
    """The Fleet page's actions name the server (here the only one: SQLite): confirmed and
    CSRF-checked as the overview's, done here for this server, refused with the fleet's names
    for a server that is not in it; its event stream carries the fleet with each server's
    health. (Another server's GPU, in Chromium: tests/test_fleet.py.)"""
    me = ui.d.app[STORE].server
    drain = f"/ui/servers/{me}/gpus/0/drain"
    await ui.login(ui.user)
    user_page = await ui.page("/ui/fleet")
    assert "data-action=" not in user_page and "this server" in user_page
    status, text, _ = await ui.post(drain, {"csrf": await ui.csrf(), "confirm": "yes"})
    assert status == 403 and "admin session" in text
    await ui.login(ui.admin)
    csrf = await ui.csrf()
    page = await ui.page("/ui/fleet")
    assert f'action="{drain}"' in page and 'id="fleet-action"' in page
    status, text, _ = await ui.post(drain, {"confirm": "yes"})
    assert status == 403 and "CSRF" in text
    status, text, _ = await ui.post(drain, {"csrf": csrf})
    assert status == 200 and f"Drain GPU 0 of server {me}?" in text
    assert (await ui.gpus())[0]["state"] == "free"
    status, _, headers = await ui.post(drain, {"csrf": csrf, "confirm": "yes",
                                               "next": "/ui/fleet"})
    assert status == 303 and headers["Location"] == "/ui/fleet"
    assert (await ui.gpus())[0]["draining"] is True
    status, text, _ = await ui.post("/ui/servers/nobody/gpus/0/drain",
                                    {"csrf": csrf, "confirm": "yes"})
    assert status == 404 and "no server &#39;nobody&#39;" in text and me in text
    status, text, _ = await ui.post("/ui/servers/nobody/leases/1/end",
                                    {"csrf": csrf, "confirm": "yes"})
    assert status == 404 and "nobody" in text
    resp = await ui.client.get("/ui/fleet/events")
    try:
        assert resp.headers["Content-Type"] == "text/event-stream"
        view = await read_state(resp, lambda v: bool(v["servers"]), kind="fleet")
        server = view["servers"][0]
        assert server["name"] == me and server["this"] and server["reachable"] is True
        assert [g["state"] for g in server["gpus"]] == ["drained"]
        assert {"heartbeat_age_s", "sync_lag_s"} <= set(server)
        await ui.post(f"/ui/servers/{me}/gpus/0/undrain", {"csrf": csrf, "confirm": "yes"})
        await read_state(resp, lambda v: [g["state"] for g in v["servers"][0]["gpus"]] == ["free"],
                         kind="fleet")
    finally:
        resp.close()


async def test_tokens_page_creates_and_revokes(ui: Ui) -> None:
    await ui.login(ui.user)
    await ui.page("/ui/tokens", status=403)
    await ui.login(ui.admin)
    csrf = await ui.csrf()
    page = await ui.page("/ui/tokens")
    assert 'data-token="alice"' in page and 'data-action="revoke"' in page
    await ui.d.app[STORE].set_token_weight("alice", 3, "test")  # issue 32: the shares' weight
    page = await ui.page("/ui/tokens")
    assert re.search(r'data-token="alice">.*?<td class="weight">3</td>', page, re.S), page
    status, text, _ = await ui.post("/ui/tokens", {"csrf": csrf, "confirm": "yes", "name": "bob",
                                                   "role": "user", "expires": "30d"})
    assert status == 201 and "shown only this once" in text
    secret = re.search(r'<code id="new-secret">([^<]+)</code>', text)
    assert secret is not None and (await ui.login(secret.group(1))).status == 303
    await ui.login(ui.admin)
    csrf = await ui.csrf()
    status, text, _ = await ui.post("/ui/tokens", {"csrf": csrf, "confirm": "yes", "name": "bob"})
    assert status == 409 and "already exists" in text
    status, _, _ = await ui.post("/ui/tokens/bob/revoke", {"csrf": csrf, "confirm": "yes"})
    assert status == 303
    assert (await ui.login(secret.group(1))).status == 401


# ------------------------------------------------------------------ leases, events, escaping
async def read_state(resp: Any, want: Callable[[dict[str, Any]], bool],
                     timeout: float = 5, kind: str = "state") -> dict[str, Any]:
    """The first `event: state` (or `kind`) of the stream whose data satisfies `want`."""
    deadline = time.monotonic() + timeout
    event = ""
    while True:
        left = deadline - time.monotonic()
        assert left > 0, "no matching state event in time"
        line = (await asyncio.wait_for(resp.content.readline(), left)).decode().rstrip("\n")
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: ") and event == kind:
            data = json.loads(line[6:])
            if want(data):
                return data


async def test_events_stream_state_and_pages_show_the_holder(ui: Ui) -> None:
    await ui.login(ui.admin)
    resp = await ui.client.get("/ui/events")
    assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
    first = await read_state(resp, lambda d: True)
    assert [g["state"] for g in first["gpus"]] == ["free"] and first["summary"]["gpus"] == 1
    assert first["gpus"][0]["idle"] is False and first["queue"] == [] and first["leases"] == []
    # The current state carries the last-hour charts for the page to redraw.
    charts = (await read_state(resp, lambda d: "charts" in d))["charts"]
    assert set(charts["util"]) == {"0"} and set(charts["util_now"]) == {"0"}
    assert charts["util_now"]["0"] in ("0 %", "not reported")
    assert isinstance(charts["copy"], str) and charts["copy_top"].endswith("/s")
    # A client whose host name is markup: it shows as text everywhere.
    raw = await RawClient.connect(ui.d.address)
    started = time.monotonic()
    assert (await raw.hello(hello(token=ui.user, host="<b>box</b>"))).result == 0
    leased = await read_state(resp, lambda d: d["gpus"][0]["state"] == "leased"
                              and d["gpus"][0]["lease"] is not None)
    assert time.monotonic() - started < 3
    assert leased["gpus"][0]["lease"]["token"] == "alice" and len(leased["leases"]) == 1
    page = await ui.page()
    assert CARD.findall(page) == [("0", "leased", "0")]
    assert "<b>box</b>" not in page and "&lt;b&gt;box&lt;/b&gt;" in page
    assert '<span class="token">alice</span>' in page and '<span class="pid">4242</span>' in page
    assert 'data-action="end"' in page
    leases_page = await ui.page("/ui/leases")
    assert "&lt;b&gt;box&lt;/b&gt;" in leases_page and "No active lease." not in leases_page
    # End it from the dashboard: the stream shows it go, and the history has it.
    csrf = await ui.csrf()
    lease_id = leased["leases"][0]["id"]
    status, _, headers = await ui.post(f"/ui/leases/{lease_id}/end",
                                       {"csrf": csrf, "confirm": "yes", "next": "/ui/leases"})
    assert status == 303 and headers["Location"] == "/ui/leases"
    await read_state(resp, lambda d: d["gpus"][0]["state"] == "free" and not d["leases"],
                     timeout=15)
    resp.close()
    history = await ui.page("/ui/leases")
    row = re.search(rf'<tr data-lease="{lease_id}">.*?</tr>', history, re.S)
    assert row is not None and "revoked" in row.group(0)
    assert "passed" in row.group(0) or "pending" in row.group(0)


async def test_logout_ends_the_session(ui: Ui) -> None:
    await ui.login(ui.admin)
    csrf = await ui.csrf()
    status, _, _ = await ui.post("/ui/logout", {"csrf": "wrong"})
    assert status == 403
    await ui.page()  # still logged in
    sid = next(c.value for c in ui.client.session.cookie_jar if c.key == COOKIE)
    status, _, headers = await ui.post("/ui/logout", {"csrf": csrf})
    assert status == 303 and headers["Location"] == "/ui/login"
    await ui.page("/ui/", status=303)
    # The old id is dead on the server too, not only forgotten by the browser.
    resp = await ui.client.get("/ui/", cookies={COOKIE: sid}, allow_redirects=False)
    assert resp.status == 303
    assert len(ui.d.app[DASHBOARD].sessions) == 0


async def test_a_revoked_token_ends_its_session(ui: Ui) -> None:
    await ui.login(ui.user)
    await ui.page()
    await ui.d.app[STORE].revoke_token("alice", "test")
    await ui.page("/ui/", status=303)


# ------------------------------------------------------------------------------- units
def test_sessions_expire_when_idle() -> None:
    sessions = Sessions(idle_s=0.05)
    s = sessions.create("tok", "alice", "user")
    assert sessions.get(s.sid) is s and s.csrf != s.sid
    time.sleep(0.1)
    assert sessions.get(s.sid) is None and len(sessions) == 0


def test_history_keeps_an_hour_and_sees_idle_gpus() -> None:
    h = History(interval=60.0)
    assert h.maxlen == 61
    t0 = 1_000_000.0
    for i in range(100):
        h.record(t0 + 60 * i, [(0, 50 if i < 90 else 0, 1 << 30)], copy_bytes_total=i * 6000)
    assert len(h.gpu(0)) == 61 and h.gpu(0)[-1].at == t0 + 60 * 99
    assert [round(p.copy_bps) for p in h.pool()[-3:]] == [100, 100, 100]
    now = t0 + 60 * 99
    assert h.busy_at(0) == t0 + 60 * 89
    assert h.idle(0, leased_since=t0, now=now)  # 10 minutes at 0 %
    assert not h.idle(0, leased_since=now - 60, now=now)  # leased a minute ago
    assert not h.idle(0, leased_since=None, now=now)
    h.record(now + 60, [(0, None, None)], copy_bytes_total=0)  # unknown: not idle
    assert not h.idle(0, leased_since=t0, now=now + 60)
    assert h.pool()[-1].copy_bps == 0  # totals that went back are not negative


def test_polyline_scales_into_the_box() -> None:
    assert polyline([(0, 0), (50, 50), (100, 100), (75, None)], 300, 60, 100, 0, 100) == \
        "0.0,60.0 150.0,30.0 300.0,0.0"


def test_cards_show_every_state_in_words_with_the_dom_contract() -> None:
    dash = Dashboard(web_dir())
    admin = Viewer(Sessions().create("tok", "root", "admin"), "root", "admin")
    live = {"memory_total": 80 << 30, "memory_used": 20 << 30, "gpu_util": 0,
            "temperature_c": 41, "power_w": 71.5, "power_limit_w": 700.0}
    lease = {"id": 7, "token": "alice", "client": {"host": "laptop", "pid": 99},
             "started": time.time() - 900}
    gpus = [
        {"index": 0, "name": "H100", "simulated": False, "state": "leased", "since": 0.0,
         "draining": True, "lease": lease, "quarantine": None, "memory_total": 80 << 30,
         "live": live, "idle": True,
         "stuck": {"since": 0.0, "why": "lease 1 has nobody watching its worker"}},
        {"index": 1, "name": "H100", "simulated": True, "state": "quarantined", "since": 0.0,
         "draining": False, "lease": None, "quarantine": {"reason": "scrub failed"},
         "memory_total": 80 << 30, "live": {}, "idle": False},
    ]
    state = {"gpus": gpus, "leases": [], "queue": [],
             "summary": {"gpus": 2, "leases": 1, "queue": 0,
                         "states": {"free": 0, "leased": 1, "scrubbing": 0, "quarantined": 1,
                                    "drained": 0}}}
    charts = {"width": 300.0, "height": 60.0, "util": {0: "0,60 300,60"}, "util_last": {0: 0},
              "copy": "", "copy_top": 0.0, "copy_last": None}
    resp = dash.render("overview.html", viewer=admin, page="overview", state=state,
                       charts=charts, idle_minutes=5)
    assert resp.text is not None
    page = resp.text
    assert CARD.findall(page) == [("0", "leased", "1"), ("1", "quarantined", "0")]
    assert "idle while leased" in page and '<strong class="draining">draining</strong>' in page
    assert "20.0 GiB / 80.0 GiB (25 %)" in page and "41 °C" in page and "71.5 W of 700 W" in page
    assert "scrub failed" in page and 'data-action="clear"' in page and 'data-action="end"' in page
    assert "lease 1 has nobody watching its worker (the watchdog repairs it)" in page
    assert 'data-action="undrain"' in page  # GPU 0 is draining
    assert '<svg class="chart" data-series="util-0"' in page
    assert '<svg class="chart" data-series="util-1"' in page and 'data-series="copy"' in page
    assert "not reported" in page  # GPU 1 reports nothing
    assert resp.headers["Content-Security-Policy"].startswith("default-src 'self'")


async def test_every_dashboard_route_declares_its_role(ui: Ui) -> None:
    roles = ui.d.app[ROUTE_ROLES]
    registered = {(r.method, r.resource.canonical) for r in ui.d.app.router.routes()
                  if r.resource is not None and r.method != "HEAD"}
    assert registered == set(roles)
    ui_routes = {k: v for k, v in roles.items() if k[1] == "/" or k[1].startswith("/ui/")}
    assert ui_routes[("GET", "/ui/static")] == PUBLIC
    assert {v for k, v in ui_routes.items() if k[1] != "/ui/static"} == {SESSION}
    assert ("POST", "/ui/gpus/{index}/drain") in ui_routes and ("GET", "/ui/events") in ui_routes


async def test_event_streams_end_when_the_daemon_stops(ui: Ui) -> None:
    await ui.login(ui.user)
    resp = await ui.client.get("/ui/events")
    await read_state(resp, lambda d: True)
    await ui.d.app.shutdown()  # what the runner does first when gpupoold stops
    await asyncio.wait_for(resp.content.read(), 5)  # the stream ends: no wait for a timeout
    assert resp.content.at_eof()


async def test_memory_per_lease_and_the_lease_history_with_filters(ui: Ui) -> None:
    """The leases page shows the device memory a lease holds (as its client allocated it); the
    history page lists the leases from the database, filtered by token, client user, GPU and
    time, and says when a filter is wrong instead of ignoring it."""
    await ui.login(ui.admin)
    raw = await RawClient.connect(ui.d.address)
    assert (await raw.hello(hello(token=ui.user))).result == 0
    size = 48 << 20
    await raw.send(gp.encode_frame(gp.MemAlloc(size=size, stream=0, flags=0), 8))
    frame = await raw.recv()
    while frame.op != gp.MemAlloc.OP:  # notices (queue, keepalive) come before
        frame = await raw.recv()
    assert gp.MemAllocReply.decode(frame.body).result == 0

    def held(d: dict[str, Any]) -> bool:
        return bool(d["leases"]) and d["leases"][0].get("memory_used") == size

    resp = await ui.client.get("/ui/events")
    await read_state(resp, held, timeout=10)
    resp.close()
    leases_page = await ui.page("/ui/leases")
    assert "<th>GPU memory</th>" in leases_page and "48.0 MiB" in leases_page, leases_page
    api = await ui.client.get("/api/v1/leases?state=active",
                              headers={"Authorization": f"Bearer {ui.admin}"})
    (lease,) = (await api.json())["leases"]
    assert lease["memory_used"] == size
    await raw.close()
    deadline = time.monotonic() + 15
    while (await ui.d.app[STORE].leases("active", 10)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)

    page = await ui.page("/ui/history")
    assert f'<tr data-lease="{lease["id"]}">' in page and 'aria-current="page">History' in page
    assert "alice" in page and ("client lost" in page or "client exit" in page)
    for query, shown in (("?token=alice", True), ("?token=bob", False), ("?gpu=0", True),
                         ("?gpu=1", False), ("?user=ada", True), ("?user=nobody", False),
                         ("?period=hour", True), ("?period=all&token=alice&gpu=0", True)):
        page = await ui.page("/ui/history" + query)
        assert (f'<tr data-lease="{lease["id"]}">' in page) is shown, query
        assert ("No lease matches." in page) is (not shown), query
    page = await ui.page("/ui/history?gpu=first&period=century")
    assert "GPU must be a GPU index" in page and f'<tr data-lease="{lease["id"]}">' in page
    # The API has the same filters; a wrong one is a 400.
    headers = {"Authorization": f"Bearer {ui.admin}"}
    for query, count in (("token=alice&gpu=0", 1), ("token=bob", 0), ("user=ada", 1),
                         (f"since={lease['started'] + 3600}", 0), (f"until={lease['started'] - 1}", 0),
                         (f"since={lease['started'] - 1}&until={lease['started'] + 1}", 1)):
        got = await ui.client.get(f"/api/v1/leases?{query}", headers=headers)
        assert got.status == 200 and len((await got.json())["leases"]) == count, query
    bad = await ui.client.get("/api/v1/leases?since=yesterday", headers=headers)
    assert bad.status == 400 and "since must be a time" in await bad.text()


async def test_the_history_names_every_gpu_of_a_lease_and_finds_it_by_each(ui: Ui) -> None:
    """A lease of GPUs 1, 0 (issue 37, item 6) shows as "1, 0" in the history page and the
    leases page's recent history, and `?gpu=` finds it by either GPU, not by another."""
    from gpupoold.store.database import NewLease

    await ui.login(ui.admin)
    store = ui.d.app[STORE]
    lease_id = await store.lease_started(NewLease(
        gpu_index=1, gpu_uuid="GPU-0001", gpu_name="H100 (simulated)", simulated=True,
        token_name="alice", client_host="laptop", client_user="ada", client_pid=77,
        program="train.py", peer="10.0.0.5:5000", request="2 GPUs", queued_s=0.0,
        started=time.time()))
    await store.lease_gpus(lease_id, [1, 0])
    await store.lease_ended(lease_id, time.time(), "client exit", "", 0, 0, {})
    row = rf'<tr data-lease="{lease_id}">\s*<td>{lease_id}</td><td>1, 0</td>'
    for query in ("", "?gpu=0", "?gpu=1"):
        page = await ui.page("/ui/history" + query)
        assert re.search(row, page), (query, page)
    assert f'<tr data-lease="{lease_id}">' not in await ui.page("/ui/history?gpu=2")
    assert re.search(row, await ui.page("/ui/leases"))


def test_the_day_view_counts_leased_hours_and_queue_waits() -> None:
    """dashboard/history.py day_view: a GPU's share of each hour it was leased (a running lease
    up to now), and the mean queue wait of the leases that started in each hour."""
    from types import SimpleNamespace as R

    from gpupoold.dashboard.history import HOUR_S, bars, day_view
    now = 1_767_225_600.0
    start = now - 24 * HOUR_S
    records = [
        R(gpu_index=0, started=start + 1.5 * HOUR_S, ended=start + 3.0 * HOUR_S, queued_s=10.0),
        R(gpu_index=0, started=now - 0.25 * HOUR_S, ended=None, queued_s=30.0),  # running
        R(gpu_index=1, started=start - 5 * HOUR_S, ended=start + 0.5 * HOUR_S, queued_s=99.0),
        R(gpu_index=1, started=start + 1.75 * HOUR_S, ended=start + 1.8 * HOUR_S, queued_s=2.0),
    ]
    view = day_view(records, [0, 1, 2], now)
    assert view.start == start and len(view.leased[0]) == 24 and view.leased[2] == [0.0] * 24
    assert view.leased[0][:4] == [0.0, 0.5, 1.0, 0.0] and view.leased[0][23] == 0.25
    assert view.leased[1][0] == 0.5  # started before the day: only its part in it
    assert abs(view.leased[1][1] - 0.05) < 1e-9
    assert view.wait[1] == (10.0 + 2.0) / 2 and view.wait[23] == 30.0
    assert view.wait[0] is None  # the lease of GPU 1 started before the day
    rects = bars(view.leased[0], 300.0, 60.0, 1.0)
    assert [r[3] for r in rects] == [30.0, 60.0, 15.0] and all(r[2] > 0 for r in rects)


def test_the_day_view_counts_a_moved_lease_on_each_gpu_it_held_and_not_while_detached() -> None:
    """A lease that detached from GPU 0 and came back on GPU 1 (idle detach): its lease record
    still names GPU 0 (where it started); its events cut it into its stretches."""
    from types import SimpleNamespace as R

    from gpupoold.dashboard.history import HOUR_S, day_view
    now = 1_767_225_600.0
    start = now - 24 * HOUR_S
    moved = R(id=7, gpu_index=0, started=start + 1 * HOUR_S, ended=start + 4 * HOUR_S,
              queued_s=0.0)
    events = {7: [{"at": start + 2 * HOUR_S, "state": "detached", "gpu": 0, "detail": ""},
                  {"at": start + 2.5 * HOUR_S, "state": "attached", "gpu": 1, "detail": ""}]}
    view = day_view([moved], [0, 1], now, events)
    assert view.leased[0][:5] == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert view.leased[1][:5] == [0.0, 0.0, 0.5, 1.0, 0.0]
    # Without its events (not read), all of it counts where it started.
    assert day_view([moved], [0, 1], now).leased[0][:5] == [0.0, 1.0, 1.0, 1.0, 0.0]


def test_the_day_view_counts_a_lease_of_several_gpus_on_each_of_them() -> None:
    """A lease of GPUs 2 and 0 (issue 37, item 6) counts on both, and with its events on each
    GPU it held across its detaches: back on GPUs 1 and 2 (its events name both, schema v15),
    each counts. Events written before v15 name device 0's GPU only: its other GPUs count up
    to its first detach then."""
    from types import SimpleNamespace as R

    from gpupoold.dashboard.history import HOUR_S, day_view
    now = 1_767_225_600.0
    start = now - 24 * HOUR_S
    pair = R(id=8, gpu_index=2, gpus=(2, 0), started=start + 1 * HOUR_S,
             ended=start + 3 * HOUR_S, queued_s=0.0)
    view = day_view([pair], [0, 1, 2], now)
    assert view.leased[0][:4] == view.leased[2][:4] == [0.0, 1.0, 1.0, 0.0]
    assert view.leased[1] == [0.0] * 24
    events = {8: [{"at": start + 2 * HOUR_S, "state": "detached", "gpu": 2, "gpus": [2, 0],
                   "detail": ""},
                  {"at": start + 2.5 * HOUR_S, "state": "attached", "gpu": 1, "gpus": [1, 2],
                   "detail": ""}]}
    view = day_view([pair], [0, 1, 2], now, events)
    assert view.leased[0][:4] == [0.0, 1.0, 0.0, 0.0]  # left at its detach
    assert view.leased[1][:4] == [0.0, 0.0, 0.5, 0.0]  # device 0, back on GPU 1
    assert view.leased[2][:4] == [0.0, 1.0, 0.5, 0.0]  # device 0, then device 1
    before_v15 = {8: [{k: v for k, v in e.items() if k != "gpus"} for e in events[8]]}
    view = day_view([pair], [0, 1, 2], now, before_v15)
    assert view.leased[2][:4] == view.leased[0][:4] == [0.0, 1.0, 0.0, 0.0]
    assert view.leased[1][:4] == [0.0, 0.0, 0.5, 0.0]


def test_the_wait_bars_draw_no_wait_under_a_second_and_scale_to_at_least_one() -> None:
    """A lease nobody waited for still spends milliseconds between joining the queue and the
    worker taking it (tens on a loaded machine): the last-day chart, whose caption counts whole
    seconds, draws no bar for it; real waits are scaled to the peak, never to less than 1 s."""
    from gpupoold.dashboard.payload import CHART_H, wait_bars
    assert wait_bars([None, 0.004, 0.033, 0.9]) == []
    assert [r[3] for r in wait_bars([0.033, 1.0])] == [CHART_H]  # the 1 s peak is full height
    assert [r[3] for r in wait_bars([2.0, 4.0, 0.5])] == [CHART_H / 2, CHART_H]
    assert [r[3] for r in wait_bars([1.0])] == [CHART_H]


async def test_a_shared_gpus_card_lists_its_shares(make_ui: Callable[..., AsyncIterator[Ui]]) -> None:
    """Issue 32: the card of a shared GPU says how many shares it holds of how many, and each
    share's holder, use and quota (server-rendered here; dashboard.js draws the same facts)."""
    async for ui in make_ui(share=4, sim_memory_gib=32):
        await ui.login(ui.admin)
        raws = [await RawClient.connect(ui.d.address) for _ in range(2)]
        for i, raw in enumerate(raws):
            assert (await raw.hello(hello(token=ui.user, pid=500 + i, memory=8 << 30))).result == 0
        deadline = time.monotonic() + 5
        while len((ui.d.app[VIEWS].gpu_views()[0]["shares"] or {}).get("leases", [])) < 2:
            assert time.monotonic() < deadline, "the two shares did not start"
            await asyncio.sleep(0.02)
        page = await ui.page()
        assert "<dt>Shares</dt>" in page and "2 of 4" in page, page
        assert "pid <span class=\"pid\">500</span>" in page and "pid <span class=\"pid\">501</span>" in page
        assert page.count("of 8.0 GiB (lease") == 2, page
