"""The HTTP listener's browser checks (gpupoold/http/browser_guard.py; issue 29, item 7): the
Host allowlist against DNS rebinding, the Origin/Referer check of state-changing requests (login
CSRF included), and the `Secure` cookie behind a trusted TLS proxy.

In process, with aiohttp's test client, on an application holding the real middlewares, the real
dashboard routes and a stub authenticator (one user token): no worker, no store."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gpupoold.auth.authenticator import AuthDecision
from gpupoold.config.settings import Settings
from gpupoold.dashboard import COOKIE, setup_dashboard
from gpupoold.http.auth import ADMIN, auth_middleware, declare_roles
from gpupoold.http.browser_guard import (
    OWN_HOSTS,
    browser_guard_middleware,
    own_hosts,
    setup_browser_guard,
    split_host,
)
from gpupoold.http.keys import AUTH, COUNTERS, SETTINGS
from gpupoold.http.routes import setup_routes
from gpupoold.pool.counters import Counters

TOKEN = "gp_0123456789ab_thetokenofalice"


class OneToken:
    """The authenticator of a server with one user token; with `auth = "none"`, anyone."""

    def __init__(self, open_to_all: bool = False) -> None:
        self.open_to_all = open_to_all

    async def check(self, token: str, peer: str) -> AuthDecision:
        if self.open_to_all or token == TOKEN:
            return AuthDecision(ok=True, identity="alice", role="admin" if self.open_to_all
                                else "user")
        return AuthDecision(ok=False, reason="unknown", message="the API token is not known")


async def act(request: web.Request) -> web.Response:
    return web.json_response({"done": True})


def make_app(tmp_path: Path, **changes: Any) -> web.Application:
    settings = Settings(state_dir=tmp_path, **changes)
    app = web.Application(middlewares=[browser_guard_middleware, auth_middleware])
    app[SETTINGS] = settings
    app[COUNTERS] = Counters()
    app[AUTH] = OneToken(open_to_all=settings.auth == "none")  # type: ignore[assignment]
    setup_routes(app)
    setup_dashboard(app)
    setup_browser_guard(app)
    # A state-changing admin route whose handler needs nothing else (the API's need the pool).
    app.router.add_post("/api/v1/test-action", act)
    declare_roles(app, [("POST", "/api/v1/test-action", ADMIN)])
    return app


Client = Callable[..., AsyncIterator[TestClient]]


@pytest.fixture
def client_for(tmp_path: Path) -> Client:
    async def make(**changes: Any) -> AsyncIterator[TestClient]:
        async with TestClient(TestServer(make_app(tmp_path, **changes), host="127.0.0.1")) as c:
            yield c
    return make


async def one(client_for: Client, **changes: Any) -> tuple[TestClient, Any]:
    gen = client_for(**changes)
    return await gen.__anext__(), gen


def here(client: TestClient) -> str:
    return f"http://127.0.0.1:{client.port}"


async def login(client: TestClient, headers: dict[str, str]) -> tuple[int, Any, str]:
    resp = await client.post("/ui/login", data={"token": TOKEN}, headers=headers,
                             allow_redirects=False)
    return resp.status, resp.headers, await resp.text()


def refused_count(client: TestClient, reason: str) -> int:
    return client.server.app[COUNTERS].get("http_auth_refused", reason=reason)


# ------------------------------------------------------------------------------ login CSRF
async def test_a_cross_origin_login_is_refused_and_a_same_origin_one_accepted(
        client_for: Client) -> None:
    async for client in client_for():
        status, headers, text = await login(client, {"Origin": "https://evil.example"})
        assert status == 403 and "Set-Cookie" not in headers
        assert "cross-site request refused" in text and "https://evil.example" in text
        assert refused_count(client, "origin") == 1
        # The same through Referer alone (no Origin), and the opaque origin "null".
        status, headers, _ = await login(client, {"Referer": "https://evil.example/page"})
        assert status == 403 and "Set-Cookie" not in headers
        status, _, _ = await login(client, {"Origin": "null"})
        assert status == 403
        # Another port of the same host is another origin.
        status, _, _ = await login(client, {"Origin": "http://127.0.0.1:1"})
        assert status == 403
        assert refused_count(client, "origin") == 4

        status, headers, _ = await login(client, {"Origin": here(client)})
        assert status == 303 and headers["Location"] == "/ui/"
        assert headers["Set-Cookie"].startswith(f"{COOKIE}=")
        status, headers, _ = await login(client, {"Referer": here(client) + "/ui/login"})
        assert status == 303 and "Set-Cookie" in headers
        # No Origin and no Referer: not a browser (every browser sends Origin with a POST).
        status, headers, _ = await login(client, {})
        assert status == 303 and "Set-Cookie" in headers


async def test_with_auth_none_another_site_cannot_post_to_the_api(client_for: Client) -> None:
    async for client in client_for(auth="none"):
        resp = await client.post("/api/v1/test-action", headers={"Origin": "https://evil.example"})
        assert resp.status == 403 and "cross-site" in (await resp.json())["error"]
        resp = await client.post("/api/v1/test-action", headers={"Origin": here(client)})
        assert resp.status == 200 and (await resp.json()) == {"done": True}
        # An API client with its token and no cookie is not a browser: its Origin is not judged.
        resp = await client.post("/api/v1/test-action", headers={
            "Origin": "https://tool.example", "Authorization": f"Bearer {TOKEN}"})
        assert resp.status == 200
        # The same with a cookie is what a browser would send: judged.
        resp = await client.post("/api/v1/test-action", headers={
            "Origin": "https://tool.example", "Authorization": f"Bearer {TOKEN}",
            "Cookie": f"{COOKIE}=x"})
        assert resp.status == 403


async def test_reads_are_not_judged_by_their_origin(client_for: Client) -> None:
    async for client in client_for():
        resp = await client.get("/ui/login", headers={"Origin": "https://evil.example"})
        assert resp.status == 200


# ------------------------------------------------------------------------ Host (rebinding)
async def test_a_foreign_host_is_refused_and_an_allowed_one_accepted(client_for: Client) -> None:
    async for client in client_for(http_anonymous_read=True,
                                   http_allowed_hosts=["gpus.example.org"]):
        resp = await client.get("/api/v1/queue", headers={"Host": "evil.example"})
        body = await resp.json()
        assert resp.status == 421, body
        assert "'evil.example'" in body["error"] and "http_allowed_hosts" in body["hint"]
        assert refused_count(client, "host") == 1
        # A rebound name may carry any port, and a login form posted there is refused as well.
        resp = await client.post("/ui/login", data={"token": TOKEN}, allow_redirects=False,
                                 headers={"Host": "evil.example:7071"})
        assert resp.status == 421 and "Set-Cookie" not in resp.headers

        for host in ("gpus.example.org", "GPUS.example.org.:8443", "localhost",
                     f"127.0.0.1:{client.port}", "[::1]:7071", "10.1.2.3"):
            resp = await client.get("/ui/login", headers={"Host": host})
            assert resp.status == 200, host
        # /healthz tells nothing and answers load balancers under any name.
        resp = await client.get("/healthz", headers={"Host": "evil.example"})
        assert resp.status != 421


async def test_the_machines_own_names_are_allowed(client_for: Client) -> None:
    async for client in client_for():
        own = client.server.app[OWN_HOSTS]
        assert own == own_hosts(client.server.app[SETTINGS]) and "localhost" in own
        for name in own:
            resp = await client.get("/ui/login", headers={"Host": name})
            assert resp.status == 200, name


async def test_a_star_allows_every_host_but_not_every_origin(client_for: Client) -> None:
    async for client in client_for(http_allowed_hosts=["*"]):
        resp = await client.get("/ui/login", headers={"Host": "anything.example"})
        assert resp.status == 200
        status, _, _ = await login(client, {"Origin": "http://anything.example"})
        assert status == 403


async def test_a_proxys_public_name_is_an_own_origin(client_for: Client) -> None:
    # nginx passing `Host: 127.0.0.1:PORT` upstream while the browser is on the public name.
    async for client in client_for(http_allowed_hosts=["gpus.example.org"]):
        status, _, _ = await login(client, {"Origin": "https://gpus.example.org"})
        assert status == 303


# ------------------------------------------------------------------ Secure behind a proxy
@pytest.mark.parametrize("proxies, secure", [(["127.0.0.1"], True), (["127.0.0.0/8"], True),
                                             (["10.0.0.0/8"], False), ([], False)])
async def test_the_cookie_is_secure_only_behind_a_trusted_tls_proxy(
        client_for: Client, proxies: list[str], secure: bool) -> None:
    async for client in client_for(trusted_proxies=proxies):
        host = f"127.0.0.1:{client.port}"
        status, headers, text = await login(client, {"X-Forwarded-Proto": "https",
                                                     "Origin": f"https://{host}"})
        if not secure:
            # Not believed: an https page posting to what is plain HTTP here is cross-origin,
            # and the refusal says which setting fixes it.
            assert status == 403 and "trusted_proxies" in text
            status, headers, _ = await login(client, {"X-Forwarded-Proto": "https",
                                                      "Origin": f"http://{host}"})
        assert status == 303, text
        attrs = [a.strip().lower() for a in headers["Set-Cookie"].split(";")]
        assert "httponly" in attrs and "samesite=strict" in attrs and "path=/ui" in attrs
        assert ("secure" in attrs) == secure


# ------------------------------------------------------------------------- the settings
def test_split_host_reads_every_form_of_a_host_header() -> None:
    assert split_host("Example.COM.") == ("example.com", None)
    assert split_host("example.com:8443") == ("example.com", 8443)
    assert split_host("[::1]:7071") == ("::1", 7071)
    assert split_host("[::1]") == ("::1", None)
    for bad in ("", ":80", "[::1", "::1", "host:port", "[::1]x"):
        with pytest.raises(ValueError):
            split_host(bad)


def test_the_settings_refuse_what_is_not_a_host_name_or_a_network(tmp_path: Path) -> None:
    from gpupoold.config.file import ConfigError, load_settings

    config = tmp_path / "gpupoold.toml"
    for text, setting in (('http_allowed_hosts = ["https://gpus.example.org"]',
                           "http_allowed_hosts"),
                          ('http_allowed_hosts = ["gpus.example.org:443"]', "http_allowed_hosts"),
                          ('trusted_proxies = ["proxy.example.org"]', "trusted_proxies"),
                          ('trusted_proxies = ["10.0.0.0/33"]', "trusted_proxies")):
        config.write_text(text + "\n")
        with pytest.raises(ConfigError, match=setting):
            load_settings(config, {})
    config.write_text('http_allowed_hosts = ["gpus.example.org", "*"]\n'
                      'trusted_proxies = ["10.0.0.5", "fd00::/8"]\n')
    settings = load_settings(config, {})
    assert settings.http_allowed_hosts == ["gpus.example.org", "*"]
    assert settings.trusted_proxies == ["10.0.0.5", "fd00::/8"]
