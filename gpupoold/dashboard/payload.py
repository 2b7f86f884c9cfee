"""The state a page shows and an event carries: the API's views (pool/views.py) with each GPU's
`idle` flag, and the last hour's charts."""

from __future__ import annotations

import json
import time
from typing import Any, TypeVar

from aiohttp import web

from gpupoold.dashboard.formatting import human_bytes
from gpupoold.dashboard.history import DAY_S, bars, day_view, polyline
from gpupoold.dashboard.sessions import Viewer
from gpupoold.dashboard.state import DASHBOARD
from gpupoold.http.keys import STORE, VIEWS
from gpupoold.pool.privacy import ADMIN, private_view
from gpupoold.store.database import LeaseFilter

DAY_ROWS = 10000  # lease records read for the day view (a day of short jobs fits)
DAY_EVENT_LEASES = 500  # of those that detached, whose events are read (one query each; latest)

T = TypeVar("T")


def shown(v: Viewer, data: T) -> T:
    """What `v` may see of `data` (a payload, lease rows, the fleet view): the clients' command
    lines whole for their owner's session and admins, the program's name for everyone else
    (pool/privacy.py). With `auth = "none"` every visitor is an admin ("admin-auto")."""
    return private_view(data, v.name, ADMIN if v.role == "admin-auto" else v.role)


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


def stable_text(payload: dict[str, Any]) -> str:
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
                           "copy": "", "copy_top": 0.0, "copy_last": None,
                           "span": axis_start(end - start)}
    if history is None:
        return out
    # The time axis spans the last hour, or less while the daemon has less history (at least
    # a minute): a young daemon's few points would otherwise sit in the last pixel.
    first = [p.at for g in gpus for p in history.gpu(g["index"])[:1]]
    first += [p.at for p in history.pool()[:1]]
    if first:
        start = max(start, min(min(first), end - 60.0))
    out["span"] = axis_start(end - start)
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


def axis_start(seconds: float) -> str:
    """The label of a time axis's left end, `seconds` before its right end ("now")."""
    return f"−{max(1, round(seconds / 60))} min"


def wait_bars(waits: list[float | None]) -> list[tuple[float, float, float, float]]:
    """The queue-wait bars of the last day: scaled to the peak wait but to no less than 1 s, and
    none for an hour whose mean wait is under a second ("0s" in the caption's words: the time
    from joining the queue to the worker taking the client, a few to a few tens of milliseconds
    when nobody waited, is not a wait to draw)."""
    top = max((w for w in waits if w is not None), default=0.0)
    shown = [w if w is not None and w >= 1.0 else None for w in waits]
    return bars(shown, CHART_W, CHART_H, max(top, 1.0))


async def day_charts(app: web.Application, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    """The overview's "last day" charts, from the stored lease history (one query per page
    load, in the store's thread, and one per lease that detached): each GPU's share of every
    hour it was leased, and the mean queue wait of the leases that started in each hour."""
    now = time.time()
    records = await app[STORE].leases("all", DAY_ROWS, None,
                                      LeaseFilter(ended_after=now - DAY_S, until=now))
    # A lease that detached held no GPU meanwhile, and may have come back on another one.
    events = {r.id: await app[STORE].lease_events(r.id)
              for r in [r for r in records if r.detaches > 0][:DAY_EVENT_LEASES]}
    view = day_view(records, [g["index"] for g in gpus], now, events)
    top_wait = max((w for w in view.wait if w is not None), default=0.0)
    return {"width": CHART_W, "height": CHART_H, "start": view.start,
            "leased": {g: bars(v, CHART_W, CHART_H, 1.0) for g, v in view.leased.items()},
            "leased_total": {g: round(sum(v), 1) for g, v in view.leased.items()},
            "wait": wait_bars(view.wait), "wait_top": top_wait,
            "leases": len(records)}


def chart_update(app: web.Application, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    """What the page's script needs to redraw the charts: the polylines and the captions'
    values as text (the same formatting as the page's)."""
    c = charts(app, gpus)
    util_last = c.get("util_last") or {}
    return {"util": {str(i): pts for i, pts in c["util"].items()},
            "util_now": {str(i): (f"{v} %" if v is not None else "not reported")
                         for i, v in util_last.items()},
            "copy": c["copy"], "copy_top": f"{human_bytes(c['copy_top'])}/s",
            "span": c["span"],
            "copy_now": (f"{human_bytes(c['copy_last'])}/s" if c["copy_last"] is not None
                         else "no data yet")}
