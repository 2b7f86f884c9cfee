"""The Fleet page's data and its live updates: the fleet view (pool/fleet_view.py) with each
server's health, and `GET /ui/fleet/events`, the server-sent events that keep the page current.

A server's health, as this server sees it:
- `heartbeat_age_s`: how long ago it last heartbeated in the store (pool/membership.py; marked
  down after 10 s of silence);
- `sync_lag_s`: how long ago its GPUs' rows were last written by its own fleet sync (as of this
  server's last sync; for this server, since its last sync reached the store), so a server cut
  off from the database shows a growing lag before it is marked down;
- `reachable`: whether its HTTP listener, where this server sends the admin actions on its GPUs
  (http/fleet_actions.py), accepts a TCP connection from here (`reach_error` says why not; None
  until first tried). Tried only while a Fleet page is open, at most every PROBE_EVERY_S.

The view needs two store queries (servers, active leases), so a stream builds it at most every
FLEET_POLL_S, and sooner when this server's own GPUs change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from aiohttp import web

from gpupoold.config.settings import parse_address
from gpupoold.dashboard.access import refused, viewer
from gpupoold.dashboard.live import RECHECK_TOKEN_S
from gpupoold.dashboard.payload import shown, stable_text
from gpupoold.dashboard.state import DASHBOARD
from gpupoold.http.keys import STORE, VIEWS, remoting_address
from gpupoold.pool.fleet_view import fleet_view

log = logging.getLogger("gpupoold.dashboard")

FLEET_POLL_S = 1.0  # a stream looks at the fleet this often (two store queries)
FLEET_EVERY_S = 2.0  # and sends at least this often (the ages move)
PROBE_EVERY_S = 5.0  # a server's HTTP listener is tried at most this often
PROBE_TIMEOUT_S = 1.0
# What moves by itself: not worth an event at once (sent every FLEET_EVERY_S anyway).
MOVING = ("heartbeat_age_s", "sync_lag_s", "time", "synced", "syncs")


async def _probe(address: str) -> tuple[bool, str]:
    """(accepts a TCP connection, why not) for a registered `host:port`."""
    try:
        host, port = parse_address(address)
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            _reader, writer = await asyncio.open_connection(host, port)
    except TimeoutError:
        return False, f"no answer from {address} within {PROBE_TIMEOUT_S:.0f} s"
    except (OSError, ValueError) as exc:
        return False, f"{address}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True, ""


async def _reachability(app: web.Application, servers: list[dict[str, Any]]) -> None:
    """Refresh the cached probes of the servers that are up and not this one (in parallel)."""
    dash = app[DASHBOARD]
    now = time.monotonic()
    due = [s for s in servers if not s["this"] and s["state"] == "up" and s.get("http_address")
           and now - dash.reach.get(s["name"], (-PROBE_EVERY_S, None, ""))[0] >= PROBE_EVERY_S]
    if not due:
        return
    results = await asyncio.gather(*(_probe(str(s["http_address"])) for s in due))
    for s, (ok, why) in zip(due, results, strict=True):
        dash.reach[s["name"]] = (time.monotonic(), ok, why)


async def fleet_payload(app: web.Application, probe: bool = True) -> dict[str, Any]:
    """The fleet view with each server's health (the module's doc) and the time."""
    views = app[VIEWS]
    view = await fleet_view(views, app[STORE], remoting_address(app))
    fleet = views.fleet
    now = time.time()
    written: dict[str, float] = {}
    if fleet is not None and fleet.last is not None:
        for g in fleet.last.gpus:
            written[g.server] = max(written.get(g.server, 0.0), g.updated)
    if probe:
        await _reachability(app, view["servers"])
    reach = app[DASHBOARD].reach
    for s in view["servers"]:
        beat = s.get("heartbeat")
        s["heartbeat_age_s"] = round(max(0.0, now - beat), 1) if beat else None
        if s["this"]:
            last = fleet.last_ok if fleet is not None else None
            s["sync_lag_s"] = round(max(0.0, now - last), 1) if last else None
            s["reachable"], s["reach_error"] = True, ""
        else:
            s["sync_lag_s"] = (round(max(0.0, now - written[s["name"]]), 1)
                               if s["name"] in written else None)
            if s["state"] != "up":
                s["reachable"], s["reach_error"] = False, "the server is down"
            else:
                _, ok, why = reach.get(s["name"], (0.0, None, ""))
                s["reachable"], s["reach_error"] = ok, why
    view["time"] = now
    return view


def _stable(view: dict[str, Any]) -> str:
    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in MOVING}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return stable_text(strip(view))


async def fleet_events(request: web.Request) -> web.StreamResponse:
    """`event: fleet` with the Fleet page's data (as `fleet_payload`, what the viewer may see)
    when it changes and at least every FLEET_EVERY_S."""
    v = await viewer(request)
    if v is None:
        return refused(request, 401, "the event stream needs a session",
                       "log in at /ui/login (or enable http_anonymous_read)")
    dash = request.app[DASHBOARD]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-store", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    last_text, last_sent, checked = "", 0.0, time.monotonic()
    try:
        await resp.write(b"retry: 2000\n\n")
        while not dash.closing:
            changed = dash.changed  # taken first: a change while we build is not missed
            try:
                view = shown(v, await fleet_payload(request.app))
            except Exception as exc:  # noqa: BLE001 - the store unreachable, say so and go on
                log.debug("fleet view for the Fleet page failed: %s", exc)
                problem = {"error": f"this server cannot read the fleet from its database "
                                    f"({str(exc) or type(exc).__name__}); the page shows the "
                                    f"fleet as it was, and follows again once it can"}
                await resp.write(f"event: problem\ndata: {json.dumps(problem)}\n\n".encode())
                last_text = ""
            else:
                stable, now = _stable(view), time.monotonic()
                if stable != last_text or now - last_sent >= FLEET_EVERY_S:
                    data = json.dumps(view, separators=(",", ":"), default=str)
                    await resp.write(f"event: fleet\ndata: {data}\n\n".encode())
                    last_text, last_sent = stable, now
            now = time.monotonic()
            if v.session is not None and now - checked >= RECHECK_TOKEN_S:
                checked = now
                if await viewer(request) is None or dash.sessions.get(v.session.sid) is None:
                    break  # logged out, or the token revoked or expired
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FLEET_POLL_S):
                    await changed.wait()
            await asyncio.sleep(0.1)  # a burst of local changes: one view, not one each
    except ConnectionResetError:
        pass  # the page was closed
    return resp
