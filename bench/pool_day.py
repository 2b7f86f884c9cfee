#!/usr/bin/env python3
"""A replayed day: what pooling and idle detach gain against one GPU per person (issue 33, item 5;
docs/benchmarks.md, "Replayed day").

    python bench/pool_day.py [--quick] [--people 16] [--hours 8] [--scale 400] [--seed 1]
                             [--budget-s 300] [--detach-after-s 120] [--max-runs 2]
                             [--json PATH] [--markdown PATH]

1. A seeded workload model of a team (make_day): notebooks (bursts of work, long idle), training
   jobs of hours, CI jobs of minutes, inference services. Every number in it is an assumption,
   stated in MODEL below and in docs/benchmarks.md.
2. The baseline, one GPU per person, is computed: each person's sessions on their own GPU, no
   waits; its GPUs are the people.
3. Two pools are replayed for real: gpupoold on K simulated GPUs whose kernels take real time
   (gp_test_spin), each session a process (bench/pool_day_client.cu through the shim) that runs
   its busy/idle phases at the time-scale (--scale simulated seconds per real second, 400: an hour
   in 9 s): a pool without idle detach (idle_detach_after = 0) and one with it (--detach-after-s
   simulated seconds, the default policy when-queued). The pool size: the smallest K whose p95
   wait stays within --budget-s, searched cheaply: a queue simulation of the same day (simulate)
   proposes K, the replay checks it and then K-1 (or K+1 when K missed), at most --max-runs
   replays per pool.
4. Figures (all in simulated time): GPUs needed, busy utilisation (busy GPU-time over the pool's
   GPU-time for the day), leased utilisation, waits p50/p95, and the ratio of GPUs to the
   baseline (blank, '-', for a pool whose replays all missed the wait budget: its people wait,
   so it does not do the baseline's work). Measured independently of gpupoold's own accounting:
   waits and busy time from the clients' lines, leased time from the pool's lease history
   (GET /api/v1/leases), read once every lease has ended.
5. The check: gpupoold's own report of each replay's period (GET /api/v1/report, what
   `gpupoold report` prints) is printed beside the benchmark's leased and busy GPU-hours with
   the difference in %, and the script exits 1 when either differs by more than 5 % (AGREE_PCT).

Runs at nice 10 unless --no-nice, gpupoold's workers at nice 19: on the simulated GPU a busy
kernel spins on a CPU, and on a shared machine it should yield, to the daemon and the clients
whose waits are measured first.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import platform
import random
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from benchlib import BUILD, ROOT  # noqa: E402

# --------------------------------------------------------------------------------- the model
# Every figure here is an assumption of this benchmark, not a measurement of any cluster. The
# published trace studies (Jeon et al., "Analysis of Large-Scale Multi-Tenant GPU Clusters for
# DNN Training Workloads", USENIX ATC 2019, Microsoft's Philly trace; Weng et al., "MLaaS in the
# Wild: Workload Analysis and Scheduling in Large-Scale Heterogeneous GPU Clusters", NSDI 2022,
# Alibaba PAI) report that allocated GPUs are often far from fully used and that job durations
# span minutes to days; the shapes below follow that in kind, the numbers are ours.
MODEL: dict[str, dict[str, Any]] = {
    # share of the team, sessions per person per day, session length (min), busy and idle
    # stretches inside a session (min)
    "notebook": {"share": 0.5, "sessions": (1, 3), "length_min": (30, 150),
                 "busy_min": (1, 5), "idle_mean_min": 15},
    "training": {"share": 0.2, "sessions": (1, 1), "length_min": (60, 300),
                 "busy_min": (20, 40), "idle_mean_min": 2},
    "ci": {"share": 0.15, "per_hour": 1.0, "length_min": (3, 15),
           "busy_min": (0.5, 1.5), "idle_mean_min": 0.3},
    "inference": {"share": 0.15, "sessions": (1, 1), "length_min": None,
                  "busy_min": (0.1, 0.5), "idle_mean_min": 6},
}
KINDS = tuple(MODEL)


@dataclass(frozen=True)
class Session:
    """One session of one person: it starts at `start` seconds into the day and alternates busy
    and idle stretches (`phases`: (busy_s, idle_s) pairs; the last idle is 0)."""

    person: int
    kind: str
    start: float
    phases: tuple[tuple[float, float], ...]

    @property
    def length(self) -> float:
        return sum(b + i for b, i in self.phases)

    @property
    def busy(self) -> float:
        return sum(b for b, _ in self.phases)


def roles(people: int) -> list[str]:
    """Each person's kind of work, by MODEL's shares (largest remainders), notebooks first."""
    raw = [MODEL[k]["share"] * people for k in KINDS]
    counts = [math.floor(r) for r in raw]
    for i in sorted(range(len(KINDS)), key=lambda i: raw[i] - counts[i], reverse=True):
        if sum(counts) >= people:
            break
        counts[i] += 1
    return [k for k, n in zip(KINDS, counts) for _ in range(n)]


def _phases(rng: random.Random, kind: str, length: float) -> tuple[tuple[float, float], ...]:
    m = MODEL[kind]
    out: list[tuple[float, float]] = []
    t = 0.0
    while t < length:
        busy = min(rng.uniform(*m["busy_min"]) * 60, length - t)
        t += busy
        idle = min(rng.expovariate(1 / (m["idle_mean_min"] * 60)), max(0.0, length - t))
        t += idle
        out.append((round(busy, 3), round(idle, 3)))
    last_busy, _ = out[-1]
    out[-1] = (last_busy, 0.0)  # a session ends when its last work does
    return tuple(out)


def make_day(people: int, hours: float, seed: int) -> list[Session]:
    """The day's sessions for a team of `people`, `hours` long, the same for the same seed;
    every session ends within the day, sorted by start."""
    rng = random.Random(seed)
    day = hours * 3600
    sessions: list[Session] = []
    for person, kind in enumerate(roles(people)):
        m = MODEL[kind]
        if kind == "ci":
            t = rng.expovariate(m["per_hour"] / 3600)
            starts_lengths = []
            while t < day:
                length = rng.uniform(*m["length_min"]) * 60
                starts_lengths.append((t, min(length, day - t)))
                t += length + rng.expovariate(m["per_hour"] / 3600)
        elif kind == "inference":
            starts_lengths = [(0.0, day)]
        else:
            starts_lengths = []
            t = 0.0
            for _ in range(rng.randint(*m["sessions"])):
                length = rng.uniform(*m["length_min"]) * 60
                gap = rng.uniform(0, max(0.0, (day - t - length) / 2))
                if t + gap >= day:
                    break
                starts_lengths.append((t + gap, min(length, day - t - gap)))
                t += gap + length
        for start, length in starts_lengths:
            if length > 0:
                sessions.append(Session(person, kind, round(start, 3),
                                        _phases(rng, kind, length)))
    return sorted(sessions, key=lambda s: (s.start, s.person))


# ----------------------------------------------------------------------- figures (pure)

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks; 0 for none."""
    if not values:
        return 0.0
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


@dataclass
class Figures:
    """One configuration's figures, in simulated seconds."""

    config: str
    gpus: int
    period_s: float
    busy_s: float
    leased_s: float
    waits: list[float] = field(default_factory=list)

    def summary(self, baseline_gpus: int, budget_s: float) -> dict[str, Any]:
        capacity = self.gpus * self.period_s
        within = percentile(self.waits, 95) <= budget_s
        return {"config": self.config, "gpus": self.gpus, "period_s": self.period_s,
                "busy_util": self.busy_s / capacity if capacity else 0.0,
                "leased_util": self.leased_s / capacity if capacity else 0.0,
                "busy_gpu_h": self.busy_s / 3600, "leased_gpu_h": self.leased_s / 3600,
                "wait_p50_s": percentile(self.waits, 50), "wait_p95_s": percentile(self.waits, 95),
                "waits": len(self.waits), "within_budget": within,
                # a pool that misses the wait budget does not do the same work as the baseline
                # (its people wait): no ratio, rather than a flattering one
                "gpus_vs_baseline": baseline_gpus / self.gpus if self.gpus and within else None}


def baseline(sessions: Sequence[Session], people: int, hours: float) -> Figures:
    """One GPU per person: every session on its owner's GPU at once (no waits), the GPU leased
    for the whole session."""
    return Figures("one GPU per person", people, hours * 3600,
                   sum(s.busy for s in sessions), sum(s.length for s in sessions),
                   [0.0] * sum(len(s.phases) for s in sessions))


def stints(session: Session, detach_after: float) -> list[tuple[float, float, float, int]]:
    """A session as the pool sees it: stretches that hold a GPU, as (held_s, busy_s, gap_s,
    busy stretches): with idle detach, an idle stretch longer than `detach_after` ends a stint
    (the GPU is held `detach_after` into it, then given back) and the next busy stretch wants a
    GPU again."""
    out: list[tuple[float, float, float, int]] = []
    held = busy = 0.0
    n = 0
    for b, i in session.phases:
        held += b
        busy += b
        n += 1
        if detach_after > 0 and i > detach_after:
            out.append((held + detach_after, busy, i - detach_after, n))
            held = busy = 0.0
            n = 0
        else:
            held += i
    if n:
        out.append((held, busy, 0.0, n))
    return out


def simulate(sessions: Sequence[Session], gpus: int, detach_after: float, hours: float,
             config: str = "") -> Figures:
    """The day on a pool of `gpus`, first come first served, idle detach as soon as a stint's
    idle passes `detach_after` (0: never): waits (one per busy stretch), busy and leased time. A model of the pool used
    to propose a size; the replay measures the real one."""
    plans = [stints(s, detach_after) for s in sessions]
    events: list[tuple[float, int, str, int, int]] = []  # (time, seq, what, session, stint)
    seq = 0
    for i, s in enumerate(sessions):
        events.append((s.start, seq, "want", i, 0))
        seq += 1
    heapq.heapify(events)
    free, queue = gpus, deque()
    waits: list[float] = []
    leased = 0.0
    end = hours * 3600

    def grant(t: float, i: int, k: int, wanted: float) -> None:
        nonlocal seq, leased
        held, _, gap, n = plans[i][k]
        # a wait per busy stretch, as the clients measure them: the stint's first waits for a
        # GPU, the others find theirs held
        waits.extend([t - wanted] + [0.0] * (n - 1))
        leased += held
        heapq.heappush(events, (t + held, seq, "release", i, k))
        seq += 1
        if k + 1 < len(plans[i]):
            heapq.heappush(events, (t + held + gap, seq, "want", i, k + 1))
            seq += 1

    while events:
        t, _, what, i, k = heapq.heappop(events)
        end = max(end, t)
        if what == "want":
            if free > 0:
                free -= 1
                grant(t, i, k, t)
            else:
                queue.append((t, i, k))
        elif queue:
            wanted, qi, qk = queue.popleft()
            grant(t, qi, qk, wanted)
        else:
            free += 1
    return Figures(config, gpus, end, sum(s.busy for s in sessions), leased, waits)


def smallest_pool(sessions: Sequence[Session], detach_after: float, hours: float,
                  budget_s: float, most: int) -> int:
    """The smallest pool size (1..most) whose simulated p95 wait is within `budget_s`."""
    for k in range(1, most + 1):
        if percentile(simulate(sessions, k, detach_after, hours).waits, 95) <= budget_s:
            return k
    return most


def held_intervals(lease: dict[str, Any], events: Sequence[dict[str, Any]],
                   until: float) -> list[tuple[float, float]]:
    """The stretches in which a lease held a GPU, from its record (started, ended; `until` while
    it runs) and its events (GET /api/v1/leases/ID): from its start or an `attached` event to the
    next `detached` event or its end. The time from a detach to the attach that follows is not
    held, the wait for a free GPU after the client called again included."""
    end = lease.get("ended") or until
    out: list[tuple[float, float]] = []
    since: float | None = float(lease["started"])
    for e in sorted(events, key=lambda e: float(e["at"])):
        if e["state"] == "detached" and since is not None:
            out.append((since, float(e["at"])))
            since = None
        elif e["state"] == "attached" and since is None:
            since = float(e["at"])
    if since is not None:
        out.append((since, end))
    return [(a, min(b, end)) for a, b in out if min(b, end) > a]


def leased_from_history(history: Sequence[tuple[dict[str, Any], Sequence[dict[str, Any]]]],
                        until: float) -> float:
    """GPU-seconds the pool's leases held: the sum of every lease's held_intervals."""
    return sum(b - a for lease, events in history for a, b in held_intervals(lease, events, until))


def parse_client(text: str) -> list[tuple[float, float, float]]:
    """A client's lines as (at, wait_s, busy_s) per busy phase (real seconds)."""
    out = []
    for line in text.splitlines():
        if line.startswith("phase="):
            kv = dict(part.split("=", 1) for part in line.split())
            out.append((float(kv["at"]), float(kv["wait_ms"]) / 1000,
                        float(kv["busy_ms"]) / 1000))
    return out


# --------------------------------------------------------------------------------- the replay

def log(msg: str) -> None:
    print(f"[pool-day] {msg}", file=sys.stderr, flush=True)


def build_client() -> Path:
    out = BUILD / "bench" / "pool_day_client"
    deps = (ROOT / "bench" / "pool_day_client.cu", ROOT / "tests" / "sim" / "gp_test_kernels.cuh")
    if not out.exists() or out.stat().st_mtime < max(d.stat().st_mtime for d in deps):
        nvcc = next((p for p in (os.environ.get("NVCC"), "/usr/local/cuda/bin/nvcc",
                                 "/usr/local/bin/nvcc", "/usr/bin/nvcc") if p and Path(p).exists()),
                    None)
        if nvcc is None:
            sys.exit("pool_day: nvcc (the CUDA toolkit) is needed to build "
                     "bench/pool_day_client.cu; set NVCC to its path")
        out.parent.mkdir(parents=True, exist_ok=True)
        log(f"nvcc {deps[0].relative_to(ROOT)}")
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # renamed: never run half-written
        subprocess.run([nvcc, "-O2", "-arch=sm_90", "-o", str(tmp), str(deps[0])], check=True)
        tmp.replace(out)
    for part in (BUILD / "gpupool-worker", BUILD / "libgpupool-sim.so",
                 BUILD / "client" / "libcuda.so.1"):
        if not part.exists():
            sys.exit(f"pool_day: {part} is missing: build gpupool first (make -j2)")
    return out


def all_leases(d: benchlib.Daemon) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    before = ""
    while True:
        page = d.get(f"/api/v1/leases?state=all&limit=500{before}")
        out.extend(page["leases"])
        if not page.get("next_before"):
            return out
        before = f"&before={page['next_before']}"


def own_report(d: benchlib.Daemon, since: float, until: float) -> Any:
    """gpupoold's own report of the replay's period (GET /api/v1/report, issue 33, item 2) as it
    answers, kept beside the benchmark's figures to compare them ({"unavailable": why} where it
    gives none). The daemon widens the period to whole minutes, its rows' resolution; the
    replay's daemon held no lease outside the replay, so the widened period has the same usage."""
    try:
        return d.get(f"/api/v1/report?from={since:.3f}&to={until:.3f}&by=gpu")["report"]
    except (OSError, ValueError, KeyError) as exc:  # HTTPError is an OSError
        return {"unavailable": str(exc)}


def wait_leases_ended(d: benchlib.Daemon, timeout: float = 30.0) -> None:
    """Until gpupoold has recorded every lease's end: a client's exit comes before the daemon
    notices its connection closed, and a lease still open has its last stretch in neither the
    lease history nor the report yet."""
    deadline = time.monotonic() + timeout
    while d.get("/api/v1/leases?state=active&limit=1")["leases"]:
        if time.monotonic() > deadline:
            sys.exit(f"pool_day: leases still active {timeout:.0f} s after every client exited")
        time.sleep(0.05)


AGREE_PCT = 5.0  # gpupoold's report and the benchmark's figures agree within this (acceptance)


def agreement(leased_gpu_h: float, busy_gpu_h: float, report: dict[str, Any],
              scale: float) -> dict[str, Any]:
    """The report's leased and busy GPU-hours (real time, scaled to simulated) beside the
    benchmark's own, and their difference in % of the benchmark's; `ok`: both within
    AGREE_PCT. A report that is unavailable never agrees."""
    if "leased_gpu_hours" not in report:
        return {"ok": False, "why": f"no report: {report.get('unavailable', report)}"}
    out: dict[str, Any] = {}
    for what, mine in (("leased", leased_gpu_h), ("busy", busy_gpu_h)):
        theirs = float(report[f"{what}_gpu_hours"]) * scale
        diff = 100 * (theirs - mine) / mine if mine else (0.0 if theirs == 0 else math.inf)
        out[what] = {"bench_gpu_h": mine, "report_gpu_h": theirs, "diff_pct": diff}
    out["ok"] = all(abs(out[w]["diff_pct"]) <= AGREE_PCT for w in ("leased", "busy"))
    return out


def lower_workers(daemon_pid: int, stop: threading.Event) -> None:
    """Keep the daemon's workers at nice 19 while `stop` is not set: on the simulated GPU a busy
    kernel spins on a CPU, where a real GPU's would not, and the spinning should not slow the
    daemon and the clients that the waits are measured on."""
    done: set[int] = set()
    while not stop.wait(0.1):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in done:
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == daemon_pid:
                    os.setpriority(os.PRIO_PROCESS, int(entry.name), 19)
                    done.add(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue  # gone, or not ours to change


def replay(client: Path, sessions: Sequence[Session], gpus: int, detach_after: float,
           scale: float, hours: float, config: str) -> tuple[Figures, dict[str, Any]]:
    """The day, for real, on gpupoold with `gpus` simulated GPUs; figures in simulated seconds."""
    real_detach = detach_after / scale
    settings = (f"idle_detach_after = {real_detach:g}\n" if detach_after > 0
                else "idle_detach_after = 0\n")
    settings += "max_queue_per_token = 0\nqueue_timeout = 86400\nmax_queue = 4096\n"
    # Utilisation is read every telemetry_interval: 0.25 s real is 100 simulated seconds at
    # 400x, fine enough for gpupoold's own busy accounting to be compared with the clients'.
    settings += "telemetry_interval = 0.25\n"
    d = benchlib.Daemon(gpus, config=benchlib.plain_tcp_server_config() + settings,
                        name="pool-day")
    stop = threading.Event()
    assert d.proc is not None
    lowering = threading.Thread(target=lower_workers, args=(d.proc.pid, stop), daemon=True)
    lowering.start()
    try:
        d.wait_quiet()
        env = d.client_env()
        order = sorted(range(len(sessions)), key=lambda i: sessions[i].start)
        procs: dict[int, subprocess.Popen[str]] = {}
        t0_wall, t0 = time.time(), time.monotonic()
        for i in order:
            s = sessions[i]
            delay = t0 + s.start / scale - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            arg = ",".join(f"{b * 1000 / scale:.3f},{idle * 1000 / scale:.3f}"
                           for b, idle in s.phases)
            procs[i] = subprocess.Popen([str(client), arg], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        waits: list[float] = []
        busy = 0.0
        failed = []
        slow = []
        for i, p in procs.items():
            out, err = p.communicate(timeout=max(600.0, hours * 3600 / scale * 4))
            if p.returncode != 0:
                failed.append(f"session {i} ({sessions[i].kind}): rc {p.returncode}: "
                              f"{err.strip()[-300:]}")
            phases = parse_client(out)
            waits.extend(w * scale for _, w, _ in phases)
            busy += sum(b for _, _, b in phases) * scale
            if phases and abs(sum(b for _, _, b in phases) * scale - sessions[i].busy) > \
                    0.1 * sessions[i].busy + 5 * scale / 1000 * len(phases):
                slow.append(i)
        t_end = time.time()
        if failed:
            sys.exit("pool_day: clients failed:\n" + "\n".join(failed))
        wait_leases_ended(d)
        t_read = time.time()
        leases = all_leases(d)
        history = [(x, d.get(f"/api/v1/leases/{x['id']}").get("events", [])) for x in leases]
        leased = leased_from_history(history, t_read) * scale
        period = max(hours * 3600, (t_end - t0_wall) * scale)
        report = own_report(d, t0_wall, t_read)
        extra = {"leases": len(leases), "detaches": sum(int(x.get("detaches") or 0)
                                                        for x in leases),
                 "detached_gpu_h": sum(float(x.get("detached_s") or 0) for x in leases) * scale
                 / 3600, "wall_s": t_end - t0_wall, "sessions_over_busy_by_10pct": len(slow),
                 "from": t0_wall, "to": t_read, "report": report,
                 "agreement": agreement(leased / 3600, busy / 3600, report, scale)}
        return Figures(config, gpus, period, busy, leased, waits), extra
    finally:
        stop.set()
        lowering.join()
        d.close()


def search(client: Path, sessions: Sequence[Session], detach_after: float, args: Any,
           config: str, baseline_gpus: int) -> dict[str, Any]:
    """Replays around the queue model's proposal: the smallest replayed size within budget."""
    proposal = smallest_pool(sessions, detach_after, args.hours, args.budget_s, baseline_gpus)
    runs: dict[int, dict[str, Any]] = {}
    k = proposal
    while len(runs) < args.max_runs and 1 <= k <= baseline_gpus and k not in runs:
        log(f"{config}: replaying on {k} GPU(s) (the queue model proposed {proposal})")
        fig, extra = replay(client, sessions, k, detach_after, args.scale, args.hours, config)
        runs[k] = {**fig.summary(baseline_gpus, args.budget_s), **extra}
        log(f"{config}, {k} GPU(s): p95 wait {runs[k]['wait_p95_s']:.0f} s, busy "
            f"{100 * runs[k]['busy_util']:.0f} %, leased {100 * runs[k]['leased_util']:.0f} % "
            f"({extra['wall_s']:.0f} s)")
        k = k - 1 if runs[k]["within_budget"] else k + 1
    good = [n for n, r in runs.items() if r["within_budget"]]
    best = runs[min(good)] if good else runs[max(runs)]
    # exact when the size below the smallest good one missed (or is 0); else an upper bound
    exact = bool(good) and (min(good) == 1 or min(good) - 1 in runs)
    return {**best, "needed": min(good) if good else None, "needed_exact": exact,
            "proposed": proposal, "runs": [runs[n] for n in sorted(runs)]}


def ratio_text(c: dict[str, Any]) -> str:
    """The GPUs-vs-baseline column: '-' where no replayed pool met the wait budget."""
    return "-" if c["gpus_vs_baseline"] is None else f"{c['gpus_vs_baseline']:.1f}x"


def notes(result: dict[str, Any]) -> list[str]:
    """Why a configuration's ratio is blank."""
    budget = result["args"]["budget_s"]
    return [f"{c['config']}: no ratio ('-'): no replayed pool kept the p95 wait within "
            f"{budget:g} s (the largest, {c['gpus']} GPUs, waited {c['wait_p95_s']:.0f} s), so "
            "the GPUs it needs for the same work are not known; replay more sizes "
            "(--max-runs) or allow longer waits (--budget-s)"
            for c in result["configs"] if c.get("needed", c["gpus"]) is None]


def agreement_rows(result: dict[str, Any]) -> list[list[str]]:
    """Every replay's leased and busy GPU-hours, the benchmark's and gpupoold's report's, and
    their difference in % (simulated time)."""
    rows = []
    for c in result["configs"][1:]:
        for run in c["runs"]:
            a = run["agreement"]
            if "leased" not in a:
                rows.append([c["config"], str(run["gpus"]), a["why"], "", "", "", "", ""])
                continue
            rows.append([c["config"], str(run["gpus"])] + [
                f"{a[w][k]:.2f}" if k != "diff_pct" else f"{a[w][k]:+.1f} %"
                for w in ("leased", "busy") for k in ("bench_gpu_h", "report_gpu_h", "diff_pct")])
    return rows


AGREEMENT_HEAD = ["configuration", "GPUs", "leased GPU-h (bench)", "leased (report)", "diff",
                  "busy GPU-h (bench)", "busy (report)", "diff"]


def disagreements(result: dict[str, Any]) -> list[str]:
    """The replays whose report differs from the benchmark by more than AGREE_PCT."""
    return [f"{c['config']} on {run['gpus']} GPU(s): " + (
        run["agreement"].get("why") or ", ".join(
            f"{w} {run['agreement'][w]['report_gpu_h']:.2f} GPU-h reported against "
            f"{run['agreement'][w]['bench_gpu_h']:.2f} measured "
            f"({run['agreement'][w]['diff_pct']:+.1f} %)" for w in ("leased", "busy")))
        for c in result["configs"][1:] for run in c["runs"] if not run["agreement"]["ok"]]


def needed_text(c: dict[str, Any]) -> str:
    """GPUs needed as the table says it: N, <= N (a smaller pool was not replayed), > N (the
    largest replayed pool missed the budget)."""
    if "needed" not in c:
        return str(c["gpus"])
    if c["needed"] is None:
        return f"> {c['gpus']}"
    return str(c["needed"]) if c["needed_exact"] else f"<= {c['needed']}"


def markdown(result: dict[str, Any]) -> list[str]:
    a = result["args"]
    rows = [["configuration", "GPUs needed", "busy utilisation", "leased utilisation",
             "wait p50", "wait p95", "GPUs vs baseline"], ["---"] * 7]
    for c in result["configs"]:
        rows.append([c["config"], needed_text(c), f"{100 * c['busy_util']:.0f} %",
                     f"{100 * c['leased_util']:.0f} %", f"{c['wait_p50_s']:.0f} s",
                     f"{c['wait_p95_s']:.0f} s", ratio_text(c)])
    agree = [AGREEMENT_HEAD, ["---"] * len(AGREEMENT_HEAD), *agreement_rows(result)]
    return [f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(result['at']))}, commit "
            f"{result['commit']}, {result['machine']}; {a['people']} people, {a['hours']:g} h "
            f"day, seed {a['seed']}, {len(result['sessions'])} sessions, time-scale "
            f"{a['scale']:g}x, wait budget p95 <= {a['budget_s']:g} s, idle detach after "
            f"{a['detach_after_s']:g} s (all in simulated time).", "",
            *("| " + " | ".join(r) + " |" for r in rows), "",
            *(f"{n}." for n in notes(result)), *([""] if notes(result) else []),
            f"gpupoold's own report (GET /api/v1/report of each replay's period) against the "
            f"benchmark's figures, simulated GPU-hours (must agree within {AGREE_PCT:g} %):", "",
            *("| " + " | ".join(r) + " |" for r in agree)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: 8 people, a 2 h day at 600x, one replay per pool")
    ap.add_argument("--people", type=int, default=16)
    ap.add_argument("--hours", type=float, default=8.0)
    ap.add_argument("--scale", type=float, default=400.0,
                    help="simulated seconds per real second (400: an hour in 9 s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="p95 wait budget, simulated seconds")
    ap.add_argument("--detach-after-s", type=float, default=120.0,
                    help="idle_detach_after of the detach pool, simulated seconds")
    ap.add_argument("--max-runs", type=int, default=2, help="replays per pool at most")
    ap.add_argument("--no-nice", action="store_true")
    ap.add_argument("--json", type=Path, help="write the result as JSON here ('-': stdout)")
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.people, args.hours, args.scale, args.max_runs = 8, 2.0, 600.0, 1
    if not args.no_nice:
        os.nice(10)  # the workers (spinning kernels) go to 19: lower_workers
    client = build_client()
    sessions = make_day(args.people, args.hours, args.seed)
    base = baseline(sessions, args.people, args.hours)
    log(f"{len(sessions)} sessions, {base.busy_s / 3600:.1f} busy GPU-hours, "
        f"{base.leased_s / 3600:.1f} leased, of {args.people * args.hours:g} GPU-hours")
    configs = [base.summary(args.people, args.budget_s)]
    for name, detach in (("pool, no idle detach", 0.0),
                         ("pool, idle detach", args.detach_after_s)):
        configs.append(search(client, sessions, detach, args, name, args.people))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    result = {"at": time.time(), "commit": commit,
              "machine": f"{platform.node()}: {os.cpu_count()} CPUs ({benchlib.cpu_model()}), "
                         "simulated GPUs", "args": vars(args) | {"json": None, "markdown": None},
              "sessions": [asdict(s) for s in sessions], "configs": configs}
    head = ["configuration", "GPUs", "busy", "leased", "wait p50", "wait p95", "vs baseline"]
    print(benchlib.text_table(head, [
        [c["config"], needed_text(c),
         f"{100 * c['busy_util']:.0f} %", f"{100 * c['leased_util']:.0f} %",
         f"{c['wait_p50_s']:.0f} s", f"{c['wait_p95_s']:.0f} s",
         ratio_text(c)] for c in configs]))
    for note in notes(result):
        print(note)
    print(f"\ngpupoold's report against the benchmark (simulated GPU-hours; within "
          f"{AGREE_PCT:g} % required):")
    print(benchlib.text_table(AGREEMENT_HEAD, agreement_rows(result)))
    if args.json:
        text = json.dumps(result, indent=1, default=str)
        if str(args.json) == "-":
            print(text)
        else:
            args.json.write_text(text)
    benchlib.emit_markdown(markdown(result), args.markdown)
    bad = disagreements(result)
    if bad:
        print(f"pool_day: gpupoold's report disagrees with the benchmark by more than "
              f"{AGREE_PCT:g} %:\n  " + "\n  ".join(bad) + "\nIts accounting (pool/usage.py, "
              "pool/usage_recorder.py) or the report (pool/report.py) miscounted this day; "
              "the JSON (--json) keeps both sides of every replay.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
