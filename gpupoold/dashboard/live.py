"""Live updates: the server-sent event stream the pages follow, and the sampler that keeps the
last hour's history; both fed by the lease manager's events (pool/events.py), no I/O."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gpupoold.dashboard.access import refused, viewer
from gpupoold.dashboard.history import History
from gpupoold.dashboard.payload import chart_update, shown, stable_text, state_payload
from gpupoold.dashboard.state import DASHBOARD, STREAM_BACKLOG
from gpupoold.http.keys import EVENTS, INVENTORY, LEASES, SETTINGS, TELEMETRY, VIEWS, tls_view
from gpupoold.http.metrics import METRICS_KEY
from gpupoold.pool.events import GpuChanged
from gpupoold.tasks import stop_task

log = logging.getLogger("gpupoold.dashboard")

EVENT_EVERY_S = 2.0  # an SSE state event at least this often
EVENT_POLL_S = 0.5  # how often a stream looks for changes the lease manager does not announce
RECHECK_TOKEN_S = 30.0  # an open event stream re-checks its session's token this often


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
            for n, payload in enumerate(payloads):
                payload = shown(v, payload)  # this viewer's copy: command lines it may see
                stable = stable_text(payload)
                if stable != last_text or now - last_sent >= EVENT_EVERY_S:
                    if n == len(payloads) - 1:  # the current one carries the charts too
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
                async with asyncio.timeout(EVENT_POLL_S):  # not wait_for: see pool/fleet.py
                    await changed.wait()
    except ConnectionResetError:
        pass  # the page was closed
    finally:
        dash.streams.discard(queued)
    return resp


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
    dash.tls = tls_view(app)
    dash.fallback = app[INVENTORY].fallback_reason

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
        await stop_task(task)
        unsubscribe()
