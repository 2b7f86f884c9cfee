"""GPU time accounting and the usage report (issue 33, items 1 and 2): the meter's integration
of sampled series (pool/usage.py), the report's arithmetic (pool/report.py), the store's rows on
SQLite and PostgreSQL with a fleet's servers summed (store/database.py), the recorder that feeds
and flushes it (pool/usage_recorder.py), and `gpupoold report`'s time parsing."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gpupoold.cli import CliError, report_time
from gpupoold.http import api
from gpupoold.http.keys import STORE
from gpupoold.pool.report import (
    LeaseFacts,
    build_report,
    percentile,
    summary_line,
    to_csv,
    to_text,
)
from gpupoold.pool.usage import MINUTE, Observation, UsageDelta, UsageMeter
from gpupoold.pool.usage_recorder import UsageRecorder
from gpupoold.store.database import LeaseFilter, NewLease, Store, StoreDB

T0 = 1_800_000_000.0  # a minute boundary (divisible by 60)


def feed(meter: UsageMeter, gpu: int, series: list[tuple[float, int | None, float]],
         token: str = "alice") -> None:
    """(seconds after T0, lease id or None, utilisation %) observed one after another."""
    for at, lease, util in series:
        meter.observe(T0 + at, gpu, Observation(lease, token if lease else "", util))


# ------------------------------------------------------------------------------ the meter
def test_meter_integrates_leased_and_busy_seconds_per_lease_and_minute() -> None:
    meter = UsageMeter()
    # Lease 7 seen from t=10 to t=130 every 10 s: busy (100 %) for its first 60 s, then idle.
    series: list[tuple[float, int | None, float]] = [(0, None, 0)]
    series += [(t, 7, 100 if t <= 70 else 0) for t in range(10, 131, 10)]
    series += [(140, None, 0)]
    feed(meter, 0, series)
    delta = meter.take()
    assert delta.leases[7].leased_s == pytest.approx(120)
    assert delta.leases[7].busy_s == pytest.approx(60)
    rows = {(r.gpu, r.minute, r.token): (r.leased_s, r.busy_s) for r in delta.minutes}
    assert rows == {(0, T0, "alice"): (pytest.approx(50), pytest.approx(50)),
                    (0, T0 + MINUTE, "alice"): (pytest.approx(60), pytest.approx(10)),
                    (0, T0 + 2 * MINUTE, "alice"): (pytest.approx(10), 0.0)}
    assert meter.take().empty()  # taken once


def test_meter_splits_a_span_at_the_minute_and_weighs_partial_utilisation() -> None:
    meter = UsageMeter()
    feed(meter, 1, [(50, 3, 0), (70, 3, 25)])  # 20 s over a minute boundary at 25 %
    rows = sorted((r.minute, r.leased_s, r.busy_s) for r in meter.take().minutes)
    assert rows == [(T0, pytest.approx(10), pytest.approx(2.5)),
                    (T0 + MINUTE, pytest.approx(10), pytest.approx(2.5))]


def test_meter_credits_nothing_across_a_change_of_lease_or_a_long_gap() -> None:
    meter = UsageMeter()
    feed(meter, 0, [(0, 1, 100), (5, 2, 100), (10, 2, 100), (10 + 3600, 2, 100)])
    delta = meter.take()
    assert 1 not in delta.leases  # one observation only: no span of its own
    assert delta.leases[2].leased_s == pytest.approx(5)  # 5..10; the hour's gap not counted


def test_meter_prefers_a_busy_counter_to_the_sampled_share() -> None:
    meter = UsageMeter()
    for at, busy_ns in ((0, 0), (10, 4 * 10**9), (20, 4 * 10**9), (30, 7 * 10**9)):
        # the sampled share says 100 % throughout: the counter (4 s, 0 s, 3 s busy) wins
        meter.observe(T0 + at, 0, Observation(5, "alice", 100, busy_ns))
    usage = meter.take().leases[5]
    assert (usage.leased_s, usage.busy_s) == (pytest.approx(30), pytest.approx(7))


def test_meter_credits_a_lease_from_its_start_to_its_end() -> None:
    meter = UsageMeter()
    meter.observe(T0, 0, Observation(None, "", 0))
    # began at T0 + 0.4, first seen at T0 + 1 with 0.5 s of work done; counter from zero
    meter.observe(T0 + 1, 0, Observation(9, "alice", 0, 5 * 10**8, started=T0 + 0.4))
    meter.observe(T0 + 2, 0, Observation(9, "alice", 0, 10**9, started=T0 + 0.4))
    meter.ended(T0 + 2.3, 0, 9, 12 * 10**8)  # ended 0.3 s later, its final count
    meter.observe(T0 + 3, 0, Observation(None, "", 0))
    usage = meter.take().leases[9]
    assert (usage.leased_s, usage.busy_s) == (pytest.approx(1.9), pytest.approx(1.2))
    # a lease already there before the last observation (taken over, re-attached) is not
    # credited for the time before it was seen
    meter.observe(T0 + 4, 0, Observation(10, "bob", 100, started=T0 - 100))
    meter.observe(T0 + 5, 0, Observation(10, "bob", 100, started=T0 - 100))
    assert meter.take().leases[10].leased_s == pytest.approx(1)


def test_meter_counts_reuse_while_a_detached_lease_is_away() -> None:
    meter = UsageMeter()
    # lease 1 detached from GPU 0 at t=10; lease 2 holds GPU 0 from t=10 to t=40; lease 1
    # is back (not away any more) from t=30
    meter.observe(T0 + 10, 0, Observation(2, "bob", 0, away=(1,), started=T0 + 10))
    meter.observe(T0 + 20, 0, Observation(2, "bob", 0, away=(1,)))
    meter.observe(T0 + 30, 0, Observation(2, "bob", 0, away=(1,)))
    meter.observe(T0 + 40, 0, Observation(2, "bob", 0))
    delta = meter.take()
    assert delta.leases[1].reused_s == pytest.approx(20) and delta.leases[1].leased_s == 0
    assert delta.leases[2].reused_s == 0 and delta.leases[2].leased_s == pytest.approx(30)
    assert [r.reused_s for r in delta.minutes] == [pytest.approx(20)]


def test_meter_keeps_gpus_apart_and_restores_an_unwritten_delta() -> None:
    meter = UsageMeter()
    feed(meter, 0, [(0, 1, 50), (10, 1, 50)])
    feed(meter, 1, [(0, 2, 0), (10, 2, 0)], token="bob")
    delta = meter.take()
    assert (delta.leases[1].leased_s, delta.leases[1].busy_s) == (10, 5)
    assert (delta.leases[2].leased_s, delta.leases[2].busy_s) == (10, 0)
    meter.restore(delta)
    feed(meter, 0, [(20, 1, 100)])
    again = meter.take()
    assert again.leases[1].leased_s == pytest.approx(20)
    assert again.leases[1].busy_s == pytest.approx(15)


# ----------------------------------------------------------------------------- the report
def minute(server: str, gpu: int, at: float, token: str, leased: float, busy: float,
           reused: float = 0.0) -> dict[str, Any]:
    return {"server": server, "gpu": gpu, "minute": at, "token": token, "leased_s": leased,
            "busy_s": busy, "reused_s": reused}


def test_report_shares_hours_waits_and_detaches() -> None:
    hour = 3600.0
    gpus = [("a", 0), ("a", 1)]  # 2 GPUs over an hour: 2 GPU-hours of capacity
    rows = [minute("a", 0, T0 + 60 * i, "alice", 60, 30) for i in range(30)]  # 30 min, half busy
    # 15 min busy, 10 of them while one of alice's leases that detached from GPU 1 was away
    rows += [minute("a", 1, T0 + 60 * i, "bob", 60, 60, 60 if i < 10 else 0) for i in range(15)]
    leases = [LeaseFacts("alice", "a", 0, w, 1, 900) for w in (1, 2, 3, 4)]
    leases.append(LeaseFacts("bob", "a", 1, 100, 0, 0))
    r = build_report(T0, T0 + hour, "token", gpus, rows, leases)
    assert r["gpus"] == 2
    assert r["leased_gpu_hours"] == pytest.approx(0.75)
    assert r["busy_gpu_hours"] == pytest.approx(0.5)
    assert r["leased_share"] == pytest.approx(0.375)
    assert r["busy_share"] == pytest.approx(0.25)
    assert (r["wait_p50_s"], r["wait_p95_s"]) == (3, 100)
    assert r["detaches"] == 4 and r["detached_gpu_hours"] == pytest.approx(1.0)
    assert r["reused_gpu_hours"] == pytest.approx(10 / 60)
    by_token = {g["token"]: g for g in r["groups"]}
    assert by_token["alice"]["gpu_hours"] == pytest.approx(0.5)
    assert by_token["alice"]["busy_of_leased"] == pytest.approx(0.5)
    assert by_token["alice"]["leased_share"] == pytest.approx(0.25)  # of the whole pool
    assert by_token["bob"]["leases"] == 1 and by_token["alice"]["leases"] == 4
    assert r["summary"] == ("the 2 GPUs were leased 38 % and busy 25 % of the hour; idle detach "
                            "handed on 0.167 GPU-hours (4 detaches, 1 GPU-hours detached); "
                            "median wait 3.0 s (p95 100 s) over 5 leases")
    per_gpu = build_report(T0, T0 + hour, "gpu", gpus, rows, leases)["groups"]
    assert [(g["gpu"], g["leased_share"]) for g in per_gpu] == [("a/0", pytest.approx(0.5)),
                                                                ("a/1", pytest.approx(0.25))]
    assert to_csv(r).splitlines()[0] == ("token,gpu_hours,busy_gpu_hours,leased_share,"
                                         "busy_share,busy_of_leased")
    assert to_csv(r).splitlines()[1] == "alice,0.5,0.25,0.25,0.125,0.5"
    assert "alice" in to_text(r) and r["summary"] in to_text(r)


def test_report_of_a_fleet_sums_servers_and_counts_an_unused_gpu() -> None:
    rows = [minute("a", 0, T0, "t", 60, 60), minute("b", 0, T0, "t", 30, 0)]
    r = build_report(T0, T0 + 60, "server", [("a", 0), ("b", 0), ("b", 1)], rows, [])
    assert r["gpus"] == 3 and r["leased_share"] == pytest.approx(0.5)
    assert {g["server"]: g["leased_share"] for g in r["groups"]} == {
        "a": pytest.approx(1.0), "b": pytest.approx(0.25)}
    assert r["wait_p50_s"] is None and r["summary"].endswith("no lease started")


def test_percentile_and_bad_input() -> None:
    assert percentile([], 50) is None
    assert percentile([5.0], 95) == 5.0
    assert percentile(list(map(float, range(1, 101))), 95) == 95.0
    with pytest.raises(ValueError, match="by must be"):
        build_report(T0, T0 + 1, "team", [], [], [])
    with pytest.raises(ValueError, match="after its start"):
        build_report(T0, T0, "gpu", [], [], [])


def test_report_time_forms() -> None:
    now = T0
    assert report_time("1767225600", now) == 1767225600.0
    assert report_time("7d", now) == now - 7 * 86400
    assert report_time("30m", now) == now - 1800
    assert report_time("2026-01-01", now) == 1767225600.0  # UTC unless it says
    assert report_time("2026-01-01T01:00+01:00", now) == 1767225600.0
    with pytest.raises(CliError, match="not a time"):
        report_time("last week", now)


# ------------------------------------------------------------------------------ the store
def new_lease(token: str, gpu: int = 0) -> NewLease:
    return NewLease(gpu_index=gpu, gpu_uuid="", gpu_name="sim", simulated=True, token_name=token,
                    client_host="h", client_user="u", client_pid=1, program="p", peer="",
                    request="any GPU", queued_s=2.0, started=T0 + 5)


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    return tmp_path / "gpupoold.db" if request.param == "sqlite" else \
        request.getfixturevalue("pg_url")


@pytest.fixture
def two_servers(location: Path | str) -> Iterator[tuple[StoreDB, StoreDB]]:
    a = StoreDB(location, server="a")
    b = StoreDB(location, server="b")
    yield a, b
    a.close()
    b.close()


def test_store_adds_usage_per_minute_and_lease_and_prunes(
        two_servers: tuple[StoreDB, StoreDB]) -> None:
    a, b = two_servers
    la, lb = a.lease_started(new_lease("alice")), b.lease_started(new_lease("bob"))
    for db, lease_id, token in ((a, la, "alice"), (b, lb, "bob")):
        meter = UsageMeter()
        for k in range(2):  # two flushes of the same minute add up: 10..20, 20..30, 30..40
            meter.observe(T0 + 10 + 20 * k, 0, Observation(lease_id, token, 50))
            meter.observe(T0 + 20 + 20 * k, 0, Observation(lease_id, token, 50))
            db.record_usage(meter.take())
    rows = a.usage_minutes(T0, T0 + 60)
    assert [(r["server"], r["token"], r["leased_s"], r["busy_s"]) for r in rows] == [
        ("a", "alice", pytest.approx(30), pytest.approx(15)),
        ("b", "bob", pytest.approx(30), pytest.approx(15))]
    rec = a.get_lease(la)
    assert rec is not None and (rec.leased_s, rec.busy_s) == (pytest.approx(30), pytest.approx(15))
    period = LeaseFilter(since=T0, until=T0 + 60)
    assert [r.token_name for r in b.leases("all", 10, None, period)] == ["bob", "alice"]
    # a fleet's report from either server sums both
    facts = [LeaseFacts(r.token_name, r.server, r.gpu_index, r.queued_s, r.detaches, r.detached_s)
             for r in a.leases("all", 10, None, period)]
    report = build_report(T0, T0 + 60, "server", [("a", 0), ("b", 0)], rows, facts)
    assert report["leased_gpu_hours"] == pytest.approx(60 / 3600)
    assert report["wait_p50_s"] == 2.0
    a.record_usage(UsageDelta(), prune_before=T0 + 60)  # retention: the minute is older
    assert a.usage_minutes(T0, T0 + 60) == []
    rec = a.get_lease(la)
    assert rec is not None and rec.leased_s == pytest.approx(30)  # lease totals stay


# --------------------------------------------------------------------------- the recorder
@dataclass
class FakeLease:
    id: int
    token: str
    started: float = 0.0  # long before the test's observations
    home: FakeGpu | None = None  # the GPU it detached from
    slot: object | None = None  # set for the leases on a GPU (not read there)


@dataclass
class FakeGpu:
    index: int


@dataclass
class FakeSlot:
    lease: FakeLease | None = None


@dataclass
class FakeLeases:
    slots: list[FakeSlot]
    detached: list[FakeLease] = field(default_factory=list)

    def active(self) -> list[FakeLease]:
        return [s.lease for s in self.slots if s.lease is not None] + self.detached


class FakeTelemetry:
    def __init__(self) -> None:
        self.util: dict[int, int | None] = {}

    def live(self, index: int) -> dict[str, Any]:
        return {"gpu_util": self.util.get(index, 0)}


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


async def test_recorder_writes_what_it_sampled_and_a_restart_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "gpupoold.db"
    store = await Store.open(path, server="s")
    lease_id = await store.lease_started(new_lease("alice"))
    leases = FakeLeases([FakeSlot(FakeLease(lease_id, "alice")), FakeSlot()])
    telemetry, clock = FakeTelemetry(), Clock()
    rec = UsageRecorder(store, leases, telemetry, 1.0, 90, clock=clock, flush_s=1e9)
    rec.observe_all()
    for second in range(1, 31):  # 30 s leased: busy for 10, then idle; GPU 1 free, util unknown
        clock.now = T0 + second
        telemetry.util = {0: 100 if second <= 10 else 0, 1: None}
        rec.observe_all()
    await rec.flush()
    await store.close()
    store = await Store.open(path, server="s")  # "the restart": a new store on the same file
    clock.now = T0 + 32  # down for 2 s, which nobody observed
    rec = UsageRecorder(store, leases, telemetry, 1.0, 90, clock=clock, flush_s=1e9)
    rec.observe_all()
    for second in range(33, 43):
        clock.now = T0 + second
        telemetry.util = {0: 100}
        rec.observe_all()
    await rec.flush()
    record = await store.get_lease(lease_id)
    assert record is not None
    assert record.leased_s == pytest.approx(40)  # 30 before, 10 after; the 2 s down not counted
    assert record.busy_s == pytest.approx(20)
    rows = await store.usage_minutes(T0, T0 + 60)
    assert [(r["gpu"], r["leased_s"]) for r in rows] == [(0, pytest.approx(40))]
    await store.close()


async def test_recorder_flushes_on_close_and_prunes_by_retention(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "gpupoold.db", server="s")
    lease_id = await store.lease_started(new_lease("alice"))
    leases = FakeLeases([FakeSlot(FakeLease(lease_id, "alice"))])
    clock = Clock()
    rec = UsageRecorder(store, leases, FakeTelemetry(), 0.01, 1, clock=clock, flush_s=1e9)
    rec.start()
    clock.now = T0 + 30
    await rec.close()  # one last round and a flush
    assert [r["leased_s"] for r in await store.usage_minutes(T0, T0 + 60)] == [pytest.approx(30)]
    clock.now = T0 + 2 * 86400  # two days later, one day of retention
    leases.slots[0].lease = None
    rec.meter.observe(clock.now, 0, Observation(lease_id, "alice", 0))
    rec.meter.observe(clock.now + 1, 0, Observation(lease_id, "alice", 0))
    await rec.flush()
    assert await store.usage_minutes(T0, T0 + 60) == []
    await store.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_recorder_stores_the_reuse_of_a_detached_leases_gpu(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    location = tmp_path / "gpupoold.db" if backend == "sqlite" else \
        request.getfixturevalue("pg_url")
    store = await Store.open(location, server="s", state_dir=tmp_path)
    away_id = await store.lease_started(new_lease("alice"))
    holder_id = await store.lease_started(new_lease("bob"))
    away = FakeLease(away_id, "alice", home=FakeGpu(0))
    leases = FakeLeases([FakeSlot(FakeLease(holder_id, "bob")), FakeSlot()], detached=[away])
    clock = Clock()
    rec = UsageRecorder(store, leases, FakeTelemetry(), 1.0, 90, clock=clock, flush_s=1e9)
    for second in range(0, 13):
        clock.now = T0 + second
        if second == 8:
            leases.detached = []  # back on a GPU (or ended): no longer away
        rec.observe_all()
    await rec.flush()
    away_rec, holder_rec = await store.get_lease(away_id), await store.get_lease(holder_id)
    assert away_rec is not None and holder_rec is not None
    assert (away_rec.leased_s, away_rec.reused_s) == (0, pytest.approx(7))  # 0..7 s
    assert (holder_rec.leased_s, holder_rec.reused_s) == (pytest.approx(12), 0)
    [row] = await store.usage_minutes(T0, T0 + 60)
    assert (row["token"], row["leased_s"], row["reused_s"]) == ("bob", pytest.approx(12),
                                                                 pytest.approx(7))
    await store.close()


def test_usage_gpus_are_the_fleet_tables(two_servers: tuple[StoreDB, StoreDB]) -> None:
    """A shared store's report counts every server's GPUs (the fleet table, store/fleet.py)."""
    a, b = two_servers
    assert a.usage_gpus() == []
    for db, gpus in ((a, 2), (b, 1)):
        with db._write() as conn:
            for index in range(gpus):
                conn.execute("INSERT INTO fleet_gpus (server, gpu_index, state, updated) "
                             "VALUES (?, ?, 'free', 0)", (db.server, index))
    assert b.usage_gpus() == [("a", 0), ("a", 1), ("b", 0)]


async def test_the_api_report_of_a_shared_store_sums_its_servers(pg_url: str,
                                                                 tmp_path: Path) -> None:
    """GET /api/v1/report on a PostgreSQL store shared by servers a and b: every server's GPUs
    and minute rows, whichever server answers (the route's handler alone, without the auth)."""
    other = StoreDB(pg_url, server="b")
    store = await Store.open(pg_url, server="a", state_dir=tmp_path)
    try:
        for db_server, gpus in (("a", 2), ("b", 2)):
            with other._write() as conn:
                for index in range(gpus):
                    conn.execute("INSERT INTO fleet_gpus (server, gpu_index, state, updated) "
                                 "VALUES (?, ?, 'free', 0)", (db_server, index))
        for db, lease_token in ((other, "bob"), (None, "alice")):
            meter = UsageMeter()
            meter.observe(T0, 0, Observation(1, lease_token, 100))
            meter.observe(T0 + 30, 0, Observation(1, lease_token, 100))
            if db is None:
                await store.record_usage(meter.take())
            else:
                db.record_usage(meter.take())
        app = web.Application()
        app[STORE] = store
        app.router.add_get("/api/v1/report", api.report)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get(f"/api/v1/report?from={T0:.0f}&to={T0 + 60:.0f}&by=server")
            assert resp.status == 200, await resp.text()
            report = (await resp.json())["report"]
        assert report["gpus"] == 4
        assert report["leased_gpu_hours"] * 3600 == pytest.approx(60)
        assert report["leased_share"] == pytest.approx(60 / 240)
        assert {g["server"]: g["leased_share"] for g in report["groups"]} == {
            "a": pytest.approx(0.25), "b": pytest.approx(0.25)}
    finally:
        await store.close()
        other.close()


def test_summary_names_a_period_in_words() -> None:
    base = {"gpus": 2, "leased_share": 0.5, "busy_share": 0.25, "reused_gpu_hours": 0.0,
            "detaches": 0, "detached_gpu_hours": 0.0, "wait_p50_s": None, "from": T0}
    assert "of the minute;" in summary_line({**base, "to": T0 + 60})
    assert "of the 2 minutes;" in summary_line({**base, "to": T0 + 120})
    assert "of the hour;" in summary_line({**base, "to": T0 + 3600})
    assert "of the 1.5 days;" in summary_line({**base, "to": T0 + 1.5 * 86400})
