#!/usr/bin/env python3
"""Idle detach, measured (docs/architecture.md, "Idle detach"; docs/benchmarks.md).

    python bench/detach_bench.py [--sizes 0,64M,1G] [--repeat 3] [--notebooks 4] [--cycles 3]
                                 [--busy-ms 400] [--idle-ms 1600] [--markdown PATH]

On one simulated GPU over loopback (the native build in build/):

1. Detach and reattach, for each size of device state: a tenant (bench/detach_client.c) holds
   that much memory with a pattern and idles; gpupoold (idle_detach_after 0.3 s, policy always)
   detaches it; then one call (cuCtxSynchronize) is timed from the client, which is the reattach
   latency as a program sees it: its first call after idling to its reply. The detach time is
   gpupoold's (lock and checkpoint, from the lease's events). Next to them, the host's raw copy
   rate measured in the same run (memmove of 256 MiB, best of 3, into memory already touched and
   into new memory; the second is the reference, since a restore writes into pages allocated for
   it), and the targets: reattach with no device memory within 20 ms; with state, within 2x the
   time to copy it at the reference rate + 20 ms.
   The data is checked after the last round.
2. Utilisation: --notebooks clients like notebooks (--cycles times: --busy-ms of copies, then
   --idle-ms of nothing) on the one GPU, with idle detach (when-queued, 0.5 s) and without
   (idle_detach_after = 0: the first client keeps the GPU until it exits). Prints the wall time
   for all to finish, when each first got to work, and the share of the GPU's time that went to
   a client doing work.

Exits 1 when a target is missed or data came back different.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from benchlib import BUILD, ROOT, Daemon  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
TARGET_EMPTY_MS = 20.0


def log(msg: str) -> None:
    print(f"[detach] {msg}", file=sys.stderr, flush=True)


def size_arg(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": MIB, "G": GIB}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG") or 0) * mult)


def human(n: int) -> str:
    return f"{n / GIB:g} GiB" if n >= GIB else f"{n / MIB:g} MiB" if n >= MIB else f"{n} B"


def build_client() -> Path:
    out = BUILD / "bench" / "detach_client"
    src = ROOT / "bench" / "detach_client.c"
    shim = BUILD / "client" / "libcuda.so.1"
    if not out.exists() or out.stat().st_mtime < max(src.stat().st_mtime, shim.stat().st_mtime):
        out.parent.mkdir(parents=True, exist_ok=True)
        inc = next((p for p in ("/usr/local/cuda/include", "/usr/include") if
                    Path(p, "cuda.h").exists()), None)
        if inc is None:
            sys.exit("detach_bench: cuda.h (the CUDA toolkit) is needed to build the client")
        subprocess.run([os.environ.get("CC", "cc"), "-std=c11", "-O2", "-Wall", f"-I{inc}", "-o",
                        str(out), str(src), str(shim)], check=True)
    return out


def raw_copy_rates() -> tuple[float, float]:
    """Bytes per second of memmove of 256 MiB, best of 3: into memory already touched (hot), and
    into memory mapped just before (first touch: the pages are allocated as they are written, as
    a restore's are: the simulated GPU's memory file gets new pages)."""
    n = 256 * MIB
    src = (ctypes.c_char * n)()
    dst = (ctypes.c_char * n)()
    ctypes.memset(src, 1, n)
    ctypes.memmove(dst, src, n)
    hot = cold = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        ctypes.memmove(dst, src, n)
        hot = min(hot, time.perf_counter() - t0)
        fresh = mmap.mmap(-1, n)
        t0 = time.perf_counter()
        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(fresh)), src, n)
        cold = min(cold, time.perf_counter() - t0)
        fresh.close()
    return n / hot, n / cold


def active_lease(d: Daemon) -> dict[str, Any] | None:
    leases = d.get("/api/v1/leases?state=active")["leases"]
    return leases[0] if leases else None


def wait_for(what: str, cond: Any, timeout: float = 60) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    sys.exit(f"detach_bench: timed out waiting for {what}")


def reattach_rounds(d: Daemon, client: Path, size: int, repeat: int) -> dict[str, Any]:
    proc = subprocess.Popen([str(client), str(size), "reattach"], env=d.client_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if proc.stdout.readline().strip() != "ready":
            sys.exit("detach_bench: the client did not start")
        lease_id = wait_for("the lease", lambda: (active_lease(d) or {}).get("id"))
        calls = []
        for _ in range(repeat):
            wait_for("a detach", lambda: (active_lease(d) or {}).get("detach", {}).get(
                "state") == "detached")
            proc.stdin.write("call\n")
            proc.stdin.flush()
            calls.append(float(proc.stdout.readline().split("=")[1]))
        proc.stdin.write("verify\n")
        proc.stdin.flush()
        verified = proc.stdout.readline().strip() == "verify=ok"
        events = d.get(f"/api/v1/leases/{lease_id}")["events"]
        detach_s = [float(e["detail"].split("saved in ")[1].split(" s")[0])
                    for e in events if e["state"] == "detached"]
        return {"size": size, "reattach_ms": statistics.median(calls), "calls": calls,
                "detach_s": statistics.median(detach_s) if detach_s else float("nan"),
                "verified": verified}
    finally:
        proc.stdin.close()
        proc.wait(60)


def notebooks(client: Path, n: int, cycles: int, busy_ms: int, idle_ms: int,
              detach: bool) -> dict[str, Any]:
    config = ('idle_detach_after = 0.5\ndetach_policy = "when-queued"\n' if detach
              else "idle_detach_after = 0\n")
    d = Daemon(1, config=config, name="detach-util")
    try:
        d.wait_quiet()
        t0 = time.monotonic()
        procs = [subprocess.Popen([str(client), str(64 * MIB), "notebook", str(cycles),
                                   str(busy_ms), str(idle_ms)], env=d.client_env(),
                                  stdout=subprocess.PIPE, text=True) for _ in range(n)]
        first_work: list[float | None] = [None] * n
        busy: list[float] = [0.0] * n
        ok = [False] * n

        def follow(i: int, p: subprocess.Popen[str]) -> None:
            assert p.stdout is not None
            for line in p.stdout:
                if line.startswith("cycle="):
                    if first_work[i] is None:
                        first_work[i] = time.monotonic() - t0
                    busy[i] += float(line.split("busy_s=")[1])
                elif line.startswith("verify="):
                    ok[i] = line.strip() == "verify=ok"

        threads = [threading.Thread(target=follow, args=(i, p)) for i, p in enumerate(procs)]
        for t in threads:
            t.start()
        for p in procs:
            p.wait(cycles * (busy_ms + idle_ms) / 1000 * n + 300)
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        detaches = sum(1 for lease in d.get("/api/v1/leases?state=all&limit=100")["leases"]
                       for _ in range(lease.get("detaches") or 0))
        return {"detach": detach, "wall_s": wall, "busy_s": sum(busy), "share": sum(busy) / wall,
                "first_work_s": first_work, "verified": all(ok), "detaches": detaches,
                "failed": [i for i, p in enumerate(procs) if p.returncode != 0]}
    finally:
        d.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0,64M,1G")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--notebooks", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--busy-ms", type=int, default=400)
    ap.add_argument("--idle-ms", type=int, default=1600)
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args()
    client = build_client()
    hot, rate = raw_copy_rates()
    log(f"raw host copy rate: {hot / 1e9:.2f} GB/s into touched memory, {rate / 1e9:.2f} GB/s "
        "into new memory (the reference)")
    failed = False
    rows = []
    d = Daemon(1, config='idle_detach_after = 0.3\ndetach_policy = "always"\n', name="detach")
    try:
        d.wait_quiet()
        for size in [size_arg(s) for s in args.sizes.split(",")]:
            log(f"{human(size)} of device state: {args.repeat} detaches and reattaches")
            r = reattach_rounds(d, client, size, args.repeat)
            copy_ms = size / rate * 1000
            target = TARGET_EMPTY_MS if size == 0 else 2 * copy_ms + TARGET_EMPTY_MS
            met = r["reattach_ms"] <= target and r["verified"]
            failed |= not met
            rows.append((human(size), f"{r['detach_s'] * 1000:.1f} ms", f"{r['reattach_ms']:.1f} ms",
                         f"{copy_ms:.1f} ms", f"<= {target:.1f} ms",
                         "yes" if r["verified"] else "NO", "met" if met else "MISSED"))
    finally:
        d.close()
    head = ("device state", "detach (median)", "reattach: first call (median)",
            "copy at the raw rate", "target", "bit-exact", "result")
    print(benchlib.text_table(head, rows))
    util = [notebooks(client, args.notebooks, args.cycles, args.busy_ms, args.idle_ms, detach)
            for detach in (False, True)] if args.notebooks > 0 else []
    urows = []
    for u in util:
        failed |= not u["verified"] or bool(u["failed"])
        urows.append(("idle detach" if u["detach"] else "no detach", f"{u['wall_s']:.1f} s",
                      ", ".join(f"{x:.1f}" if x is not None else "never" for x in u["first_work_s"]),
                      f"{u['busy_s']:.1f} s", f"{100 * u['share']:.0f} %", str(u["detaches"])))
    uhead = ("run", "all done after", "each first worked at (s)", "busy GPU time",
             "share of GPU time to a busy client", "detaches")
    print()
    print(f"{args.notebooks} notebook-like clients on 1 GPU, each {args.cycles} x "
          f"({args.busy_ms} ms of copies, {args.idle_ms} ms idle):")
    print(benchlib.text_table(uhead, urows))
    lines = [f"### Idle detach ({time.strftime('%Y-%m-%d')}, {benchlib.cpu_model()}, "
             f"{os.cpu_count()} CPUs, simulated GPU over loopback)", "",
             f"Raw host copy rate (memmove, 256 MiB, best of 3): {hot / 1e9:.2f} GB/s into "
             f"memory already touched, {rate / 1e9:.2f} GB/s into new memory (the reference: a "
             "restore writes into pages allocated for it).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             *("| " + " | ".join(r) + " |" for r in rows), "",
             f"{args.notebooks} notebook-like clients on 1 GPU, each {args.cycles} x "
             f"({args.busy_ms} ms of copies, {args.idle_ms} ms idle):", "",
             "| " + " | ".join(uhead) + " |", "|" + "---|" * len(uhead),
             *("| " + " | ".join(r) + " |" for r in urows)]
    benchlib.emit_markdown(lines, args.markdown)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
