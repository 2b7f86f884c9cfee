"""The Utilisation page (`/ui/utilisation`, issue 33, item 3): over a period (an hour, a day or a
week up to now, or `from`/`to`), a lease timeline per GPU, busy versus leased time per GPU and
per token, and the usage report's summary in words.

Everything comes from the store (its own thread, as every page's data): the lease records that
overlap the period with their idle-detach events, and the same sources as `GET /api/v1/report`
(http/api.py: the per-minute rows of every minute the period overlaps, every server's GPUs on a
shared store) for pool/report.py's build_report. dashboard/timeline.py turns them into
geometry.

Who sees what: the timeline names each lease's token, as the History page does for every
viewer (docs/security.md: tenants see who holds a GPU). The report names every token's
GPU-hours and is an admin's (the API's rule): the per-token chart shows an admin every token,
a user session its own token only, the anonymous reader none. The per-GPU chart and the
summary name no token and are shown to all.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from gpupoold.dashboard.access import page, page_viewer
from gpupoold.dashboard.sessions import Viewer
from gpupoold.dashboard.timeline import (
    RANGES,
    LeaseSpan,
    lease_event,
    per_device,
    row_label,
    span_words,
    timeline,
    usage_chart,
)
from gpupoold.http.keys import INVENTORY, STORE, USAGE
from gpupoold.pool.report import build_report
from gpupoold.pool.report_sources import lease_facts, usage_of
from gpupoold.store.database import LeaseFilter, LeaseRecord

DEFAULT_RANGE = "day"
MAX_SPAN_S = 31 * 86400.0  # a longer period is refused: the page reads every lease of it
MIN_SPAN_S = 60.0  # the usage rows are per minute
MAX_LEASES = 1_000_000  # lease records read for a period (a bound, not a page)
DRAWN_LEASES = 20_000  # the timeline draws the latest this many (a week of short jobs fits)
EVENT_LEASES = 500  # leases whose detach events are read (one query each; latest first)


@dataclass(frozen=True)
class Period:
    start: float
    end: float
    preset: str | None  # "hour", "day", "week" when the period is one of them up to now
    problem: str  # a wrong parameter, said on the page ("" when none)


def _seconds(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 <= value < float("inf") else None


def choose_period(query: Any, now: float) -> Period:
    """The period of the page's parameters: `range` (hour, day, week; up to now) or `from` and
    `to` (Unix seconds; a missing `to` is now, a missing `from` a day before `to`). A wrong one
    is said and the last day shown instead."""
    preset = query.get("range", "")
    has_times = bool(query.get("from") or query.get("to"))
    fallback = Period(now - RANGES[DEFAULT_RANGE], now, DEFAULT_RANGE, "")
    if preset and preset not in RANGES:
        return Period(fallback.start, fallback.end, fallback.preset,
                      f"unknown range {preset!r} (hour, day or week): showing the last day")
    if not has_times:
        span = RANGES[preset or DEFAULT_RANGE]
        return Period(now - span, now, preset or DEFAULT_RANGE, "")
    end = _seconds(query["to"]) if query.get("to") else now
    if end is None:
        return Period(fallback.start, fallback.end, fallback.preset,
                      f"to must be a time in Unix seconds, not {query['to']!r}: showing the "
                      "last day")
    start = _seconds(query["from"]) if query.get("from") else end - RANGES[preset or DEFAULT_RANGE]
    if start is None:
        return Period(fallback.start, fallback.end, fallback.preset,
                      f"from must be a time in Unix seconds, not {query['from']!r}: showing "
                      "the last day")
    if end - start < MIN_SPAN_S:
        return Period(fallback.start, fallback.end, fallback.preset,
                      "the period must be at least a minute long (`to` after `from`): "
                      "showing the last day")
    if end - start > MAX_SPAN_S:
        return Period(fallback.start, fallback.end, fallback.preset,
                      "the period may be at most 31 days long: showing the last day")
    return Period(start, end, None, "")


def links(p: Period, now: float) -> dict[str, str]:
    """The zoom and move links of a period: the presets up to now, earlier and later by the
    period's length, in (half as long, around the middle) and out (twice, up to now at most)."""
    span = p.end - p.start
    middle = (p.start + p.end) / 2

    def at(start: float, end: float) -> str:
        return "/ui/utilisation?" + urlencode({"from": f"{start:.0f}", "to": f"{end:.0f}"})

    out = {name: f"/ui/utilisation?range={name}" for name in RANGES}
    out["earlier"] = at(p.start - span, p.end - span)
    if p.end < now - 1:
        out["later"] = at(min(p.start + span, now - span), min(p.end + span, now))
    if span / 2 >= MIN_SPAN_S:
        out["zoom_in"] = at(middle - span / 4, middle + span / 4)
    if span * 2 <= MAX_SPAN_S:
        end = min(middle + span, max(now, p.end))
        out["zoom_out"] = at(end - 2 * span, end)
    return out


def lease_spans(r: LeaseRecord, server: str, events: list[dict[str, Any]]) -> list[LeaseSpan]:
    """The timeline's spans of record `r`: one with its detaches, and a lease of several GPUs
    (issue 37) one per device, each following its device's GPU (timeline.per_device)."""
    first = LeaseSpan(id=r.id, server=r.server or server, gpu=r.gpu_index, token=r.token_name,
                      started=r.started, ended=r.ended,
                      events=tuple(lease_event(e) for e in events))
    return per_device(first, r.gpus)


def token_groups(groups: list[dict[str, Any]], v: Viewer) -> list[dict[str, Any]] | None:
    """What `v` may see of the report's per-token groups: all (an admin), its own token's (a
    user session), None (the anonymous reader: nothing to show)."""
    if v.admin or v.role == "admin-auto":
        return groups
    if v.session is not None and v.role == "user":
        return [g for g in groups if g["token"] == v.name]
    return None


async def utilisation_page(request: web.Request) -> web.Response:
    v, new = await page_viewer(request)
    now = time.time()
    period = choose_period(request.query, now)
    since, until = period.start, period.end
    app = request.app
    store = app[STORE]
    gpus, minutes = await usage_of(store, app.get(USAGE), lambda: [g.index for g in app[INVENTORY].gpus],
                                   since, until)
    records = await store.leases("all", MAX_LEASES, None,
                                 LeaseFilter(ended_after=since, until=until))
    events: dict[int, list[dict[str, Any]]] = {}
    for r in [r for r in records[:DRAWN_LEASES] if r.detaches > 0][:EVENT_LEASES]:
        events[r.id] = await store.lease_events(r.id)
    # The arithmetic of a week of minute rows and leases is not the event loop's to do.
    drawing = await asyncio.to_thread(draw, period, now, gpus, minutes, records, events,
                                      store.server, v)
    return page(request, "utilisation.html", v, new, period=period,
                span=span_words(until - since), links=links(period, now), ranges=list(RANGES),
                **drawing)


def draw(period: Period, now: float, gpus: list[tuple[str, int]],
         minutes: list[dict[str, Any]], records: list[LeaseRecord],
         events: dict[int, list[dict[str, Any]]], server: str, v: Viewer) -> dict[str, Any]:
    """The page's report, timeline and charts from what was read (`records` newest first;
    `events` of the leases that detached, as far as they were read)."""
    since, until = period.start, period.end
    facts = lease_facts(r for r in records if r.started >= since)
    by_gpu = build_report(since, until, "gpu", gpus, minutes, facts)
    by_token = build_report(since, until, "token", gpus, minutes, facts)
    drawn = records[:DRAWN_LEASES]
    unevented = sum(1 for r in drawn if r.detaches > 0 and r.id not in events)
    offset = float(time.localtime(now).tm_gmtoff)
    spans = [span for r in drawn for span in lease_spans(r, server, events.get(r.id, []))]
    lines = timeline(spans, gpus, since, until, now, utc_offset=offset)
    servers = len({s for s, _ in gpus} | {r.server or server for r in drawn})
    gpu_labels = {(f"{s}/{i}" if s else str(i)): row_label(s, i, servers) for s, i in gpus}
    gpu_chart = usage_chart(by_gpu["groups"], "gpu", top_h=(until - since) / 3600.0,
                            labels=gpu_labels, percent=True)
    tokens = token_groups(by_token["groups"], v)
    return {"timeline": lines, "report": by_gpu, "gpu_chart": gpu_chart,
            "token_chart": usage_chart(tokens, "token") if tokens else None,
            "tokens_shown": tokens is not None,
            "skipped": max(0, len(records) - DRAWN_LEASES), "unevented": unevented}
