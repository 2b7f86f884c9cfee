"""bench/pool_day.py (issue 33, item 5): the workload model is seeded and keeps to its stated
bounds, the figures' arithmetic (percentiles, stints, the queue model, held time from a lease's
events, the clients' lines) is right on hand-made cases, and a tiny day replays end to end on
gpupoold with what the clients and the lease history say agreeing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import pool_day as pd  # noqa: E402 - bench/ is not a package


def test_the_same_seed_makes_the_same_day_and_another_seed_another() -> None:
    assert pd.make_day(16, 8, 1) == pd.make_day(16, 8, 1)
    assert pd.make_day(16, 8, 1) != pd.make_day(16, 8, 2)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_day_keeps_to_the_model(seed: int) -> None:
    people, hours = 20, 8
    day = pd.make_day(people, hours, seed)
    roles = pd.roles(people)
    assert len(roles) == people
    assert {k: roles.count(k) for k in pd.KINDS} == {"notebook": 10, "training": 4, "ci": 3,
                                                     "inference": 3}
    by_kind: dict[str, list[pd.Session]] = {k: [] for k in pd.KINDS}
    for s in day:
        assert roles[s.person] == s.kind
        ms = 1e-3 * (2 * len(s.phases) + 1)  # start and stretches are rounded to milliseconds
        assert 0 <= s.start and s.start + s.length <= hours * 3600 + ms
        assert all(b > 0 and i >= 0 for b, i in s.phases) and s.phases[-1][1] == 0
        by_kind[s.kind].append(s)
    for kind, sessions in by_kind.items():
        m = pd.MODEL[kind]
        assert sessions, f"no {kind} session"
        for s in sessions:
            # a busy stretch is within the model's bounds, or cut short by the session's end
            assert all(b <= m["busy_min"][1] * 60 + 1e-3 for b, _ in s.phases)
            if m["length_min"]:  # drawn in the bounds; ends with its last busy stretch
                assert s.length <= m["length_min"][1] * 60 + 2e-3 * len(s.phases)
        share = sum(s.busy for s in sessions) / sum(s.length for s in sessions)
        # busy share of the sessions' time, as the model's busy and idle stretches imply
        low, high = {"notebook": (0.1, 0.4), "training": (0.85, 1.0), "ci": (0.6, 0.95),
                     "inference": (0.01, 0.15)}[kind]
        assert low <= share <= high, (kind, share)
    assert len(by_kind["inference"]) == 3 and all(s.start == 0 for s in by_kind["inference"])


def test_percentile_interpolates_between_ranks() -> None:
    assert pd.percentile([], 95) == 0
    assert pd.percentile([5.0], 50) == 5
    assert pd.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert pd.percentile(list(map(float, range(101))), 95) == 95
    assert pd.percentile([0.0, 10.0], 95) == pytest.approx(9.5)


def session(start: float, *phases: tuple[float, float], person: int = 0) -> pd.Session:
    return pd.Session(person, "notebook", start, tuple(phases))


def test_stints_split_a_session_at_idles_longer_than_the_detach_delay() -> None:
    s = session(0, (10, 5), (20, 100), (30, 0))
    assert pd.stints(s, 0) == [(165, 60, 0, 3)]
    # idle 5 s is kept, idle 100 s ends a stint 50 s into it; the GPU is back 50 s later
    assert pd.stints(s, 50) == [(85, 30, 50, 2), (30, 30, 0, 1)]


def test_the_queue_model_on_hand_made_days() -> None:
    a = session(0, (100, 0), person=0)
    b = session(10, (50, 0), person=1)
    one = pd.simulate([a, b], 1, 0, hours=0)
    assert sorted(one.waits) == [0, 90]  # b waits for a's end
    assert one.leased_s == 150 and one.busy_s == 150 and one.period_s == 150
    two = pd.simulate([a, b], 2, 0, hours=0)
    assert two.waits == [0, 0] and two.period_s == 100
    # a notebook idles 200 s; with detach after 20 s, b gets its GPU at 30 s, and a's next busy
    # stretch at 230 s finds it free again
    nb = session(0, (10, 200), (10, 0), person=0)
    no_detach = pd.simulate([nb, b], 1, 0, hours=0)
    assert sorted(no_detach.waits) == [0, 0, 210]  # a wait per busy stretch: nb's second is 0
    detach = pd.simulate([nb, b], 1, 20, hours=0)
    assert sorted(detach.waits) == [0, 0, 20]
    assert detach.leased_s == 30 + 10 + 50
    assert pd.smallest_pool([nb, b], 0, 0, budget_s=100, most=4) == 2
    assert pd.smallest_pool([nb, b], 20, 0, budget_s=100, most=4) == 1


def test_figures_against_the_baseline() -> None:
    day = [session(0, (30, 30), (40, 0), person=0), session(50, (50, 0), person=1)]
    base = pd.baseline(day, people=2, hours=0.05)  # 180 s
    s = base.summary(2, budget_s=10)
    assert s["busy_util"] == pytest.approx(120 / 360)
    assert s["leased_util"] == pytest.approx(150 / 360)
    assert s["wait_p95_s"] == 0 and s["waits"] == 3 and s["gpus_vs_baseline"] == 1
    pool = pd.Figures("pool", 1, 180, 120, 150, [0, 0, 40])
    p = pool.summary(2, budget_s=10)
    assert p["busy_util"] == pytest.approx(120 / 180)
    assert p["wait_p95_s"] == pytest.approx(36) and not p["within_budget"]
    assert p["gpus_vs_baseline"] is None and pd.ratio_text(p) == "-"  # its people wait
    ok = pool.summary(2, budget_s=60)
    assert ok["within_budget"] and ok["gpus_vs_baseline"] == 2 and pd.ratio_text(ok) == "2.0x"


def test_a_pool_that_missed_the_budget_says_why_it_has_no_ratio() -> None:
    missed = {"config": "pool, idle detach", "gpus": 2, "needed": None, "wait_p95_s": 534.4,
              "gpus_vs_baseline": None}
    met = {"config": "pool, no idle detach", "gpus": 3, "needed": 3, "gpus_vs_baseline": 1.0}
    result = {"args": {"budget_s": 300.0}, "configs": [{"gpus": 3}, met, missed]}
    [note] = pd.notes(result)
    assert note.startswith("pool, idle detach: no ratio ('-'): no replayed pool kept the p95 "
                           "wait within 300 s (the largest, 2 GPUs, waited 534 s)")


def test_the_report_is_checked_against_the_benchmark_within_5_percent() -> None:
    report = {"leased_gpu_hours": 10.4 / 400, "busy_gpu_hours": 4.0 / 400}  # real hours
    a = pd.agreement(10.0, 4.1, report, scale=400)
    assert a["leased"] == {"bench_gpu_h": 10.0, "report_gpu_h": pytest.approx(10.4),
                           "diff_pct": pytest.approx(4.0)}
    assert a["busy"]["diff_pct"] == pytest.approx(-100 * 0.1 / 4.1) and a["ok"]
    assert not pd.agreement(9.8, 4.0, report, scale=400)["ok"]  # leased 6.1 % over
    assert not pd.agreement(10.0, 3.8, report, scale=400)["ok"]  # busy 5.3 % over
    missing = pd.agreement(10.0, 4.0, {"unavailable": "HTTP Error 404"}, scale=400)
    assert missing == {"ok": False, "why": "no report: HTTP Error 404"}
    run = {"gpus": 4, "agreement": pd.agreement(9.8, 4.0, report, scale=400)}
    result = {"configs": [{}, {"config": "pool, idle detach", "runs": [run]}]}
    [bad] = pd.disagreements(result)
    assert bad.startswith("pool, idle detach on 4 GPU(s): leased 10.40 GPU-h reported against "
                          "9.80 measured (+6.1 %)")


def test_held_time_comes_from_the_lease_events() -> None:
    lease = {"id": 1, "started": 100.0, "ended": 200.0, "detached_s": 10.0}
    events = [{"at": 150.0, "state": "attached", "gpu": 1},
              {"at": 120.0, "state": "detached", "gpu": 0},
              {"at": 170.0, "state": "detached", "gpu": 1}]
    # held 100..120, then again 150..170 (the wait for a GPU after the call is not held)
    assert pd.held_intervals(lease, events, until=999) == [(100, 120), (150, 170)]
    running = {"id": 2, "started": 10.0, "ended": None}
    assert pd.held_intervals(running, [], until=25) == [(10, 25)]
    assert pd.leased_from_history([(lease, events), (running, [])], until=25) == 55


def test_client_lines_are_parsed() -> None:
    out = "noise\nphase=0 at=1.5 wait_ms=250.000 busy_ms=1000.000\nphase=2 at=3 wait_ms=0 " \
          "busy_ms=5\n"
    assert pd.parse_client(out) == [(1.5, 0.25, 1.0), (3.0, 0.0, 0.005)]


def test_a_tiny_day_replays_on_gpupoold(native_build: Path, tmp_path: Path) -> None:
    """3 people, a 40-minute day at 600x (4 s a replay), one replay per pool: every client
    finishes, its busy time is the model's, the lease history holds at least the busy time
    and at most the pool's GPU-time, and gpupoold's own report of each replay agrees with the
    benchmark's leased and busy GPU-hours within 5 % (the bench exits 1 otherwise)."""
    out = tmp_path / "day.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "pool_day.py"), "--people", "3", "--hours",
         "0.67", "--scale", "600", "--max-runs", "1", "--seed", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    sessions = [pd.Session(s["person"], s["kind"], s["start"],
                           tuple(map(tuple, s["phases"]))) for s in r["sessions"]]
    assert sessions == pd.make_day(3, 0.67, 4)
    busy_h = sum(s.busy for s in sessions) / 3600
    base, *pools = r["configs"]
    assert base["gpus"] == 3 and base["busy_gpu_h"] == pytest.approx(busy_h)
    assert [p["config"] for p in pools] == ["pool, no idle detach", "pool, idle detach"]
    for p in pools:
        assert len(p["runs"]) == 1
        assert p["waits"] == sum(len(s.phases) for s in sessions)
        assert p["busy_gpu_h"] == pytest.approx(busy_h, rel=0.25)
        assert p["busy_gpu_h"] * 0.9 <= p["leased_gpu_h"] <= p["gpus"] * p["period_s"] / 3600
        assert 0 < p["busy_util"] <= p["leased_util"] * 1.1 <= 1.1
        assert p["leases"] == len(sessions)
        a = p["agreement"]
        assert a["ok"], a
        for what in ("leased", "busy"):
            assert a[what]["bench_gpu_h"] == pytest.approx(p[f"{what}_gpu_h"])
            assert a[what]["report_gpu_h"] == pytest.approx(a[what]["bench_gpu_h"], rel=0.05)
    assert "gpupoold's report against the benchmark" in proc.stdout


def test_gpus_needed_says_when_it_is_only_a_bound() -> None:
    assert pd.needed_text({"gpus": 16}) == "16"  # the baseline: one per person
    assert pd.needed_text({"gpus": 6, "needed": 6, "needed_exact": True}) == "6"
    assert pd.needed_text({"gpus": 9, "needed": 9, "needed_exact": False}) == "<= 9"
    assert pd.needed_text({"gpus": 7, "needed": None, "needed_exact": False}) == "> 7"
