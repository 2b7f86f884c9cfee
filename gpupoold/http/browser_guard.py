"""What keeps other web sites away from the HTTP listener through a visitor's browser (issue 29,
item 7; docs/security.md, "The dashboard in a browser").

Three checks, in one middleware that runs before the token middleware (http/auth.py):

- **The scheme behind a reverse proxy.** A request from an address of `trusted_proxies` that
  says `X-Forwarded-Proto: https` is handled as an HTTPS request (`request.secure`): the
  dashboard's session cookie gets `Secure` and the origin check below expects `https://`. From
  any other address the header is ignored, so a client cannot claim a scheme.
- **The Host header (DNS rebinding).** A page of a site whose name an attacker points at this
  server (`evil.example` -> this server's address) reaches it with `Host: evil.example`, and the
  browser treats the answers as that site's: with `auth = "none"` or `http_anonymous_read` it
  could read the API and, with `auth = "none"`, act. So a request naming a host that is not this
  listener's gets `421 Misdirected Request`. The listener's hosts: any IP address (a browser
  sends an address only when it connected to that address itself: rebinding needs a name), this
  machine's host name and fully qualified name, `localhost`, the host of `http_advertise` and of
  `http`, and the names in `http_allowed_hosts` (`"*"` there turns this check off). `/healthz`
  and the dashboard's static files (public, and they tell nothing) are not checked.
- **The Origin of state-changing requests (CSRF).** A POST, PUT, PATCH or DELETE whose `Origin`
  (else `Referer`) is not this listener's own origin (the scheme and host the request was sent
  to), nor a host of `http_allowed_hosts`, is refused with 403: another site's form cannot log a
  browser in with the attacker's token (login CSRF), nor use a session or, with `auth = "none"`,
  the API. An `Origin: null` (sandboxed frames, some redirects) is refused too. Not checked:
  a request with neither header (browsers send `Origin` with every POST; scripts and `curl` do
  not) and one with `Authorization: Bearer` and no cookie (an API client: a browser sends that
  header to another site only after a CORS preflight, which gpupoold never answers yes).

Every refusal says what happened and which setting changes it, is logged and is counted as
`http_auth_refused` (reason `host` or `origin`; metric `gpupool_auth_failures`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from aiohttp import hdrs, web

from gpupoold.config.settings import Settings, parse_address
from gpupoold.http.auth import PUBLIC, Handler, error_response, route_role
from gpupoold.http.keys import COUNTERS, SETTINGS

log = logging.getLogger("gpupoold.http")

# This listener's host names (lower case, no trailing dot), learnt at start-up.
OWN_HOSTS = web.AppKey("gpupool_own_hosts", frozenset)
SAFE_METHODS = frozenset({hdrs.METH_GET, hdrs.METH_HEAD, hdrs.METH_OPTIONS, hdrs.METH_TRACE})
DEFAULT_PORTS = {"http": 80, "https": 443}
ANY_HOST = "*"
PROXY_GUIDE = "docs/operator-guide.md, \"Behind a reverse proxy\""


def normal_host(name: str) -> str:
    return name.strip().rstrip(".").lower()


def split_host(value: str) -> tuple[str, int | None]:
    """`name`, `name:port`, `[v6]` or `[v6]:port` (a Host header, a URL's netloc) -> (host in
    lower case without brackets, the port or None). ValueError when it is none of these."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError(f"unclosed '[' in {value!r}")
        host, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{value!r} is not [ADDRESS]:PORT")
        port_text = rest[1:]
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep:
            host, port_text = value, ""
        elif ":" in host:  # an IPv6 address without brackets: not a Host header's form
            raise ValueError(f"{value!r}: an IPv6 address needs brackets")
    if not host:
        raise ValueError(f"{value!r} names no host")
    if port_text and not port_text.isdigit():
        raise ValueError(f"{value!r}: the port is not a number")
    return normal_host(host), int(port_text) if port_text else None


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def own_hosts(settings: Settings) -> frozenset[str]:
    """The names this listener answers to by itself (blocking: resolves this machine's name)."""
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    for address in (settings.http, settings.http_advertise):
        if address:
            names.add(parse_address(address)[0])
    return frozenset(normal_host(n) for n in names if n and not is_address(n))


def allowed_hosts(settings: Settings) -> frozenset[str]:
    return frozenset(normal_host(h) for h in settings.http_allowed_hosts)


def host_allowed(host: str, own: Iterable[str], settings: Settings) -> bool:
    allowed = allowed_hosts(settings)
    return ANY_HOST in allowed or is_address(host) or host in own or host in allowed


def _trusted(peer: str | None, settings: Settings) -> bool:
    if not peer or not settings.trusted_proxies:
        return False
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d
    return any(address in ipaddress.ip_network(net, strict=False)
               for net in settings.trusted_proxies)


def forwarded_scheme(request: web.Request, settings: Settings) -> str | None:
    """"https" or "http" as a trusted proxy says (`X-Forwarded-Proto`), else None. Of a list
    ("https, http") the last value counts: the one the nearest proxy, the trusted one, wrote."""
    value = request.headers.get("X-Forwarded-Proto")
    if value is None or not _trusted(request.remote, settings):
        return None
    scheme = value.split(",")[-1].strip().lower()
    return scheme if scheme in DEFAULT_PORTS else None


def _refuse(request: web.Request, status: int, reason: str, message: str,
            hint: str) -> web.Response:
    request.app[COUNTERS].inc("http_auth_refused", reason=reason)
    log.info("HTTP %s %s from %s refused (%s): %s", request.method, request.path,
             request.remote or "?", reason, message)
    return error_response(status, message, hint)


def check_host(request: web.Request, settings: Settings) -> web.Response | None:
    """None when the request's Host is one of this listener's, else the 421."""
    header = request.headers.get(hdrs.HOST)
    if header is None:  # HTTP/1.0 without one: not a browser
        return None
    try:
        host, _ = split_host(header)
    except ValueError as exc:
        return _refuse(request, 400, "host", f"the Host header is malformed: {exc}",
                       "send `Host: NAME[:PORT]`")
    if host_allowed(host, request.app.get(OWN_HOSTS, frozenset()), settings):
        return None
    return _refuse(
        request, 421, "host",
        f"this server does not answer to the host name '{host}' of the request (a page of another "
        "site may be trying to reach it through the visitor's browser: DNS rebinding)",
        "reach it by an IP address, `localhost` or this machine's host name; to serve it under "
        f"another name (a DNS alias, a reverse proxy's name), list that name in the setting "
        f"`http_allowed_hosts` ({PROXY_GUIDE})")


def _origin_of(request: web.Request) -> tuple[str, str] | None:
    """(the header it came from, the origin `scheme://host[:port]`), or None without either."""
    origin = request.headers.get(hdrs.ORIGIN)
    if origin is not None:
        return hdrs.ORIGIN, origin.strip()
    referer = request.headers.get(hdrs.REFERER)
    if referer is not None:
        parts = urlsplit(referer.strip())
        return hdrs.REFERER, f"{parts.scheme}://{parts.netloc}" if parts.scheme else "null"
    return None


def _same_origin(origin: str, request: web.Request, settings: Settings) -> bool:
    parts = urlsplit(origin)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.netloc or parts.path not in ("", "/"):
        return False
    try:
        host, port = split_host(parts.netloc.rpartition("@")[2])
    except ValueError:
        return False
    if host != ANY_HOST and host in allowed_hosts(settings):  # a name it is served under
        return True
    header = request.headers.get(hdrs.HOST)
    if header is None:
        return False
    try:
        own_host, own_port = split_host(header)
    except ValueError:
        return False
    return ((scheme, host, port or DEFAULT_PORTS[scheme])
            == (request.scheme, own_host, own_port or DEFAULT_PORTS[request.scheme]))


def check_origin(request: web.Request, settings: Settings) -> web.Response | None:
    """None when a state-changing request may go on, else the 403 (see the module's text)."""
    if request.method in SAFE_METHODS:
        return None
    authorization = request.headers.get(hdrs.AUTHORIZATION, "")
    if authorization.lower().startswith("bearer ") and hdrs.COOKIE not in request.headers:
        return None  # an API client with its token, not a browser's form
    found = _origin_of(request)
    if found is None:
        return None
    header, origin = found
    if _same_origin(origin, request, settings):
        return None
    here = f"{request.scheme}://{request.headers.get(hdrs.HOST, '?')}"
    hint = (f"use the dashboard's own pages ({here}/ui/) rather than a form or script of "
            "another site")
    if origin.startswith("https://") and request.scheme == "http":
        hint += ("; behind a reverse proxy that speaks HTTPS, list its address in the setting "
                 f"`trusted_proxies` and its public name in `http_allowed_hosts` ({PROXY_GUIDE})")
    else:
        hint += (f"; if this server is published under that name, list it in the setting "
                 f"`http_allowed_hosts` ({PROXY_GUIDE})")
    return _refuse(request, 403, "origin",
                   f"cross-site request refused: this {request.method} comes from {origin} (its "
                   f"{header} header), not from this server ({here})", hint)


@web.middleware
async def browser_guard_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    scheme = forwarded_scheme(request, settings)
    if scheme is not None and scheme != request.scheme:
        request = request.clone(scheme=scheme)
    if route_role(request) != PUBLIC:
        refusal = check_host(request, settings)
        if refusal is not None:
            return refusal
    refusal = check_origin(request, settings)
    if refusal is not None:
        return refusal
    return await handler(request)


def setup_browser_guard(app: web.Application) -> None:
    """Learn this listener's host names at start-up (the middleware is in app.create_app)."""

    async def learn(app: web.Application) -> None:
        app[OWN_HOSTS] = await asyncio.to_thread(own_hosts, app[SETTINGS])

    app.on_startup.append(learn)
