"""The HTTP API (gpupoold/http/api.py, http/auth.py, http/routes.py) in process: the real store, token
authentication and route table, with a fake lease manager standing in for the GPUs.

The 401/403 matrix runs over routes.ROUTES, so a route added later is covered by its declared
role; every endpoint's happy path and input errors follow.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gpupoold import __version__
from gpupoold.auth.authenticator import NoAuthentication, TokenAuthenticator
from gpupoold.config.settings import Settings
from gpupoold.gpu.inventory import Gpu, Inventory
from gpupoold.http.auth import ADMIN, METRICS, PUBLIC, ROUTE_ROLES, USER, auth_middleware
from gpupoold.http.keys import (
    AUTH,
    COUNTERS,
    INVENTORY,
    LEASES,
    REMOTING,
    SETTINGS,
    STORE,
    VIEWS,
)
from gpupoold.http.routes import ROUTES, Route, setup_routes
from gpupoold.pool.counters import Counters
from gpupoold.pool.leases import LeaseError
from gpupoold.pool.usage import Observation, UsageMeter
from gpupoold.store.database import NewLease, Store

GIB = 1 << 30


# ------------------------------------------------------------------------------------ fakes
class FakeLeaseManager:
    """The lease manager's operator actions (gpupoold/pool/leases.py) and its views
    (gpupoold/pool/views.py), in memory: the operator actions return the views themselves.

    It records the operator actions it is asked for (`calls`) so the tests can check who the API
    says the actor is, and that a refused request reached nothing."""

    def __init__(self, n: int = 2) -> None:
        self.fleet = None  # a server on its own (no shared store): pool/fleet_view.py
        self.gpus = [{"index": i, "name": "NVIDIA H100 80GB HBM3 (gpupool simulated)",
                      "uuid": f"GPU-{i:08x}-0000-0000-0000-000000000000", "simulated": True,
                      "state": "free", "draining": False, "lease": None, "quarantine": None,
                      "last_scrub": None, "memory_total": 80 * GIB} for i in range(n)]
        self.live: dict[int, dict[str, Any]] = {}
        self.queue: list[dict[str, Any]] = []
        self.calls: list[tuple[Any, ...]] = []
        self.broken = False
        self.stuck: list[dict[str, Any]] = []  # what the watchdog reports (summary()["stuck"])

    def _gpu(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self.gpus):
            raise LeaseError(f"no GPU {index} on this server (it has {len(self.gpus)})", 404)
        return self.gpus[index]

    def gpu(self, view: dict[str, Any]) -> dict[str, Any]:
        return view

    def lease(self, view: dict[str, Any]) -> dict[str, Any]:
        return view

    def gpu_views(self) -> list[dict[str, Any]]:
        if self.broken:
            raise RuntimeError("simulated bug")
        return [dict(g) for g in self.gpus]

    def gpu_view(self, index: int) -> dict[str, Any]:
        return dict(self._gpu(index))

    def active_leases(self) -> list[dict[str, Any]]:
        return [dict(v) for v in self.live.values()]

    def queue_view(self) -> list[dict[str, Any]]:
        return list(self.queue)

    def summary(self) -> dict[str, Any]:
        states = {s: 0 for s in ("free", "leased", "scrubbing", "quarantined", "drained")}
        for g in self.gpus:
            states[g["state"]] += 1
        return {"gpus": len(self.gpus), "states": states, "leases": len(self.live),
                "queue": len(self.queue), "stuck": list(self.stuck),
                "detached": sum(1 for v in self.live.values() if v.get("gpu") is None),
                "detached_bytes": sum(v.get("detach", {}).get("saved_bytes", 0)
                                      for v in self.live.values())}

    async def drain(self, index: int, actor: str) -> dict[str, Any]:
        g = self._gpu(index)
        self.calls.append(("drain", index, actor))
        g["draining"] = True
        if g["state"] == "free":
            g["state"] = "drained"
        return dict(g)

    async def undrain(self, index: int, actor: str) -> dict[str, Any]:
        g = self._gpu(index)
        self.calls.append(("undrain", index, actor))
        g["draining"] = False
        if g["state"] == "drained":
            g["state"] = "free"
        return dict(g)

    async def clear(self, index: int, actor: str) -> dict[str, Any]:
        g = self._gpu(index)
        if g["state"] != "quarantined":
            raise LeaseError(f"GPU {index} is not quarantined (it is {g['state']})", 409)
        self.calls.append(("clear", index, actor))
        g["state"], g["quarantine"] = "scrubbing", None
        return dict(g)

    async def end_lease(self, lease_id: int, actor: str, reason: str) -> dict[str, Any]:
        if lease_id not in self.live:
            raise LeaseError(f"lease {lease_id} is not active", 404)
        self.calls.append(("end_lease", lease_id, actor, reason))
        return dict(self.live[lease_id])


@dataclass
class FakeRemoting:
    address: str = "127.0.0.1:7070"


@dataclass
class Api:
    client: TestClient[web.Request, web.Application]
    app: web.Application
    store: Store
    leases: FakeLeaseManager
    counters: Counters
    admin: str  # secrets of an admin and a user token
    user: str
    secrets: dict[str, str] = field(default_factory=dict)

    async def call(self, method: str, path: str, token: str | None = None, *,
                   body: Any = None, data: bytes | str | io.BytesIO | None = None,
                   headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
        """(status, JSON body, response headers); `token` None: no Authorization header."""
        h = dict(headers or {})
        if token is not None:
            h["Authorization"] = f"Bearer {token}"
        kw: dict[str, Any] = {"headers": h}
        if body is not None:
            kw["json"] = body
        elif data is not None:
            kw["data"] = data
        async with self.client.request(method, path, **kw) as resp:
            text = await resp.text()
            assert resp.content_type == "application/json", (resp.status, text)
            return resp.status, json.loads(text), resp.headers

    def refused(self, reason: str) -> int:
        return self.counters.get("http_auth_refused", reason=reason)


ApiFactory = Callable[..., Awaitable[Api]]


@pytest.fixture
async def make_api(tmp_path: Path) -> AsyncIterator[ApiFactory]:
    async with AsyncExitStack() as stack:
        count = 0

        async def make(*, anonymous_read: bool = False, auth: str = "token",
                       extra: Callable[[web.Application], None] | None = None) -> Api:
            nonlocal count
            count += 1
            store = await Store.open(tmp_path / f"gpupoold-{count}.db")
            stack.push_async_callback(store.close)
            app = web.Application(middlewares=[auth_middleware])
            app[SETTINGS] = Settings(state_dir=tmp_path, auth=auth,
                                     http_anonymous_read=anonymous_read)
            app[COUNTERS] = Counters()
            app[STORE] = store
            app[AUTH] = NoAuthentication() if auth == "none" else TokenAuthenticator(store)
            app[LEASES] = FakeLeaseManager()  # type: ignore[assignment]
            app[VIEWS] = app[LEASES]  # type: ignore[assignment]
            app[REMOTING] = FakeRemoting()  # type: ignore[assignment]
            app[INVENTORY] = Inventory(tuple(  # the fake lease manager's two simulated GPUs
                Gpu(index=i, name="sim", uuid=f"GPU-{i}", simulated=True, driver="", ordinal=i)
                for i in range(2)))
            setup_routes(app)
            if extra is not None:
                extra(app)
            client: TestClient[web.Request, web.Application] = TestClient(TestServer(app))
            await client.start_server()
            stack.push_async_callback(client.close)
            _, admin = await store.create_token("root", "admin", None, actor="test")
            _, user = await store.create_token("alice", "user", None, actor="test")
            return Api(client, app, store, app[LEASES], app[COUNTERS], admin,  # type: ignore[arg-type]
                       user)

        yield make


@pytest.fixture
async def api(make_api: ApiFactory) -> Api:
    return await make_api()


def concrete(route: Route) -> str:
    return (route.path.replace("{index}", "0").replace("{id}", "1")
            .replace("{name}", "alice").replace("{action}", "drain"))


async def add_lease(store: Store, *, gpu: int = 0, token: str = "alice", pid: int = 4242,
                    ended: bool = False) -> int:
    now = time.time()
    lease_id = await store.lease_started(NewLease(
        gpu_index=gpu, gpu_uuid=f"GPU-{gpu:08x}", gpu_name="sim", simulated=True,
        token_name=token, client_host="laptop", client_user="alice", client_pid=pid,
        program="train.py", peer="10.0.0.5:50000", request="any GPU", queued_s=0.5,
        started=now))
    if ended:
        await store.lease_ended(lease_id, now + 1, "client exit", "goodbye", 10, 20,
                                {"launch": 1, "copy": 2, "alloc": 1, "sync": 1, "other": 0})
    return lease_id


ADMIN_ROUTES = [r for r in ROUTES if r.role == ADMIN]
USER_ROUTES = [r for r in ROUTES if r.role == USER]
GUARDED = [r for r in ROUTES if r.role != PUBLIC]


def rid(r: Route) -> str:
    return f"{r.method} {r.path}"


# ------------------------------------------------------------------------ the route table
def test_the_table_declares_every_contract_route() -> None:
    table = {(r.method, r.path): r.role for r in ROUTES}
    assert table == {
        ("GET", "/healthz"): PUBLIC,
        ("GET", "/metrics"): METRICS,
        ("GET", "/api/v1/status"): USER,
        ("GET", "/api/v1/gpus"): USER,
        ("GET", "/api/v1/servers"): USER,
        ("GET", "/api/v1/fleet"): USER,
        ("POST", "/api/v1/servers/{name}/gpus/{index}/{action}"): ADMIN,
        ("POST", "/api/v1/servers/{name}/leases/{id}/end"): ADMIN,
        ("GET", "/api/v1/gpus/{index}"): USER,
        ("POST", "/api/v1/gpus/{index}/drain"): ADMIN,
        ("POST", "/api/v1/gpus/{index}/undrain"): ADMIN,
        ("POST", "/api/v1/gpus/{index}/clear"): ADMIN,
        ("GET", "/api/v1/leases"): USER,
        ("GET", "/api/v1/leases/{id}"): USER,
        ("POST", "/api/v1/leases/{id}/end"): ADMIN,
        ("GET", "/api/v1/queue"): USER,
        ("GET", "/api/v1/tokens"): ADMIN,
        ("POST", "/api/v1/tokens"): ADMIN,
        ("DELETE", "/api/v1/tokens/{name}"): ADMIN,
        ("GET", "/api/v1/audit"): ADMIN,
        ("GET", "/api/v1/report"): ADMIN,
    }


async def test_every_registered_route_has_a_declared_role(api: Api) -> None:
    registered = {(r.method, r.resource.canonical) for r in api.app.router.routes()
                  if r.resource is not None and r.method != "HEAD"}
    assert registered == set(api.app[ROUTE_ROLES])


async def test_a_route_without_a_declared_role_is_admin_only(make_api: ApiFactory) -> None:
    async def secret(request: web.Request) -> web.Response:
        return web.json_response({"secret": 42})

    api = await make_api(anonymous_read=True,
                         extra=lambda app: app.router.add_get("/api/v1/undeclared", secret))
    assert (await api.call("GET", "/api/v1/undeclared"))[0] == 401
    assert (await api.call("GET", "/api/v1/undeclared", api.user))[0] == 403
    assert (await api.call("GET", "/api/v1/undeclared", api.admin))[1] == {"secret": 42}


# ------------------------------------------------------------------------- the 401/403 matrix
@pytest.mark.parametrize("route", GUARDED, ids=rid)
async def test_no_token_is_401(api: Api, route: Route) -> None:
    status, body, headers = await api.call(route.method, concrete(route))
    assert status == 401
    assert headers["WWW-Authenticate"].startswith("Bearer")
    assert "token" in body["error"] and "Authorization: Bearer" in body["hint"]
    assert "gpupoold token create" in body["hint"]
    assert api.refused("missing") == 1
    assert api.leases.calls == []


@pytest.mark.parametrize("route", ADMIN_ROUTES, ids=rid)
async def test_user_token_on_an_admin_route_is_403(api: Api, route: Route) -> None:
    tokens_before = [(t.name, t.revoked) for t in await api.store.list_tokens()]
    status, body, headers = await api.call(route.method, concrete(route), api.user,
                                           body={"name": "x", "role": "admin"}
                                           if route.method == "POST" else None)
    assert status == 403, body
    assert "WWW-Authenticate" not in headers
    assert "needs an admin token" in body["error"] and "'alice'" in body["error"]
    assert "--role admin" in body["hint"]
    assert api.refused("forbidden") == 1
    # Nothing happened: no action reached the lease manager, no token was made or revoked.
    assert api.leases.calls == []
    assert [(t.name, t.revoked) for t in await api.store.list_tokens()] == tokens_before


@pytest.mark.parametrize("route", ADMIN_ROUTES, ids=rid)
async def test_admin_token_passes_admin_routes(api: Api, route: Route) -> None:
    status, body, _ = await api.call(route.method, concrete(route), api.admin,
                                     body={"name": "newname"} if route.method == "POST" else None)
    assert status not in (401, 403), body
    assert api.counters.total("http_auth_refused") == 0


@pytest.mark.parametrize("route", USER_ROUTES, ids=rid)
async def test_user_token_passes_user_routes(api: Api, route: Route) -> None:
    await add_lease(api.store)
    status, body, _ = await api.call(route.method, concrete(route), api.user)
    assert status == 200, body
    assert api.counters.total("http_auth_refused") == 0


async def test_healthz_needs_no_token(api: Api) -> None:
    status, body, _ = await api.call("GET", "/healthz")
    assert status == 200
    assert body == {"ok": True, "version": __version__, "remoting": "127.0.0.1:7070", "gpus": 2,
                    "leases": 0, "queue": 0, "simulated": 2}
    # Even a bad token does not matter there.
    assert (await api.call("GET", "/healthz", "nonsense"))[0] == 200
    assert api.counters.total("http_auth_refused") == 0


async def test_healthz_is_unhealthy_while_a_gpu_is_stuck(api: Api) -> None:
    stuck = {"gpu": 1, "state": "leased", "since": 1.0, "why": "leased, but no lease holds it"}
    api.leases.stuck.append(stuck)
    status, body, _ = await api.call("GET", "/healthz")
    assert status == 503
    assert body["ok"] is False and body["stuck"] == [stuck]
    api.leases.stuck.clear()
    status, body, _ = await api.call("GET", "/healthz")
    assert status == 200 and body["ok"] is True and "stuck" not in body


@pytest.mark.parametrize("header, reason", [
    ("Basic YWxpY2U6cGFzcw==", "malformed"),
    ("Bearer", "malformed"),
    ("Bearer two words", "malformed"),
    ("Bearer not-a-gpupool-token", "malformed"),
    ("Bearer gpt_0123456789ab_" + "A" * 43, "unknown"),
])
async def test_bad_authorization_headers_are_401(api: Api, header: str, reason: str) -> None:
    status, body, headers = await api.call("GET", "/api/v1/gpus",
                                           headers={"Authorization": header})
    assert status == 401, body
    assert headers["WWW-Authenticate"].startswith("Bearer")
    assert body["error"] and body["hint"]
    assert api.refused(reason) == 1, api.counters.snapshot()


async def test_wrong_secret_of_a_known_token_is_401(api: Api) -> None:
    wrong = api.user[:-4] + ("AAAA" if not api.user.endswith("AAAA") else "BBBB")
    status, body, _ = await api.call("GET", "/api/v1/gpus", wrong)
    assert status == 401 and body["error"]
    assert api.counters.total("http_auth_refused") == 1


async def test_revoked_and_expired_tokens_are_401_with_their_reason(api: Api) -> None:
    _, soon = await api.store.create_token("soon", "admin", None, actor="test")
    assert (await api.call("GET", "/api/v1/tokens", soon))[0] == 200
    await api.store.revoke_token("soon", actor="test")
    status, body, _ = await api.call("GET", "/api/v1/tokens", soon)
    assert status == 401 and "revoked" in body["error"]
    assert api.refused("revoked") == 1

    _, old = await api.store.create_token("old", "user", time.time() - 60, actor="test")
    status, body, _ = await api.call("GET", "/api/v1/gpus", old)
    assert status == 401 and "expired" in body["error"]
    assert api.refused("expired") == 1


async def test_csrf_a_cross_site_form_post_carries_no_credentials(api: Api) -> None:
    """A browser sends cookies with a cross-site form, never an Authorization header; the API
    reads no cookie, so a forged request is unauthenticated (docs/api.md: why no CSRF token)."""
    status, _, _ = await api.call(
        "POST", "/api/v1/gpus/0/drain", data="reason=x",
        headers={"Content-Type": "application/x-www-form-urlencoded",
                 "Cookie": f"token={api.admin}; session={api.admin}",
                 "Origin": "https://evil.example"})
    assert status == 401
    assert api.leases.calls == []


# ----------------------------------------------------------------------- anonymous read
async def test_anonymous_read_opens_the_read_only_views_only(make_api: ApiFactory) -> None:
    api = await make_api(anonymous_read=True)
    lease_id = await add_lease(api.store)
    for route in USER_ROUTES:
        path = concrete(route).replace("/leases/1", f"/leases/{lease_id}")
        status, body, _ = await api.call("GET", path)
        assert status == 200, (route, body)
    status, body, _ = await api.call("GET", "/api/v1/status")
    assert body["you"] == {"name": "anonymous", "role": "anonymous"}
    for route in ADMIN_ROUTES:  # tokens, audit and every action still need an admin token
        assert (await api.call(route.method, concrete(route)))[0] == 401, route
        assert (await api.call(route.method, concrete(route), api.user))[0] == 403, route
    assert api.leases.calls == []
    # A token that is sent is still checked: a bad one is refused, not ignored.
    assert (await api.call("GET", "/api/v1/gpus", "gpt_0123456789ab_" + "A" * 43))[0] == 401


async def test_anonymous_read_off_by_default(api: Api) -> None:
    assert not api.app[SETTINGS].http_anonymous_read
    assert (await api.call("GET", "/api/v1/gpus"))[0] == 401


async def test_auth_none_lets_everyone_act_as_anonymous_admin(make_api: ApiFactory) -> None:
    api = await make_api(auth="none")
    status, body, _ = await api.call("POST", "/api/v1/gpus/1/drain")
    assert status == 200 and body["state"] == "drained"
    assert api.leases.calls == [("drain", 1, "anonymous")]


# --------------------------------------------------------------------------------- status
async def test_status(api: Api) -> None:
    api.leases.gpus[1]["state"] = "quarantined"
    api.leases.live[7] = {"id": 7, "gpu": 0, "token": "alice"}
    api.leases.queue.append({"position": 1, "token": "bob"})
    await api.call("GET", "/api/v1/gpus")  # one refusal to count
    status, body, _ = await api.call("GET", "/api/v1/status", api.user)
    assert status == 200
    assert body["version"] == __version__ and body["remoting"] == "127.0.0.1:7070"
    assert body["gpus"] == 2 and body["states"]["free"] == 1 and body["states"]["quarantined"] == 1
    assert body["leases"] == 1 and body["active_leases"] == [{"id": 7, "gpu": 0, "token": "alice"}]
    assert body["queue"] == 1
    assert body["counters"]["http_auth_refused"] == {"reason=missing": 1}
    assert body["you"] == {"name": "alice", "role": "user"} and body["auth"] == "token"


# ----------------------------------------------------------------------------------- GPUs
async def test_gpus(api: Api) -> None:
    status, body, _ = await api.call("GET", "/api/v1/gpus", api.user)
    assert status == 200 and [g["index"] for g in body["gpus"]] == [0, 1]
    assert body["gpus"][0]["simulated"] is True
    status, body, _ = await api.call("GET", "/api/v1/gpus/1", api.user)
    assert status == 200 and body["index"] == 1 and body["state"] == "free"


@pytest.mark.parametrize("index, status, needle", [
    ("abc", 400, "whole number"), ("-1", 400, "0 or more"), ("1.5", 400, "whole number"),
    ("7", 404, "no GPU 7"),
])
async def test_bad_gpu_index(api: Api, index: str, status: int, needle: str) -> None:
    for method, path in (("GET", f"/api/v1/gpus/{index}"),
                         ("POST", f"/api/v1/gpus/{index}/drain")):
        got, body, _ = await api.call(method, path, api.admin)
        assert got == status and needle in body["error"] and body["hint"], body
    assert api.leases.calls == []


async def test_unknown_query_parameter_is_400(api: Api) -> None:
    status, body, _ = await api.call("GET", "/api/v1/gpus?verbose=1", api.user)
    assert status == 400 and "unknown query parameter 'verbose'" in body["error"]


async def test_drain_undrain_clear(api: Api) -> None:
    status, body, _ = await api.call("POST", "/api/v1/gpus/1/drain", api.admin)
    assert status == 200 and body["state"] == "drained" and body["draining"] is True
    status, body, _ = await api.call("POST", "/api/v1/gpus/1/undrain", api.admin)
    assert status == 200 and body["state"] == "free"
    status, body, _ = await api.call("POST", "/api/v1/gpus/1/clear", api.admin)
    assert status == 409 and body["error"] == "GPU 1 is not quarantined (it is free)"
    assert body["hint"]
    api.leases.gpus[1].update(state="quarantined", quarantine={"reason": "scrub failed"})
    status, body, _ = await api.call("POST", "/api/v1/gpus/1/clear", api.admin)
    assert status == 200 and body["state"] == "scrubbing"
    # The actor the lease manager audits is the admin token's name.
    assert api.leases.calls == [("drain", 1, "root"), ("undrain", 1, "root"), ("clear", 1, "root")]


# --------------------------------------------------------------------------------- leases
async def test_leases_list_filter_and_paging(api: Api) -> None:
    ended = [await add_lease(api.store, pid=100 + i, ended=True) for i in range(5)]
    active = await add_lease(api.store, gpu=1, pid=200)
    api.leases.live[active] = {"id": active, "gpu": 1, "token": "alice",
                               "client": {"host": "laptop", "pid": 200}, "bytes_h2d": 1234}

    status, body, _ = await api.call("GET", "/api/v1/leases", api.user)
    assert status == 200 and len(body["leases"]) == 6 and body["next_before"] is None
    status, body, _ = await api.call("GET", "/api/v1/leases?state=ended", api.user)
    assert sorted(r["id"] for r in body["leases"]) == sorted(ended)
    assert all(r["active"] is False and r["end_reason"] == "client exit" for r in body["leases"])
    status, body, _ = await api.call("GET", "/api/v1/leases?state=active", api.user)
    (record,) = body["leases"]
    # The stored record, with the live view of the running lease on top.
    assert record["id"] == active and record["active"] is True
    assert record["client_pid"] == 200 and record["client"]["pid"] == 200
    assert record["bytes_h2d"] == 1234

    seen: list[int] = []
    path = "/api/v1/leases?state=ended&limit=2"
    while True:
        status, body, _ = await api.call("GET", path, api.user)
        assert status == 200 and len(body["leases"]) <= 2
        seen += [r["id"] for r in body["leases"]]
        if body["next_before"] is None:
            break
        path = f"/api/v1/leases?state=ended&limit=2&before={body['next_before']}"
    assert sorted(seen) == sorted(ended) and len(seen) == len(set(seen))


@pytest.mark.parametrize("query, needle", [
    ("state=running", "unknown lease state 'running'"),
    ("limit=0", "limit must be from 1 to 1000"),
    ("limit=1001", "limit must be from 1 to 1000"),
    ("limit=ten", "limit must be a whole number"),
    ("before=0", "before must be 1 or more"),
    ("before=x", "before must be a whole number"),
    ("stat=active", "unknown query parameter 'stat'"),
    ("state=active&state=ended", "more than once"),
])
async def test_leases_bad_query(api: Api, query: str, needle: str) -> None:
    status, body, _ = await api.call("GET", f"/api/v1/leases?{query}", api.user)
    assert status == 400 and needle in body["error"] and body["hint"], body


async def test_one_lease(api: Api) -> None:
    lease_id = await add_lease(api.store, pid=77, ended=True)
    status, body, _ = await api.call("GET", f"/api/v1/leases/{lease_id}", api.user)
    assert status == 200 and body["id"] == lease_id and body["client_pid"] == 77
    assert body["active"] is False and body["end_reason"] == "client exit"
    status, body, _ = await api.call("GET", "/api/v1/leases/999", api.user)
    assert status == 404 and body["error"] == "no lease 999"
    status, body, _ = await api.call("GET", "/api/v1/leases/abc", api.user)
    assert status == 400 and "lease id" in body["error"]


async def test_end_lease(api: Api) -> None:
    api.leases.live[3] = {"id": 3, "gpu": 0, "token": "alice"}
    status, body, _ = await api.call("POST", "/api/v1/leases/3/end", api.admin,
                                     body={"reason": "  maintenance window  "})
    assert status == 202 and body["id"] == 3
    status, _, _ = await api.call("POST", "/api/v1/leases/3/end", api.admin)  # no body
    assert status == 202
    assert api.leases.calls == [("end_lease", 3, "root", "maintenance window"),
                                ("end_lease", 3, "root", "")]
    status, body, _ = await api.call("POST", "/api/v1/leases/4/end", api.admin)
    assert status == 404 and body["error"] == "lease 4 is not active"


@pytest.mark.parametrize("data, needle", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"reason": 5}', "'reason' must be a string"),
    ('{"why": "x"}', "unknown field(s) in the request body: why"),
    (json.dumps({"reason": "x" * 501}), "at most 500"),
])
async def test_end_lease_bad_body(api: Api, data: str, needle: str) -> None:
    api.leases.live[3] = {"id": 3}
    status, body, _ = await api.call("POST", "/api/v1/leases/3/end", api.admin, data=data,
                                     headers={"Content-Type": "application/json"})
    assert status == 400 and needle in body["error"], body
    assert api.leases.calls == []


async def test_queue(api: Api) -> None:
    api.leases.queue += [{"position": 1, "token": "bob"}, {"position": 2, "token": "carol"}]
    status, body, _ = await api.call("GET", "/api/v1/queue", api.user)
    assert status == 200 and [w["token"] for w in body["queue"]] == ["bob", "carol"]


# --------------------------------------------------------------------------------- tokens
async def test_create_use_list_and_revoke_a_token(api: Api) -> None:
    status, body, _ = await api.call("POST", "/api/v1/tokens", api.admin,
                                     body={"name": "ci-runner", "role": "user", "expires": "30d"})
    assert status == 201, body
    secret = body["secret"]
    assert secret.startswith("gpt_") and "once" in body["note"]
    assert body["token"]["name"] == "ci-runner" and body["token"]["role"] == "user"
    assert 29 * 86400 < body["token"]["expires"] - time.time() <= 30 * 86400

    # The new secret works, with its role.
    assert (await api.call("GET", "/api/v1/gpus", secret))[0] == 200
    assert (await api.call("GET", "/api/v1/tokens", secret))[0] == 403

    status, body, _ = await api.call("GET", "/api/v1/tokens", api.admin)
    assert status == 200
    assert {t["name"] for t in body["tokens"]} >= {"root", "alice", "ci-runner"}
    listing = json.dumps(body)
    assert secret not in listing and secret.rsplit("_", 1)[1] not in listing
    assert "hash" not in listing

    status, body, _ = await api.call("DELETE", "/api/v1/tokens/ci-runner", api.admin)
    assert status == 200 and body["token"]["name"] == "ci-runner" and body["token"]["revoked"]
    status, body, _ = await api.call("GET", "/api/v1/gpus", secret)
    assert status == 401 and "revoked" in body["error"]

    # The store audited both actions with the admin's token name as the actor.
    _, audit, _ = await api.call("GET", "/api/v1/audit", api.admin)
    mine = [(e["actor"], e["action"], e["target"]) for e in audit["audit"]
            if "ci-runner" in e["target"]]
    assert len(mine) == 2 and all(actor == "root" for actor, _, _ in mine), audit


async def test_create_token_defaults_and_never(api: Api) -> None:
    status, body, _ = await api.call("POST", "/api/v1/tokens", api.admin, body={"name": "bot"})
    assert status == 201 and body["token"]["role"] == "user" and body["token"]["expires"] is None
    status, body, _ = await api.call("POST", "/api/v1/tokens", api.admin,
                                     body={"name": "ops", "role": "admin", "expires": "never"})
    assert status == 201 and body["token"]["role"] == "admin"
    assert (await api.call("GET", "/api/v1/audit", body["secret"]))[0] == 200
    assert body["token"]["weight"] == 1  # a share weight of 1 unless given (issue 32)
    status, body, _ = await api.call("POST", "/api/v1/tokens", api.admin,
                                     body={"name": "heavy", "weight": 3})
    assert status == 201 and body["token"]["weight"] == 3
    assert (await api.store.get_token("heavy")).weight == 3


@pytest.mark.parametrize("body, status, needle", [
    ({}, 400, "'name' is required"),
    ({"name": 5}, 400, "'name' must be a string"),
    ({"name": ""}, 400, "bad token name"),
    ({"name": "has space"}, 400, "bad token name"),
    ({"name": "ok", "role": "root"}, 400, "unknown role 'root'"),
    ({"name": "ok", "expires": "soon"}, 400, "bad expiry 'soon'"),
    ({"name": "ok", "expires": 30}, 400, "'expires' must be a string"),
    ({"name": "ok", "secret": "mine"}, 400, "unknown field(s)"),
    ({"name": "ok", "weight": 0}, 400, "bad weight 0"),
    ({"name": "ok", "weight": "3"}, 400, 'bad weight "3"'),
    ({"name": "alice"}, 409, "already exists"),
])
async def test_create_token_errors(api: Api, body: dict[str, Any], status: int,
                                   needle: str) -> None:
    before = len(await api.store.list_tokens())
    got, answer, _ = await api.call("POST", "/api/v1/tokens", api.admin, body=body)
    assert got == status and needle in answer["error"] and answer["hint"], answer
    assert len(await api.store.list_tokens()) == before


async def test_revoke_unknown_token_is_404(api: Api) -> None:
    status, body, _ = await api.call("DELETE", "/api/v1/tokens/nobody", api.admin)
    assert status == 404 and "nobody" in body["error"]


# ---------------------------------------------------------------------------------- audit
async def test_audit_log_paging(api: Api) -> None:
    for i in range(5):
        await api.store.audit("root", "test.action", f"thing {i}")
    seen: list[str] = []
    path = "/api/v1/audit?limit=2"
    while True:
        status, body, _ = await api.call("GET", path, api.admin)
        assert status == 200
        seen += [e["target"] for e in body["audit"] if e["action"] == "test.action"]
        if body["next_before"] is None:
            break
        path = f"/api/v1/audit?limit=2&before={body['next_before']}"
    assert sorted(seen) == [f"thing {i}" for i in range(5)]
    status, body, _ = await api.call("GET", "/api/v1/audit?limit=-3", api.admin)
    assert status == 400 and "limit" in body["error"]


# --------------------------------------------------------------------------------- report
async def test_report_from_the_stored_usage(api: Api) -> None:
    """GET /api/v1/report (issue 33): the stored minutes and leases of the period, by token."""
    t0 = 1_800_000_000.0
    lease = await add_lease(api.store, token="alice")
    meter = UsageMeter()
    for at, util in ((t0, 100), (t0 + 60, 100), (t0 + 120, 0)):
        meter.observe(at, 1, Observation(lease, "alice", util))
    await api.store.record_usage(meter.take())
    status, body, _ = await api.call(
        "GET", f"/api/v1/report?from={t0:.0f}&to={t0 + 3600:.0f}&by=token", api.admin)
    assert status == 200, body
    r = body["report"]
    assert r["gpus"] == 2  # the inventory's, the unused one included
    assert r["leased_gpu_hours"] == pytest.approx(120 / 3600)
    assert r["busy_share"] == pytest.approx(60 / 7200)
    assert [(g["token"], g["busy_of_leased"]) for g in r["groups"]] == [("alice", 0.5)]
    assert r["leases"] == 0  # add_lease's lease started now, not in that hour
    assert r["summary"].startswith("the 2 GPUs were leased 2 % and busy 1 % of the hour")
    for query, needle in (("by=team", "unknown grouping"), ("from=10&to=5", "period is empty"),
                          ("to=soon", "to must be a time")):
        status, body, _ = await api.call("GET", f"/api/v1/report?{query}", api.admin)
        assert status == 400 and needle in body["error"], body


# ------------------------------------------------------------------------- error handling
async def test_unknown_path_and_method_are_json_errors(api: Api) -> None:
    status, body, _ = await api.call("GET", "/api/v1/nope", api.admin)
    assert status == 404 and body["error"] == "no such endpoint: GET /api/v1/nope"
    assert body["hint"].startswith("the endpoints are listed")
    status, body, headers = await api.call("PUT", "/api/v1/gpus", api.admin)
    assert status == 405 and body["error"] == "PUT is not allowed on /api/v1/gpus"
    assert "GET" in headers["Allow"] and "GET" in body["hint"]


async def test_oversized_body_is_413(api: Api) -> None:
    status, body, _ = await api.call("POST", "/api/v1/tokens", api.admin,
                                     data=io.BytesIO(b"x" * (2 << 20)),
                                     headers={"Content-Type": "application/json"})
    assert status == 413 and body["error"]


async def test_a_bug_is_a_json_500_and_the_daemon_goes_on(api: Api,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    api.leases.broken = True
    status, body, _ = await api.call("GET", "/api/v1/gpus", api.user)
    assert status == 500 and "internal error" in body["error"] and "log" in body["hint"]
    assert "simulated bug" in caplog.text
    api.leases.broken = False
    assert (await api.call("GET", "/api/v1/gpus", api.user))[0] == 200


# ---------------------------------------------------------------------------------- docs
@pytest.mark.parametrize("route", ROUTES, ids=rid)
def test_docs_api_md_documents_every_route(route: Route) -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    assert f"\n### {route.method} {route.path}\n" in text, f"docs/api.md: no section for {rid(route)}"
    section = text.split(f"\n### {route.method} {route.path}\n", 1)[1].split("\n### ", 1)[0].lstrip()
    role = {PUBLIC: "No token", USER: "Role user", ADMIN: "Role admin",
            METRICS: "Role user"}[route.role]
    assert section.startswith(role), f"docs/api.md: {rid(route)} should start with '{role}'"
