"""The Utilisation page's drawings as geometry (issue 33, item 3): a lease timeline per GPU, and
bar charts of leased and busy time, as plain numbers the template writes into inline SVG.

Pure functions of made-up or stored values (no store, no clock): dashboard/utilisation.py reads
the lease records, their idle-detach events and the usage report, and passes them here.

The timeline has one row per GPU. A lease is drawn where it held a GPU: from its start on its
first GPU to its end, cut where it detached (pool/detach.py records `detached` with the GPU it
left and `attached` with the GPU it came back to, which may be another). A lease of several GPUs
is drawn on each: one span per device, following that device's GPU across its detaches
(`per_device`; its events name every GPU since schema v15). The time a lease spent
detached is drawn as a thin strip under the bars of the GPU it left, apart from the leases
that held that GPU meanwhile: that GPU was free for others. Everything is clipped to the
period; a lease still running is drawn up to now, and a stretch cut by an edge of the period
says so (`open_start`, `open_end`), so a bar ending at the right edge is not read as an end.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

RANGES = {"hour": 3600.0, "day": 86400.0, "week": 7 * 86400.0}  # the zoom presets

WIDTH = 1000.0  # the drawing's width in SVG units (the page scales it to the window)
LABEL_W = 120.0  # the row labels' column on the left
ROW_H = 30.0  # one GPU's row: a lease band (BAR_Y, BAR_H) and a detached strip under it
BAR_Y, BAR_H = 3.0, 16.0
STRIP_Y, STRIP_H = 21.0, 6.0
AXIS_H = 34.0  # under the rows: tick marks, their labels and the axis title
MIN_BAR_W = 1.5  # a lease of seconds in a week's view still shows (at least this wide)
TEXT_W = 6.5  # about one character of the bar labels, to tell whether a token name fits
TOKEN_COLOURS = 8  # classes tok-0 .. tok-7 in dashboard.css; a token keeps its colour

# Tick steps (seconds), smallest first: the first that gives at most MAX_TICKS ticks is used.
TICK_STEPS = (5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 2 * 3600, 3 * 3600, 6 * 3600, 12 * 3600,
              86400, 2 * 86400, 7 * 86400)
MAX_TICKS = 12
EDGE_W = 30.0  # no tick this close to the right edge: half its label would be cut off


@dataclass(frozen=True)
class LeaseEvent:
    """An idle-detach transition of a lease (the store's lease_events): `detached` from `gpu`,
    or `attached` again on `gpu`."""

    at: float
    state: str
    gpu: int | None
    # Every GPU it names, a lease of several (program order, `gpu` first; schema v15). Events
    # written before name device 0's only: one GPU, or none.
    gpus: tuple[int, ...] = ()


def lease_event(e: Mapping[str, Any]) -> LeaseEvent:
    """An event as the store's lease_events returns it."""
    return LeaseEvent(float(e["at"]), str(e["state"]), e.get("gpu"),
                      tuple(int(g) for g in e.get("gpus") or ()))


@dataclass(frozen=True)
class LeaseSpan:
    """What the timeline needs of one lease record."""

    id: int
    server: str
    gpu: int  # the GPU it started on
    token: str
    started: float
    ended: float | None  # None: still running
    events: tuple[LeaseEvent, ...] = ()


@dataclass(frozen=True)
class Stretch:
    """A piece of a lease's time, unclipped: `leased` on a GPU, or `detached` from one."""

    kind: str  # "leased" or "detached"
    gpu: int
    start: float
    end: float


def stretches(lease: LeaseSpan, now: float) -> list[Stretch]:
    """The lease's time cut at its detaches: leased stretches on the GPU held, detached
    stretches on the GPU left. An open lease runs to `now`. Events out of order or that repeat
    a state are taken as they come (a `detached` while detached moves nothing)."""
    end = lease.ended if lease.ended is not None else max(now, lease.started)
    out: list[Stretch] = []
    kind, gpu, since = "leased", lease.gpu, lease.started
    for ev in sorted(lease.events, key=lambda e: e.at):
        at = min(max(ev.at, lease.started), end)
        if ev.state == "detached" and kind == "leased":
            out.append(Stretch(kind, gpu, since, at))
            kind, gpu, since = "detached", ev.gpu if ev.gpu is not None else gpu, at
        elif ev.state == "attached" and kind == "detached":
            out.append(Stretch(kind, gpu, since, at))
            kind, gpu, since = "leased", ev.gpu if ev.gpu is not None else gpu, at
    out.append(Stretch(kind, gpu, since, end))
    return [s for s in out if s.end > s.start]


def per_device(lease: LeaseSpan, gpus: Sequence[int]) -> list[LeaseSpan]:
    """A lease of several GPUs (`gpus`: those it started on, program order, `lease.gpu` first)
    as one span per device, each on its own GPU: device k follows the k-th GPU each event names
    (it left them all together and came back on as many). An event that does not name all of
    them (written before schema v15: device 0's only) says nothing of the other devices, so each
    of those is drawn up to the first such event. A lease of one GPU: [lease]."""
    if len(gpus) <= 1:
        return [lease]
    known: list[LeaseEvent] = []
    until = lease.ended
    for ev in sorted(lease.events, key=lambda e: e.at):
        if len(ev.gpus) != len(gpus):
            until = ev.at if until is None else min(until, ev.at)
            break
        known.append(ev)
    return [lease] + [replace(lease, gpu=g, ended=until,
                              events=tuple(replace(e, gpu=e.gpus[k]) for e in known))
                      for k, g in enumerate(gpus) if k > 0]


@dataclass(frozen=True)
class Bar:
    """A stretch as drawn: x and width in SVG units within the plot (after the label column)."""

    lease: int
    kind: str
    token: str
    start: float  # clipped to the period
    end: float
    x: float
    y: float
    w: float
    h: float
    colour: int  # the token's colour class
    open_start: bool  # began before the period (clipped at its left edge)
    open_end: bool  # goes on after the period, or is still running
    label: str  # the token's name when it fits in the bar, else ""


@dataclass(frozen=True)
class Row:
    key: tuple[str, int]  # (server, GPU index)
    label: str
    y: float
    bars: list[Bar] = field(default_factory=list)


@dataclass(frozen=True)
class Tick:
    x: float
    label: str


@dataclass(frozen=True)
class Timeline:
    start: float
    end: float
    width: float
    height: float
    plot_x: float  # where the plot starts (after the labels)
    plot_w: float
    rows: list[Row]
    ticks: list[Tick]
    axis_title: str
    leases: int  # leases drawn
    row_h: float = ROW_H

    @property
    def rows_h(self) -> float:
        """Where the rows end and the axis begins."""
        return len(self.rows) * self.row_h


def token_colour(token: str) -> int:
    """A stable colour class for a token name (the same on every page and every day)."""
    return zlib.crc32(token.encode()) % TOKEN_COLOURS


def row_label(server: str, gpu: int, servers: int) -> str:
    """A row's name: "GPU 0" on one server, "NAME/0" when several servers share the page."""
    return f"{server}/{gpu}" if servers > 1 and server else f"GPU {gpu}"


def timeline(leases: Iterable[LeaseSpan], gpus: Iterable[tuple[str, int]], start: float,
             end: float, now: float, width: float = WIDTH, utc_offset: float = 0.0
             ) -> Timeline:
    """The timeline of [start, end): a row for each of `gpus` (server, index) and for any other
    GPU a lease was on; the leases' stretches clipped to the period. `utc_offset`: seconds
    east of UTC of the times the ticks are labelled in."""
    if not end > start:
        raise ValueError("the timeline's period must end after it starts")
    span = end - start
    plot_x, plot_w = LABEL_W, width - LABEL_W
    keys = set(gpus)
    cut: list[tuple[LeaseSpan, Stretch]] = []
    for lease in leases:
        for s in stretches(lease, now):
            if s.end > start and s.start < end:
                cut.append((lease, s))
                keys.add((lease.server, s.gpu))
    servers = len({server for server, _ in keys})
    rows: dict[tuple[str, int], Row] = {}
    for i, key in enumerate(sorted(keys)):
        rows[key] = Row(key, row_label(key[0], key[1], servers), i * ROW_H)
    drawn: set[int] = set()
    for lease, s in sorted(cut, key=lambda c: (c[1].start, c[0].id)):
        row = rows[(lease.server, s.gpu)]
        lo, hi = max(s.start, start), min(s.end, end)
        x = plot_x + (lo - start) / span * plot_w
        w = max((hi - lo) / span * plot_w, MIN_BAR_W)
        w = min(w, plot_x + plot_w - x)  # a minimum width never pokes past the right edge
        if w < MIN_BAR_W:  # at the right edge: drawn leftwards instead
            x, w = plot_x + plot_w - MIN_BAR_W, MIN_BAR_W
        leased = s.kind == "leased"
        label = lease.token if leased and len(lease.token) * TEXT_W + 8 <= w else ""
        row.bars.append(Bar(
            lease=lease.id, kind=s.kind, token=lease.token, start=lo, end=hi,
            x=round(x, 2), y=row.y + (BAR_Y if leased else STRIP_Y), w=round(w, 2),
            h=BAR_H if leased else STRIP_H, colour=token_colour(lease.token),
            open_start=s.start < start, open_end=s.end > end or (lease.ended is None and
                                                                  s.end >= now),
            label=label))
        drawn.add(lease.id)
    ordered = [rows[k] for k in sorted(rows)]
    return Timeline(start=start, end=end, width=width, height=len(ordered) * ROW_H + AXIS_H,
                    plot_x=plot_x, plot_w=plot_w, rows=ordered,
                    ticks=ticks(start, end, plot_x, plot_w, utc_offset),
                    axis_title=axis_title(span, utc_offset), leases=len(drawn))


def tick_step(span: float) -> int:
    """The tick spacing for a period: the smallest of TICK_STEPS giving at most MAX_TICKS."""
    for step in TICK_STEPS:
        if span / step <= MAX_TICKS:
            return step
    return int(math.ceil(span / MAX_TICKS / 86400.0)) * 86400


def ticks(start: float, end: float, plot_x: float, plot_w: float,
          utc_offset: float = 0.0) -> list[Tick]:
    """Ticks at whole steps of local time (`utc_offset` seconds east of UTC) within the period,
    labelled by `tick_label`; none in the last EDGE_W units, where its label would not fit."""
    span = end - start
    step = tick_step(span)
    first = math.ceil((start + utc_offset) / step) * step - utc_offset
    out = []
    t = first
    while t <= end + 1e-6:
        x = round(plot_x + (t - start) / span * plot_w, 2)
        if x <= plot_x + plot_w - EDGE_W:
            out.append(Tick(x, tick_label(t, step, utc_offset)))
        t += step
    return out


def tick_label(t: float, step: int, utc_offset: float) -> str:
    """A midnight is named by its day ("Mon 06"); other ticks by the hour ("14:30"), with the
    day too when the ticks are a day or more apart, with the seconds when under a minute."""
    local = time.gmtime(t + utc_offset)
    if step < 60:
        return time.strftime("%H:%M:%S", local)
    if local.tm_hour == 0 and local.tm_min == 0:
        return time.strftime("%a %d", local)
    if step < 86400:
        return time.strftime("%H:%M", local)
    return time.strftime("%a %d %H:%M", local)


def axis_title(span: float, utc_offset: float) -> str:
    sign = "+" if utc_offset >= 0 else "-"
    hours, rest = divmod(abs(int(utc_offset)), 3600)
    zone = "UTC" if utc_offset == 0 else f"UTC{sign}{hours:02d}:{rest // 60:02d}"
    return f"time ({zone}); the period is {span_words(span)}"


def span_words(span: float) -> str:
    for size, word in ((7 * 86400, "week"), (86400, "day"), (3600, "hour"), (60, "minute")):
        if abs(span - size) < 1:
            return f"one {word}"
    if span >= 86400:
        return f"{span / 86400:.3g} days"
    if span >= 3600:
        return f"{span / 3600:.3g} hours"
    return f"{span / 60:.3g} minutes"


# --------------------------------------------------------------------- busy vs leased bars
BAR_CHART_ROW_H = 26.0


@dataclass(frozen=True)
class UsageBar:
    """One group (a GPU, a token) of the busy-versus-leased chart: the leased bar with the busy
    bar over it, from the plot's left edge; the figures for its label."""

    key: str
    label: str
    y: float
    leased_w: float
    busy_w: float
    leased_h: float  # hours
    busy_h: float
    leased_share: float  # of the group's capacity (a GPU: its period; a token: the pool's)
    busy_share: float

    @property
    def text(self) -> str:
        return (f"leased {hours_label(self.leased_h)} ({100 * self.leased_share:.0f} %), "
                f"busy {hours_label(self.busy_h)} ({100 * self.busy_share:.0f} %)")


@dataclass(frozen=True)
class UsageChart:
    width: float
    height: float
    plot_x: float
    plot_w: float
    top_h: float  # hours at the right edge
    bars: list[UsageBar]
    ticks: list[Tick]

    @property
    def rows_h(self) -> float:
        return len(self.bars) * BAR_CHART_ROW_H


def nice_top(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is at least `value` (> 0)."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if m * power >= value * (1 - 1e-9):
            return m * power
    return 10.0 * power  # pragma: no cover


def hours_label(h: float) -> str:
    if h == 0:
        return "0"
    if h < 1 / 60:
        return f"{h * 3600:.3g} s"
    if h < 1:
        return f"{h * 60:.3g} min"
    return f"{h:.3g} h"


def usage_chart(groups: Sequence[dict[str, Any]], key: str, top_h: float | None = None,
                labels: dict[str, str] | None = None, percent: bool = False,
                width: float = WIDTH) -> UsageChart:
    """Horizontal bars of the report's groups (pool/report.py: `gpu_hours`, `busy_gpu_hours`,
    `leased_share`, `busy_share`, and `key`'s value as the label), scaled to `top_h` hours at
    the right edge (a GPU chart: the period's length, so a full bar is 100 %), else to a round
    number above the largest group. Ticks at quarters of the scale. `labels`: a group's name
    to show instead of its key ("GPU 0" for "host/0"). `percent`: the ticks say the share of
    `top_h` ("25 %"; the last one with its hours too), for a chart whose full width is 100 %."""
    plot_x, plot_w = LABEL_W, width - LABEL_W - 250.0  # the figures are written to the right
    largest = max((float(g["gpu_hours"]) for g in groups), default=0.0)
    top = top_h if top_h is not None and top_h > 0 else nice_top(largest)
    bars = []
    for i, g in enumerate(groups):
        leased = float(g["gpu_hours"])
        busy = float(g["busy_gpu_hours"])
        bars.append(UsageBar(
            key=str(g[key]), label=(labels or {}).get(str(g[key]), str(g[key])), y=i * BAR_CHART_ROW_H,
            leased_w=round(min(leased / top, 1.0) * plot_w, 2),
            busy_w=round(min(busy / top, 1.0) * plot_w, 2), leased_h=leased, busy_h=busy,
            leased_share=float(g["leased_share"]), busy_share=float(g["busy_share"])))
    axis = [Tick(round(plot_x + q / 4 * plot_w, 2),
                 (f"{25 * q} %" + (f" = {hours_label(top)}" if q == 4 else "")) if percent
                 else hours_label(top * q / 4)) for q in range(5)]
    return UsageChart(width=width, height=len(bars) * BAR_CHART_ROW_H + AXIS_H, plot_x=plot_x,
                      plot_w=plot_w, top_h=top, bars=bars, ticks=axis)
