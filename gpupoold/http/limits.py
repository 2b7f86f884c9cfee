"""The HTTP listener's connection limits (docs/configuration.md, `http_max_connections`).

aiohttp bounds a request's header lines, fields and body (the runner's and the application's
arguments: `RUNNER_LIMITS`; a body: aiohttp's default `client_max_size`, 1 MiB, which the
application keeps) and closes a connection idle between requests
after `keepalive_timeout` (also one that never sends a request). It has no cap on the number
of connections: `cap_connections` adds one. Past `http_max_connections`, a new connection gets
a `503` with `Retry-After` and is closed before any of its bytes are parsed; counted as
`http_admission_refused` (metric `gpupool_admission_refusals{interface="http"}`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web

from gpupoold.pool.counters import Counters
from gpupoold.remoting.admission import Quiet

log = logging.getLogger("gpupoold.http")

KEEPALIVE_TIMEOUT = 15.0  # seconds a connection may stay idle between requests
# aiohttp.web.AppRunner's limits on a request's head: a line, a header field, the fields.
RUNNER_LIMITS: dict[str, Any] = {"keepalive_timeout": KEEPALIVE_TIMEOUT, "max_line_size": 8190,
                                 "max_field_size": 8190, "max_headers": 64}
RETRY_AFTER = 5  # seconds, in the 503 to a connection over the cap


def busy_response(limit: int) -> bytes:
    """The whole HTTP response to a connection over the cap: the API's JSON error."""
    body = json.dumps({
        "error": f"the gpupoold HTTP listener has {limit} connections open "
                 "(http_max_connections)",
        "hint": f"try again in {RETRY_AFTER} s; close idle connections",
    }).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nRetry-After: {RETRY_AFTER}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + body


def cap_connections(server: web.Server, limit: int, counters: Counters) -> None:
    """Refuse connections of `server` (a runner's, after its setup) past `limit` open ones.

    aiohttp's request handler reports each new connection to its server's `connection_made`
    before it reads anything: the cap wraps that method of this one server object."""
    made = server.connection_made
    quiet = Quiet("HTTP connection refused: %d connections are open (http_max_connections)")

    def connection_made(handler: Any, transport: asyncio.Transport) -> None:
        if len(server.connections) >= limit:
            counters.inc("http_admission_refused", reason="connections")
            quiet.note(limit)
            transport.write(busy_response(limit))
            transport.close()
            return
        made(handler, transport)

    server.connection_made = connection_made  # type: ignore[method-assign]
