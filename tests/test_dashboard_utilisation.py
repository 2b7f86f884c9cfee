"""The dashboard's Utilisation page (issue 33, item 3): the geometry of its lease timeline and
busy-versus-leased charts (gpupoold/dashboard/timeline.py) from made-up leases, its period
parameters, and the page over HTTP in process (who sees which token's figures). The page in
headless Chromium with real leases: tests/test_dashboard_browser.py.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gpupool_protocol as gp
import pytest
from browser import BrowserError, Chromium, Page
from conftest import require, wait_until
from test_daemon import RawClient, hello
from test_dashboard import Ui, make_ui  # noqa: F401  (a fixture)
from test_dashboard_browser import artifacts, chromium, login  # noqa: F401  (fixtures)
from test_e2e_detach import detach_server, finish
from test_e2e_leases import MIB, hold_gpu, start_client  # noqa: F401  (a fixture)
from test_e2e_usage import CLIENT as BUSY_CLIENT
from test_e2e_usage import have_cuda_python

from gpupoold.dashboard import utilisation
from gpupoold.dashboard.payload import axis_start
from gpupoold.dashboard.sessions import Session, Viewer
from gpupoold.dashboard.timeline import (
    BAR_H,
    LABEL_W,
    MIN_BAR_W,
    ROW_H,
    STRIP_Y,
    LeaseEvent,
    LeaseSpan,
    Stretch,
    nice_top,
    stretches,
    tick_step,
    ticks,
    timeline,
    token_colour,
    usage_chart,
)
from gpupoold.dashboard.utilisation import MAX_SPAN_S, choose_period, links, token_groups
from gpupoold.http.keys import STORE
from gpupoold.pool.usage import MinuteUsage, UsageDelta

T0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC, a Thursday
PLOT_W = 1000.0 - LABEL_W


def lease(id: int, gpu: int, started: float, ended: float | None, token: str = "alice",
          events: tuple[LeaseEvent, ...] = (), server: str = "s") -> LeaseSpan:
    return LeaseSpan(id=id, server=server, gpu=gpu, token=token, started=started, ended=ended,
                     events=events)


def x_of(t: float, start: float, span: float) -> float:
    return LABEL_W + (t - start) / span * PLOT_W


# ---------------------------------------------------------------------------- the stretches
def test_a_lease_that_detached_and_came_back_on_another_gpu_is_cut_at_its_events() -> None:
    got = stretches(lease(1, 0, T0, T0 + 100, events=(
        LeaseEvent(T0 + 60, "attached", 1),  # listed first, happened last: sorted by time
        LeaseEvent(T0 + 20, "detached", 0))), now=T0 + 1000)
    assert got == [Stretch("leased", 0, T0, T0 + 20), Stretch("detached", 0, T0 + 20, T0 + 60),
                   Stretch("leased", 1, T0 + 60, T0 + 100)]


def test_an_open_lease_runs_to_now_and_one_ended_while_detached_ends_detached() -> None:
    assert stretches(lease(1, 2, T0, None), now=T0 + 50) == [Stretch("leased", 2, T0, T0 + 50)]
    got = stretches(lease(2, 0, T0, T0 + 30, events=(LeaseEvent(T0 + 10, "detached", 0),
                                                     LeaseEvent(T0 + 12, "detached", 0))),
                    now=T0 + 99)
    assert got == [Stretch("leased", 0, T0, T0 + 10), Stretch("detached", 0, T0 + 10, T0 + 30)]


def test_a_lease_of_several_gpus_is_drawn_on_each_gpu_it_holds_across_its_detaches() -> None:
    """Issue 37: a lease of GPUs 2 and 0 has a span per device; its events name every GPU it
    left and came back on (schema v15), so each device's span follows its own GPU: back on GPUs
    1 and 2, device 1 is drawn on GPU 2. Events written before v15 name device 0's GPU only:
    device 1's span ends at the first detach then (where it went is not known)."""
    rec = SimpleNamespace(id=7, server="", gpu_index=2, token_name="alice", started=T0,
                          ended=T0 + 100, gpus=(2, 0))
    plain = utilisation.lease_spans(rec, "s", [])  # type: ignore[arg-type]
    assert [(s.gpu, s.started, s.ended) for s in plain] == [(2, T0, T0 + 100), (0, T0, T0 + 100)]
    events = [{"at": T0 + 40, "state": "detached", "gpu": 2, "gpus": [2, 0]},
              {"at": T0 + 60, "state": "attached", "gpu": 1, "gpus": [1, 2]}]
    spans = utilisation.lease_spans(rec, "s", events)  # type: ignore[arg-type]
    assert [stretches(s, now=T0 + 200) for s in spans] == [
        [Stretch("leased", 2, T0, T0 + 40), Stretch("detached", 2, T0 + 40, T0 + 60),
         Stretch("leased", 1, T0 + 60, T0 + 100)],
        [Stretch("leased", 0, T0, T0 + 40), Stretch("detached", 0, T0 + 40, T0 + 60),
         Stretch("leased", 2, T0 + 60, T0 + 100)]]
    tl = timeline(spans, [("s", 0), ("s", 1), ("s", 2)], T0, T0 + 100, now=T0 + 200)
    assert [[(b.kind, b.start) for b in r.bars if b.kind == "leased"] for r in tl.rows] == [
        [("leased", T0)], [("leased", T0 + 60)], [("leased", T0), ("leased", T0 + 60)]]
    before_v15 = [{k: v for k, v in e.items() if k != "gpus"} for e in events]
    cut = utilisation.lease_spans(rec, "s", before_v15)  # type: ignore[arg-type]
    assert [(s.gpu, s.ended) for s in cut] == [(2, T0 + 100), (0, T0 + 40)]
    assert stretches(cut[0], now=T0 + 200)[-1] == Stretch("leased", 1, T0 + 60, T0 + 100)
    assert stretches(cut[1], now=T0 + 200) == [Stretch("leased", 0, T0, T0 + 40)]
    one = SimpleNamespace(id=8, server="", gpu_index=1, token_name="bob", started=T0,
                          ended=None, gpus=())
    assert [s.gpu for s in utilisation.lease_spans(one, "s", [])] == [1]  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ the timeline
def test_bars_sit_on_their_gpu_rows_at_their_times_clipped_at_the_period_edges() -> None:
    start, end = T0, T0 + 3600
    leases = [
        lease(1, 0, T0 - 600, T0 + 900),  # began before the period
        lease(2, 1, T0 + 1800, T0 + 2700, token="bob"),
        lease(3, 0, T0 + 3000, None),  # still running at now, inside the period
        lease(4, 1, T0 + 3300, T0 + 4000, token="bob"),  # ends after the period
        lease(5, 1, T0 - 900, T0 - 10),  # ended before the period: not drawn
    ]
    tl = timeline(leases, [("s", 0), ("s", 1), ("s", 2)], start, end, now=T0 + 3500)
    assert [r.label for r in tl.rows] == ["GPU 0", "GPU 1", "GPU 2"]  # one server: no names
    assert [r.y for r in tl.rows] == [0, ROW_H, 2 * ROW_H]
    assert tl.leases == 4
    bars = {b.lease: b for r in tl.rows for b in r.bars}
    assert set(bars) == {1, 2, 3, 4}
    assert [b.lease for b in tl.rows[0].bars] == [1, 3] and [b.lease for b in tl.rows[1].bars] \
        == [2, 4] and tl.rows[2].bars == []  # the free GPU's row is empty
    b1, b2, b3, b4 = bars[1], bars[2], bars[3], bars[4]
    assert (b1.x, b1.start, b1.open_start, b1.open_end) == (LABEL_W, start, True, False)
    assert b1.w == pytest.approx(900 / 3600 * PLOT_W, abs=0.01)
    assert b2.x == pytest.approx(x_of(T0 + 1800, start, 3600), abs=0.01)
    assert b2.w == pytest.approx(PLOT_W / 4, abs=0.01) and not (b2.open_start or b2.open_end)
    assert b2.y == ROW_H + 3 and b2.h == BAR_H
    assert b3.end == T0 + 3500 and b3.open_end  # drawn up to now, marked as going on
    assert b4.end == end and b4.open_end
    assert b4.x + b4.w == pytest.approx(LABEL_W + PLOT_W, abs=0.01)
    assert b2.token == "bob" and b2.label == "bob"  # a quarter of the plot: the name fits
    assert b2.colour == b4.colour == token_colour("bob")


def test_a_detached_stretch_is_a_strip_on_the_gpu_it_left_under_another_lease() -> None:
    start, end = T0, T0 + 600
    a = lease(1, 0, T0 + 10, T0 + 400, events=(LeaseEvent(T0 + 100, "detached", 0),
                                                LeaseEvent(T0 + 300, "attached", 1)))
    b = lease(2, 0, T0 + 150, T0 + 250, token="bob")  # took GPU 0 while 1 was away
    tl = timeline([a, b], [("s", 0), ("s", 1)], start, end, now=T0 + 600)
    row0 = [(x.lease, x.kind) for x in tl.rows[0].bars]
    assert row0 == [(1, "leased"), (1, "detached"), (2, "leased")]
    assert [(x.lease, x.kind) for x in tl.rows[1].bars] == [(1, "leased")]
    detached = tl.rows[0].bars[1]
    assert detached.y == STRIP_Y and detached.label == ""  # under the bars, unlabelled
    assert detached.x == pytest.approx(x_of(T0 + 100, start, 600), abs=0.01)
    assert detached.w == pytest.approx(200 / 600 * PLOT_W, abs=0.01)
    assert tl.leases == 2


def test_a_lease_of_seconds_in_a_week_stays_visible_and_inside_the_plot() -> None:
    start, end = T0, T0 + 7 * 86400
    tl = timeline([lease(1, 0, T0 + 86400, T0 + 86403), lease(2, 0, end - 1, end + 5)],
                  [("s", 0)], start, end, now=end)
    first, last = tl.rows[0].bars
    assert first.w == MIN_BAR_W and first.x == pytest.approx(x_of(T0 + 86400, start, end - start),
                                                            abs=0.01)
    assert last.w == MIN_BAR_W and last.x + last.w == pytest.approx(LABEL_W + PLOT_W, abs=0.01)


def test_rows_of_several_servers_are_named_and_a_gpu_only_in_the_leases_gets_one() -> None:
    tl = timeline([lease(1, 3, T0, T0 + 10, server="b")], [("a", 0)], T0, T0 + 60, now=T0 + 60)
    assert [(r.key, r.label) for r in tl.rows] == [(("a", 0), "a/0"), (("b", 3), "b/3")]
    with pytest.raises(ValueError):
        timeline([], [("a", 0)], T0, T0, now=T0)


def test_ticks_fall_on_whole_local_steps_with_labels_in_words() -> None:
    assert tick_step(3600) == 300 and tick_step(86400) == 7200 and tick_step(7 * 86400) == 86400
    day = ticks(T0 + 30, T0 + 30 + 86400, LABEL_W, PLOT_W)
    assert [t.label for t in day[:3]] == ["02:00", "04:00", "06:00"]
    assert day[-1].label == "22:00" and len(day) == 11  # midnight is 30 s from the edge: none
    across = [t.label for t in ticks(T0 - 43200, T0 + 43200, LABEL_W, PLOT_W)]
    assert across[:2] == ["12:00", "14:00"] and "Thu 01" in across  # a midnight: its day
    assert day[0].x == pytest.approx(x_of(T0 + 7200, T0 + 30, 86400), abs=0.01)
    # Two hours east of UTC: the local midnight is 22:00 UTC the day before.
    week = ticks(T0, T0 + 7 * 86400, LABEL_W, PLOT_W, utc_offset=7200)
    assert week[0].label == "Fri 02" and week[0].x == pytest.approx(
        x_of(T0 + 86400 - 7200, T0, 7 * 86400), abs=0.01)
    assert len(week) == 6  # the seventh, 2 h before the end, would be cut off
    minute = ticks(T0, T0 + 60, LABEL_W, PLOT_W)  # a minute: every 5 s, with the seconds
    assert [t.label for t in minute[:2]] == ["00:00:00", "00:00:05"]
    assert minute[-1].label == "00:00:55" and len(minute) == 12  # none at the edge: cut off
    tl = timeline([], [("s", 0)], T0, T0 + 3600, now=T0, utc_offset=-5 * 3600)
    assert tl.axis_title == "time (UTC-05:00); the period is one hour"
    assert [t.label for t in tl.ticks][:2] == ["19:00", "19:05"]


# ------------------------------------------------------------------- busy versus leased bars
def test_usage_bars_scale_to_the_period_or_to_a_round_number() -> None:
    groups = [{"gpu": "s/0", "gpu_hours": 12.0, "busy_gpu_hours": 3.0, "leased_share": 0.5,
               "busy_share": 0.125},
              {"gpu": "s/1", "gpu_hours": 0.0, "busy_gpu_hours": 0.0, "leased_share": 0.0,
               "busy_share": 0.0}]
    chart = usage_chart(groups, "gpu", top_h=24.0, labels={"s/0": "GPU 0"}, percent=True)
    a, b = chart.bars
    assert a.label == "GPU 0" and b.label == "s/1"
    assert a.leased_w == pytest.approx(chart.plot_w / 2) and a.busy_w == pytest.approx(
        chart.plot_w / 8)
    assert b.leased_w == 0 and b.busy_w == 0
    assert a.text == "leased 12 h (50 %), busy 3 h (12 %)"
    assert [t.label for t in chart.ticks] == ["0 %", "25 %", "50 %", "75 %", "100 % = 24 h"]
    tokens = usage_chart([{"token": "alice", "gpu_hours": 0.3, "busy_gpu_hours": 0.1,
                           "leased_share": 0.01, "busy_share": 0.0}], "token")
    assert tokens.top_h == 0.5 and tokens.bars[0].leased_w == pytest.approx(
        0.6 * tokens.plot_w)
    assert [t.label for t in tokens.ticks] == ["0", "7.5 min", "15 min", "22.5 min", "30 min"]
    assert [nice_top(v) for v in (0.0, 0.3, 1.0, 1.1, 2.2, 7, 130)] == [1, 0.5, 1, 2, 2.5, 10,
                                                                        200]


# ---------------------------------------------------------------------- period and who sees
def period_of(query: dict[str, str], now: float) -> tuple[float, float, str | None]:
    p = choose_period(query, now)
    return p.start, p.end, p.preset


def test_the_period_parameters_and_the_links_around_them() -> None:
    now = T0 + 10 * 86400
    assert period_of({}, now) == (now - 86400, now, "day")
    assert period_of({"range": "week"}, now) == (now - 7 * 86400, now, "week")
    got = choose_period({"from": str(T0), "to": str(T0 + 7200)}, now)
    assert (got.start, got.end, got.preset, got.problem) == (T0, T0 + 7200, None, "")
    assert period_of({"to": str(T0 + 7200), "range": "hour"}, now) == (T0 + 3600, T0 + 7200,
                                                                        None)
    for query, words in (({"range": "year"}, "unknown range 'year'"),
                         ({"from": "yesterday"}, "from must be a time in Unix seconds"),
                         ({"from": str(T0), "to": str(T0 + 5)}, "at least a minute"),
                         ({"from": str(T0), "to": str(T0 + MAX_SPAN_S + 1)}, "at most 31 days")):
        p = choose_period(query, now)
        assert words in p.problem and (p.start, p.end) == (now - 86400, now), query
    p = choose_period({"from": str(T0), "to": str(T0 + 7200)}, now)
    got_links = links(p, now)
    assert got_links["earlier"] == f"/ui/utilisation?from={T0 - 7200:.0f}&to={T0:.0f}"
    assert got_links["later"] == f"/ui/utilisation?from={T0 + 7200:.0f}&to={T0 + 14400:.0f}"
    assert got_links["zoom_in"] == f"/ui/utilisation?from={T0 + 1800:.0f}&to={T0 + 5400:.0f}"
    assert got_links["zoom_out"] == f"/ui/utilisation?from={T0 - 3600:.0f}&to={T0 + 10800:.0f}"
    assert "later" not in links(choose_period({}, now), now)  # it ends now


def record(id: int, started: float, ended: float | None, detaches: int = 0,
           token: str = "alice") -> Any:
    return SimpleNamespace(id=id, server="s", gpu_index=0, token_name=token, started=started,
                           ended=ended, queued_s=0.5 * id, detaches=detaches,
                           detached_s=10.0 * detaches, gpus=())


def test_the_page_draws_the_latest_leases_and_says_what_it_left_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(utilisation, "DRAWN_LEASES", 2)
    period = choose_period({"from": str(T0), "to": str(T0 + 3600)}, T0 + 7200)
    records = [record(3, T0 + 600, None, detaches=1), record(2, T0 + 300, T0 + 400, detaches=1),
               record(1, T0 - 60, T0 + 60)]  # newest first, as the store lists them
    events = {3: [{"at": T0 + 700, "state": "detached", "gpu": 0}]}  # lease 2's were not read
    admin = Viewer(Session("s", "t", "root", "admin", "c", 0.0), "root", "admin")
    got = utilisation.draw(period, T0 + 7200, [("s", 0)], [], records, events, "s", admin)
    assert got["skipped"] == 1 and got["unevented"] == 1
    assert [(b.lease, b.kind) for b in got["timeline"].rows[0].bars] == [
        (2, "leased"), (3, "leased"), (3, "detached")]
    # The report counts the leases that started in the period, drawn or not.
    assert got["report"]["leases"] == 2 and got["report"]["wait_p50_s"] == 1.0
    anonymous = utilisation.draw(period, T0 + 7200, [("s", 0)], [], records, events, "s",
                                 Viewer(None, "anonymous", "anonymous"))
    assert anonymous["token_chart"] is None and not anonymous["tokens_shown"]


def test_the_overview_charts_time_axis_starts_where_the_history_does() -> None:
    assert [axis_start(s) for s in (3600.0, 600.0, 20.0)] == ["−60 min", "−10 min", "−1 min"]


def test_per_token_figures_are_an_admins_and_a_users_own() -> None:
    groups = [{"token": "alice"}, {"token": "bob"}]
    session = Session("sid", "tok", "alice", "user", "csrf", 0.0)
    assert token_groups(groups, Viewer(Session("s", "t", "root", "admin", "c", 0.0), "root",
                                       "admin")) == groups
    assert token_groups(groups, Viewer(None, "anonymous", "admin-auto")) == groups
    assert token_groups(groups, Viewer(session, "alice", "user")) == [{"token": "alice"}]
    assert token_groups(groups, Viewer(None, "anonymous", "anonymous")) is None


# -------------------------------------------------------------------------- over HTTP
LEASE_RECT = re.compile(r'<rect class="lease (\w+)[^"]*" data-lease="(\d+)" data-kind="\w+" '
                        r'data-token="([^"]*)"')


async def test_the_page_draws_the_stored_leases_and_shows_token_figures_by_role(
        make_ui: Callable[..., AsyncIterator[Ui]]) -> None:  # noqa: F811
    async for ui in make_ui(http_anonymous_read=True):
        raw = await RawClient.connect(ui.d.address)
        assert (await raw.hello(hello(token=ui.user))).result == 0
        await raw.send(gp.encode_frame(gp.MemAlloc(size=1 << 20, stream=0, flags=0), 8))
        frame = await raw.recv()
        while frame.op != gp.MemAlloc.OP:
            frame = await raw.recv()
        await raw.close()
        store = ui.d.app[STORE]
        deadline = time.monotonic() + 15
        while (await store.leases("active", 10)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        (record,) = await store.leases("all", 10)
        # Usage rows of two tokens in the last hour (the fake worker's lease of a moment
        # makes none worth drawing): 30 s leased and 12 s busy of alice's, 18 s of bob's.
        minute = (time.time() // 60 - 2) * 60
        await store.record_usage(UsageDelta(minutes=[
            MinuteUsage(0, minute, "alice", leased_s=30.0, busy_s=12.0),
            MinuteUsage(0, minute + 60, "bob", leased_s=18.0, busy_s=0.0)]))

        anonymous = await ui.page("/ui/utilisation?range=hour")
        rows = re.findall(r'<g class="gpu-row" data-server="[^"]*" data-gpu="(\d+)">', anonymous)
        assert rows == ["0"], rows
        assert ("leased", str(record.id), "alice") in LEASE_RECT.findall(anonymous)
        assert 'aria-current="page">Utilisation' in anonymous
        assert "were leased" in anonymous and 'data-chart="gpu"' in anonymous
        assert 'data-chart="token"' not in anonymous and 'id="token-chart-none"' in anonymous
        # the period's figures for GPU 0: 48 s leased of the hour, 12 s busy
        assert "leased 48 s (1 %), busy 12 s (0 %)" in anonymous

        await ui.login(ui.user)
        mine = await ui.page("/ui/utilisation")
        assert 'data-chart="token"' in mine and '<g class="usage-row" data-key="alice">' in mine
        assert "your token only" in mine and 'data-key="bob"' not in mine
        assert "leased 30 s (0 %), busy 12 s (0 %)" in mine  # of the pool's day
        await ui.login(ui.admin)
        admin = await ui.page("/ui/utilisation?range=hour")
        assert '<g class="usage-row" data-key="alice">' in admin and "your token" not in admin
        assert '<g class="usage-row" data-key="bob">' in admin
        zoomed = await ui.page(f"/ui/utilisation?from={record.started - 60:.0f}"
                               f"&to={record.started + 60:.0f}")
        assert ("leased", str(record.id), "alice") in LEASE_RECT.findall(zoomed)
        # The overview's small charts have their axes: values at the top and bottom, times under.
        overview = await ui.page("/ui/")
        assert overview.count('<span class="y-top">100 %</span>') == 2  # utilisation, last day
        assert re.search(r'<span data-axis="start">−\d+ min</span><span>now</span>', overview)
        assert '<span class="y-top" data-axis="copy-top">' in overview and "−24 h" in overview
        wrong = await ui.page("/ui/utilisation?range=fortnight")
        assert "unknown range &#39;fortnight&#39;" in wrong


# ------------------------------------------------------------------ in headless Chromium
def rows_of(page: Page, lease_id: int, kind: str) -> list[str]:
    """The GPU rows (data-gpu) holding a drawn stretch of `kind` of the lease."""
    return list(page.evaluate(
        f"[...document.querySelectorAll('#lease-timeline rect[data-lease=\"{lease_id}\"]"
        f"[data-kind=\"{kind}\"]')].map(r => r.closest('g.gpu-row').dataset.gpu)"))


def test_the_utilisation_page_in_chromium_shows_the_leases_the_test_made(
        start_daemon: Any, native_build: Path, hold_gpu: Path, tmp_path: Path,  # noqa: F811
        chromium: Chromium, artifacts: Path) -> None:  # noqa: F811
    """Three leases on two simulated GPUs with idle detach on: two tenants hold a GPU each and
    idle; a third client arrives, so one of them detaches and the third keeps its GPU busy; then
    the detached one comes back. The Utilisation page draws each lease on the GPU row its record and
    events say, and the detached stretch on the GPU that lease left."""
    require(have_cuda_python(),
            "cuda-bindings is not installed (it comes with PyTorch: scripts/bootstrap.sh)")
    server = detach_server(start_daemon, native_build, tmp_path, gpus=2)
    bob = server.create_token("bob")
    first = start_client(server, hold_gpu, 8 * MIB, 3500, seed=1)
    other = start_client(server, hold_gpu, 8 * MIB, 3000, seed=2, env={"GPUPOOL_TOKEN": bob})
    procs = [first, other]
    try:
        for p in procs:
            assert p.stdout is not None and "holding" in p.stdout.readline()
        # The late client keeps its GPU busy for 1.5 s (the simulated device's spinning kernel).
        late = subprocess.Popen([sys.executable, str(BUSY_CLIENT), "1500"],
                                env=server.client_env({"GPUPOOL_TOKEN": bob}),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(late)
        for p, what in zip(procs[:2], ("the first tenant", "bob's tenant")):
            assert finish(p, what)["exact"] == "1"
        out, err = late.communicate(timeout=120)
        assert late.returncode == 0 and "busy_s=1.500" in out, f"{out}\n{err}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    wait_until("three lease records ended",
               lambda: len(server.get_json("/api/v1/leases?state=ended")["leases"]) == 3,
               timeout=20)
    records = [server.get_json(f"/api/v1/leases/{r['id']}")
               for r in server.get_json("/api/v1/leases?state=ended")["leases"]]
    detached = [r for r in records if r["detaches"] >= 1]
    assert detached, f"no lease detached: {records}"

    page = chromium.new_page(1200, 800)
    try:
        login(page, server, server.admin_token)
        page.goto(server.http_url + "/ui/utilisation?range=hour")
        page.wait_for("!!document.querySelector('#lease-timeline g.gpu-row')",
                      what="the lease timeline")
        rows = page.evaluate("[...document.querySelectorAll('#lease-timeline g.gpu-row')]"
                             ".map(g => g.dataset.gpu)")
        assert rows == ["0", "1"], rows
        for r in records:
            # Where it held a GPU: its first GPU, and every GPU it attached to again.
            held = {str(r["gpu_index"])} | {str(e["gpu"]) for e in r["events"]
                                              if e["state"] == "attached"}
            assert set(rows_of(page, r["id"], "leased")) == held, (r, held)
            left = {str(e["gpu"]) for e in r["events"] if e["state"] == "detached"}
            assert set(rows_of(page, r["id"], "detached")) == left, (r, left)
        # bob's busy time is in the per-token chart: a busy bar of some width.
        busy = page.evaluate("document.querySelector('svg[data-chart=\"token\"] "
                             "g.usage-row[data-key=\"bob\"] rect.busy').getAttribute('width')")
        assert float(busy) > 0, busy
        summary = page.evaluate("document.getElementById('utilisation-summary').innerText")
        assert "The 2 GPUs were leased" in summary and "3 leases" in summary, summary
        page.screenshot(artifacts / "utilisation-hour.png")
        # Zoomed to the minute of the leases: bars wide enough to see (the docs' image).
        began = min(r["started"] for r in records)
        page.goto(server.http_url + f"/ui/utilisation?from={began - 5:.0f}&to={began + 55:.0f}")
        page.wait_for("!!document.querySelector('#lease-timeline rect.detached')",
                      what="the detached stretch in the zoomed timeline")
        titles = page.evaluate("[...document.querySelectorAll('#lease-timeline rect.lease title')]"
                               ".map(t => t.textContent)")
        for r in records:
            assert any(t.startswith(f"lease {r['id']}, {r['token_name']}: held this GPU")
                       for t in titles), (r["id"], titles)
        page.screenshot(artifacts / "utilisation.png")
        # On a phone the drawings scroll inside their frames; the page does not scroll sideways.
        page.viewport(390, 844, 2, mobile=True)
        width = page.evaluate("document.documentElement.scrollWidth")
        page.screenshot(artifacts / "utilisation-phone.png")
        assert width <= 390, f"the Utilisation page is {width} px wide on a 390 px phone screen"
    except (AssertionError, BrowserError):
        try:
            page.screenshot(artifacts / "utilisation-failure.png")
            (artifacts / "utilisation-failure.html").write_text(page.html())
        except BrowserError:
            pass
        raise
