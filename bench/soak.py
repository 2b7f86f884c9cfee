#!/usr/bin/env python3
"""The soak: a mixed load against one gpupoold for a while, with what goes wrong in real life,
and a report of everything it checked.

    python bench/soak.py [--seconds 120] [--gpus 2] [--restarts 2] [--seed 1] [--json PATH]

On simulated GPUs over loopback (the native build in build/; nvcc for the launch clients), for
--seconds: short clients (a few MiB, a few copies) keep more GPUs busy than there are, so others
wait in the queue; one long client at a time streams copies checking each one, sits idle holding
its GPU, or runs kernels with copies and synchronises (tests/cuda/longrun.cu); every few seconds
a client is SIGKILLed in the middle of its copies; gpupoold is restarted --restarts times in the
first two thirds of the run, alternately with SIGTERM and SIGKILL (leases are taken over, queued
clients come back by themselves). Then the load stops and it checks:

  clients served      every client not killed ended well (exit 0; its data bit-exact)
  leases lost         lease records ended by anything but their client (0 allowed; the killed
                      clients' leases end as "client lost", or "not started" when the kill came
                      during the lease's hand-over). A record that gpupoold's SIGKILL cut
                      during its hand-over ("daemon lost", no call served) whose client then
                      connected again and was served is counted apart, as a cut hand-over
  worker crashes      leases or pre-started workers that ended as "worker crashed" (0 allowed)
  daemon resources    file descriptors and resident memory of gpupoold when idle at the start
                      and at the end (after its restarts: the last one), within 10 %

Prints a table; exits 1 when a check fails. tests/test_soak.py runs the 2-minute version.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from benchlib import Daemon  # noqa: E402

ROOT = benchlib.ROOT
BUILD = Path(os.environ.get("GPUPOOL_BUILD_DIR", ROOT / "build")).resolve()
MIB = 1 << 20
SHORT_AT_ONCE = 4  # short clients alive at once (with the long one: more than the GPUs)
KILL_EVERY = 6.0  # seconds between two SIGKILLed clients
RESOURCE_SLACK = 0.10  # the daemon's fds and memory at the end: within 10 % of the start


def log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


def build_clients() -> tuple[Path, Path | None]:
    """hold_gpu (C, through the shim) and longrun (nvcc; None without nvcc)."""
    out = BUILD / "bench"
    out.mkdir(parents=True, exist_ok=True)
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    hold = out / "hold_gpu"
    # Built under a temporary name and renamed: another run (a parallel test) may be running
    # the previous one, and must never start a half-written program.
    tmp = hold.with_name(f".hold_gpu.{os.getpid()}.tmp")
    subprocess.run([os.environ.get("CC", "cc"), "-std=c11", "-O2", f"-I{cuda / 'include'}", "-o",
                    str(tmp), str(ROOT / "tests" / "clients" / "hold_gpu.c"),
                    str(BUILD / "client" / "libcuda.so.1")], check=True)
    tmp.replace(hold)
    nvcc = cuda / "bin" / "nvcc"
    longrun = out / "longrun"
    src = ROOT / "tests" / "cuda" / "longrun.cu"
    if not nvcc.exists():
        log("nvcc not found: no launch clients")
        return hold, None
    if not longrun.exists() or longrun.stat().st_mtime < src.stat().st_mtime:
        tmp = longrun.with_name(f".longrun.{os.getpid()}.tmp")
        subprocess.run([str(nvcc), "-arch=sm_90", "-O2", "-cudart", "shared", "-o", str(tmp),
                        str(src)], check=True, capture_output=True)
        tmp.replace(longrun)
    return hold, longrun


NOTABLE = ("refused", "closed", "handshake", "stopping", "starting", "taking over", "taken over")


def daemon_lines_between(state: Path, start: float, end: float) -> list[str]:
    """gpupoold's warnings and notable lines logged between two wall-clock times, from every
    daemon of the run (its log lines start "YYYY-MM-DD HH:MM:SS LEVEL logger: ...")."""
    out = []
    for p in sorted(state.glob("gpupoold-*.log")):
        for line in p.read_text(errors="replace").splitlines():
            try:
                at = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
            except ValueError:
                continue
            if start - 1 <= at <= end + 1 and (" INFO " not in line[:30]
                                               or any(w in line for w in NOTABLE)):
                out.append(f"{p.name}: {line}")
    return out


@dataclass
class Client:
    kind: str
    proc: subprocess.Popen[str]
    started: float
    bytes: int = 0
    kill_at: float | None = None
    killed: bool = False
    out: str = ""
    err: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class Tally:
    started: dict[str, int] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)
    served_pids: set[int] = field(default_factory=set)
    killed: int = 0
    killed_pids: set[int] = field(default_factory=set)
    failed: list[str] = field(default_factory=list)
    failed_at: list[float] = field(default_factory=list)  # wall clock of each failure's reaping
    verified_bytes: int = 0
    restarts: list[tuple[str, float]] = field(default_factory=list)


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    hold, longrun = build_clients()
    daemon = Daemon(args.gpus)
    clients: list[Client] = []
    tally = Tally()
    try:
        daemon.wait_quiet()
        time.sleep(1.0)  # settled: start-up work (scrubs, telemetry's first samples) done
        fds0, rss0 = daemon.resources()
        log(f"gpupoold idle at the start: {fds0} fds, {rss0 / MIB:.1f} MiB")
        env = daemon.client_env()
        t0 = time.monotonic()
        end = t0 + args.seconds
        restart_at = [t0 + args.seconds * 2 / 3 * (i + 1) / (args.restarts + 1)
                      for i in range(args.restarts)]
        next_kill = t0 + KILL_EVERY / 2
        long_kinds = ["stream", "idle", "launch" if longrun else "stream"]
        long_n = 0

        def spawn(kind: str) -> None:
            if kind == "launch":
                assert longrun is not None
                cmd = [str(longrun), str(rng.randint(4, 10))]
                nbytes = 0
            else:
                nbytes = {"short": rng.choice([1, 2, 4, 8]), "stream": 64, "idle": 4,
                          "victim": 8}[kind] * MIB
                hold_ms = {"short": rng.randint(0, 400), "stream": rng.randint(6000, 12000),
                           "idle": rng.randint(6000, 12000), "victim": 10000}[kind]
                loops = {"short": rng.randint(0, 10), "stream": -1, "idle": 0,
                         "victim": -1}[kind]
                cmd = [str(hold), str(nbytes), str(hold_ms), str(rng.randrange(1 << 30)),
                       str(loops)]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, stdin=subprocess.DEVNULL)
            c = Client(kind, proc, time.monotonic(), nbytes)
            if kind == "victim":
                c.kill_at = c.started + rng.uniform(1.0, 2.5)
            clients.append(c)
            tally.started[kind] = tally.started.get(kind, 0) + 1

        def reap(c: Client) -> None:
            c.out, c.err = c.proc.communicate()
            if c.killed:
                tally.killed += 1
                tally.killed_pids.add(c.proc.pid)
                return
            ok = c.proc.returncode == 0  # longrun: 0 once its time is up with no error
            if c.kind != "launch":
                facts = dict(kv.split("=", 1) for ln in c.out.splitlines() if "exact=" in ln
                             for kv in ln.split())
                ok = ok and facts.get("exact") == "1"
                if ok:  # the first read (zeros), every checked copy, the last read
                    tally.verified_bytes += c.bytes * (int(facts.get("copies", "0")) + 2)
            if ok:
                tally.served[c.kind] = tally.served.get(c.kind, 0) + 1
                tally.served_pids.add(c.proc.pid)
            else:
                tally.failed.append(f"{c.kind} pid {c.pid} exit {c.proc.returncode}: "
                                    f"{(c.err or c.out).strip()[-800:]}")
                tally.failed_at.append(time.time())

        while time.monotonic() < end:
            now = time.monotonic()
            for c in [c for c in clients if c.proc.poll() is not None]:
                clients.remove(c)
                reap(c)
            for c in clients:
                if c.kill_at is not None and now >= c.kill_at and not c.killed:
                    c.proc.kill()
                    c.killed = True
            if restart_at and now >= restart_at[0]:
                restart_at.pop(0)
                how = "SIGTERM" if len(tally.restarts) % 2 == 0 else "SIGKILL"
                gap = daemon.restart(how)
                tally.restarts.append((how, gap))
                log(f"restarted gpupoold ({how}): {gap:.1f} s without a daemon, "
                    f"{len(clients)} clients running")
                continue
            if not any(c.kind in ("stream", "idle", "launch") for c in clients):
                spawn(long_kinds[long_n % len(long_kinds)])
                long_n += 1
            while sum(c.kind == "short" for c in clients) < SHORT_AT_ONCE:
                spawn("short")
            if now >= next_kill:
                spawn("victim")
                next_kill = now + KILL_EVERY
            time.sleep(0.05)
        log(f"load stopped after {time.monotonic() - t0:.0f} s; waiting for {len(clients)} "
            "clients")
        for c in clients:
            if c.kill_at is not None and not c.killed:
                c.proc.kill()
                c.killed = True
        for c in clients:
            try:
                c.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                c.proc.kill()
            reap(c)
        clients.clear()
        daemon.wait_quiet()
        time.sleep(1.0)
        fds1, rss1 = daemon.resources()
        log(f"gpupoold idle at the end: {fds1} fds, {rss1 / MIB:.1f} MiB")
        records = []
        before: int | None = None
        while True:  # every lease record, in pages
            page = daemon.get("/api/v1/leases?state=all&limit=500" +
                              (f"&before={before}" if before else ""))["leases"]
            records += page
            if len(page) < 500:
                break
            before = page[-1]["id"]
        ends: dict[str, int] = {}
        for r in records:
            ends[r["end_reason"] or "open"] = ends.get(r["end_reason"] or "open", 0) + 1
        # A SIGKILL of gpupoold between a lease's record and its worker's session leaves a
        # record "daemon lost" with no call served; its client connects again by itself and is
        # served under a new lease: a hand-over cut by the restart, not a lost lease.
        cut = [r for r in records if r["end_reason"] == "daemon lost"
               and r["client_pid"] in tally.served_pids and not any(r["calls"].values())]
        # A client SIGKILLed while its lease was being handed over (granted, its worker still
        # waiting for the hello's answer) ends it "not started": its client's end, not a loss.
        victims = [r for r in records if r["end_reason"] == "not started"
                   and r["client_pid"] in tally.killed_pids]
        lost = [r for r in records if r["end_reason"] not in ("client exit", "client lost")
                and r not in cut and r not in victims]
        # Leases' workers and pre-started ones alike: every crash has its log line.
        crashes, crash_detail = 0, []
        for p in sorted(daemon.state.glob("gpupoold-*.log")):
            lines = p.read_text(errors="replace").splitlines()
            for n, line in enumerate(lines):
                if "exited: worker crashed" in line:
                    crashes += 1
                    # the crash's line and what that worker and gpupoold said just before
                    crash_detail.append("\n".join([f"{p.name}:"] + lines[max(0, n - 12):n + 1]))
        unscrubbed = [r for r in records if r["scrub_ok"] is not True]
        # What gpupoold said while each failed client ran (its warnings, and its remoting
        # lines): a failure seen only in CI must explain itself from the report alone.
        for i, at in enumerate(tally.failed_at[:3]):
            said = daemon_lines_between(daemon.state, at - 30, at)
            tally.failed[i] += "\n  gpupoold meanwhile:\n    " + ("\n    ".join(said[-12:])
                                                                   or "(nothing)")
        result = {
            "seconds": args.seconds, "gpus": args.gpus, "restarts": tally.restarts,
            "clients_started": tally.started, "clients_served": tally.served,
            "clients_killed": tally.killed, "clients_failed": tally.failed,
            "verified_bytes": tally.verified_bytes, "leases": len(records), "lease_ends": ends,
            "leases_lost": len(lost), "lost_detail": lost[:5], "worker_crashes": crashes,
            "crash_detail": crash_detail[:3],
            "handovers_cut": len(cut),
            "unscrubbed": len(unscrubbed), "unscrubbed_detail": unscrubbed[:5],
            "fds": [fds0, fds1], "rss": [rss0, rss1],
        }
        result["ok"] = (not lost and crashes == 0 and not tally.failed and not unscrubbed
                        and abs(fds1 - fds0) <= max(1, RESOURCE_SLACK * fds0)
                        and rss1 <= rss0 * (1 + RESOURCE_SLACK))
        return result
    finally:
        for c in clients:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.communicate()
        daemon.close()


def _counts(by: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(by.items()))


def report(r: dict[str, Any]) -> str:
    served = sum(r["clients_served"].values())
    started = sum(r["clients_started"].values())
    rows = [
        ("run", f"{r['seconds']:.0f} s on {r['gpus']} simulated GPUs, "
                f"{len(r['restarts'])} restarts ("
                + ", ".join(f"{how}: {gap:.1f} s down" for how, gap in r["restarts"]) + ")", ""),
        ("clients started", f"{started} ({_counts(r['clients_started'])})", ""),
        ("clients served", f"{served} of {started - r['clients_killed']} not killed", "all"),
        ("clients failed", str(len(r["clients_failed"])), "0"),
        ("clients SIGKILLed", str(r["clients_killed"]), ""),
        ("data verified bit-exact", f"{r['verified_bytes'] / (1 << 30):.2f} GiB", ""),
        ("lease records", f"{r['leases']} ({_counts(r['lease_ends'])})", ""),
        ("leases lost", str(r["leases_lost"]), "0"),
        ("hand-overs cut by a SIGKILL", f"{r['handovers_cut']} (the client connected again and "
         "was served)", ""),
        ("leases not scrubbed after", str(r["unscrubbed"]), "0"),
        ("worker crashes", str(r["worker_crashes"]), "0"),
        ("gpupoold fds idle start -> end", f"{r['fds'][0]} -> {r['fds'][1]}", "within 10 %"),
        ("gpupoold memory idle start -> end",
         f"{r['rss'][0] / MIB:.1f} -> {r['rss'][1] / MIB:.1f} MiB", "within 10 %"),
        ("result", "PASS" if r["ok"] else "FAIL", ""),
    ]
    text = benchlib.text_table(("check", "measured", "target"), rows)
    for line in r["clients_failed"][:10]:
        text += f"\nfailed: {line}"
    for rec in r["lost_detail"]:
        text += f"\nlost lease {rec['id']}: {rec['end_reason']}: {rec['end_detail']}"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    result = run(args)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
