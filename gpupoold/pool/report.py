"""The usage report (issue 33, item 2; `gpupoold report`, `GET /api/v1/report`): from the stored
per-minute rows (pool/usage.py) and the lease records of a period, how much of the GPUs' time
was leased and busy, per GPU, token or server, the queue waits and what idle detach handed on.

The rows of every minute that overlaps the period count (`first_row`), the first and last whole.
Pure arithmetic over plain values: the API gathers the rows from the store (every server's on a
shared PostgreSQL store, so a fleet's report sums its servers) and renders the result as JSON,
text or CSV (`to_text`, `to_csv`).

What each figure means:
- leased share: leased GPU-seconds over (GPUs x period seconds); busy share the same for busy;
- a group's `leased_share` is over the capacity of its GPUs (by gpu, server) or of the whole
  pool (by token: the share of all GPU time that token held);
- waits: `queued_s` of the leases that started in the period, p50 and p95 by nearest rank;
- detached GPU-hours: the time leases that started in the period spent detached, their GPU
  handed back to the pool; reused GPU-hours: of the period's GPU time, what a GPU served other
  leases while a lease that detached from it was away (what idle detach handed on).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

GROUPINGS = ("gpu", "token", "server")
HOUR = 3600.0
MINUTE = 60.0  # the stored rows' resolution (pool/usage.py's per-minute rows)


@dataclass(frozen=True)
class LeaseFacts:
    """What the report needs of one lease record."""

    token: str
    server: str
    gpu: int
    queued_s: float
    detaches: int
    detached_s: float


def percentile(values: Sequence[float], p: float) -> float | None:
    """The nearest-rank p-th percentile (0 < p <= 100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


def first_row(since: float) -> float:
    """The minute of the first row a report from `since` counts: the one `since` falls in. A
    row is dated by its minute's start and cannot be split, so a report counts the rows of every
    minute that overlaps its period, the first as well as the last: reading only the rows that
    start within the period left the first minute out whole, and a report of a few minutes (or
    of a replay run at a time-scale, a day in a minute or two) lost most of its usage."""
    return math.floor(since / MINUTE) * MINUTE


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def _key(row: dict[str, Any], by: str) -> str:
    if by == "gpu":
        return f"{row['server']}/{row['gpu']}" if row["server"] else str(row["gpu"])
    return str(row[by])


def build_report(since: float, until: float, by: str, gpus: Iterable[tuple[str, int]],
                 minutes: Iterable[dict[str, Any]], leases: Iterable[LeaseFacts]
                 ) -> dict[str, Any]:
    """The report of [since, until) grouped `by` gpu, token or server. `gpus`: (server, index)
    of every GPU counted in the capacity; `minutes`: per-minute rows (server, gpu, minute,
    token, leased_s, busy_s) in the period; `leases`: those that started in it."""
    if by not in GROUPINGS:
        raise ValueError(f"by must be one of {', '.join(GROUPINGS)}, got {by!r}")
    if not until > since:
        raise ValueError("the period's end must come after its start")
    period = until - since
    known = set(gpus)
    rows = list(minutes)
    known |= {(r["server"], r["gpu"]) for r in rows}  # a GPU gone since still counts
    capacity = len(known) * period
    per_server: dict[str, int] = {}
    for server, _ in known:
        per_server[server] = per_server.get(server, 0) + 1

    groups: dict[str, dict[str, Any]] = {}
    if by == "gpu":
        for server, index in sorted(known):
            groups[_key({"server": server, "gpu": index}, by)] = {
                "leased_s": 0.0, "busy_s": 0.0, "reused_s": 0.0, "capacity_s": period}
    elif by == "server":
        for server, count in sorted(per_server.items()):
            groups[server] = {"leased_s": 0.0, "busy_s": 0.0, "reused_s": 0.0,
                              "capacity_s": count * period}
    leased = busy = reused = 0.0
    for r in rows:
        leased += r["leased_s"]
        busy += r["busy_s"]
        reused += r.get("reused_s", 0.0)
        g = groups.setdefault(_key(r, by), {"leased_s": 0.0, "busy_s": 0.0, "reused_s": 0.0,
                                            "capacity_s": capacity})
        g["leased_s"] += r["leased_s"]
        g["busy_s"] += r["busy_s"]
        g["reused_s"] += r.get("reused_s", 0.0)

    facts = list(leases)
    waits = [f.queued_s for f in facts]
    detached_s = sum(f.detached_s for f in facts)
    out_groups = []
    for key, g in sorted(groups.items()):
        out_groups.append({
            by: key, "gpu_hours": g["leased_s"] / HOUR, "busy_gpu_hours": g["busy_s"] / HOUR,
            "reused_gpu_hours": g["reused_s"] / HOUR,
            "leased_share": _share(g["leased_s"], g["capacity_s"]),
            "busy_share": _share(g["busy_s"], g["capacity_s"]),
            "busy_of_leased": _share(g["busy_s"], g["leased_s"]),
            "leases": sum(1 for f in facts
                          if _key({"server": f.server, "gpu": f.gpu, "token": f.token}, by)
                          == key)})
    report = {
        "from": since, "to": until, "by": by, "gpus": len(known),
        "leased_gpu_hours": leased / HOUR, "busy_gpu_hours": busy / HOUR,
        "leased_share": _share(leased, capacity), "busy_share": _share(busy, capacity),
        "leases": len(facts),
        "wait_p50_s": percentile(waits, 50), "wait_p95_s": percentile(waits, 95),
        "detaches": sum(f.detaches for f in facts), "detached_gpu_hours": detached_s / HOUR,
        "reused_gpu_hours": reused / HOUR,
        "groups": out_groups,
    }
    report["summary"] = summary_line(report)
    return report


def _period_words(seconds: float) -> str:
    for size, word in ((7 * 86400, "week"), (86400, "day"), (HOUR, "hour")):
        if abs(seconds - size) < 1:
            return f"the {word}"
    if seconds >= 86400:
        return f"the {seconds / 86400:.3g} days"
    if seconds >= HOUR:
        return f"the {seconds / HOUR:.3g} hours"
    minutes = seconds / 60
    return "the minute" if abs(minutes - 1) < 1 / 60 else f"the {minutes:.3g} minutes"


def summary_line(r: dict[str, Any]) -> str:
    """The report in one plain sentence."""
    gpus = f"the {r['gpus']} GPU{'s' if r['gpus'] != 1 else ''}"
    words = (f"{gpus} were leased {100 * r['leased_share']:.0f} % and busy "
             f"{100 * r['busy_share']:.0f} % of {_period_words(r['to'] - r['from'])}; "
             f"idle detach handed on {r['reused_gpu_hours']:.3g} GPU-hours "
             f"({r['detaches']} detach{'es' if r['detaches'] != 1 else ''}, "
             f"{r['detached_gpu_hours']:.3g} GPU-hours detached); ")
    if r["wait_p50_s"] is None:
        return words + "no lease started"
    return words + (f"median wait {_seconds(r['wait_p50_s'])} (p95 {_seconds(r['wait_p95_s'])}) "
                    f"over {r['leases']} lease{'s' if r['leases'] != 1 else ''}")


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


def to_csv(report: dict[str, Any]) -> str:
    """One line per group, with a header."""
    by = report["by"]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    fields = [by, "gpu_hours", "busy_gpu_hours", "leased_share", "busy_share", "busy_of_leased"]
    writer.writerow(fields)
    for g in report["groups"]:
        writer.writerow([g[by]] + [f"{g[f]:.6g}" for f in fields[1:]])
    return out.getvalue()


def to_text(report: dict[str, Any]) -> str:
    """The summary line and a table of the groups."""
    by = report["by"]
    lines = [report["summary"], "",
             f"{by.upper():<24} {'GPU-HOURS':>10} {'BUSY GPU-H':>10} {'LEASED':>7} "
             f"{'BUSY':>7} {'BUSY/LEASED':>11}"]
    for g in report["groups"]:
        lines.append(f"{g[by]:<24} {g['gpu_hours']:>10.3f} {g['busy_gpu_hours']:>10.3f} "
                     f"{100 * g['leased_share']:>6.1f}% {100 * g['busy_share']:>6.1f}% "
                     f"{100 * g['busy_of_leased']:>10.1f}%")
    return "\n".join(lines) + "\n"
