#!/usr/bin/env python3
"""Checks only a real GPU can answer, for scripts/gpu-validation.sh (docs/validation.md).

    python bench/gpu_checks.py sandbox --cuda-dir DIR [--program NAME=COMMAND ...] [--json PATH]
    python bench/gpu_checks.py detach [--sizes 1G,8G] [--json PATH]
    python bench/gpu_checks.py busy [--seconds 6] [--json PATH]
    python bench/gpu_checks.py ... --dry-run     # print what would run, run nothing

Each starts its own gpupoold on the real GPU 0 (benchlib.Daemon(real=True): reset policy never,
its clients pinned to its identity) and stops it at the end, so the script's own gpupoold must
not be running meanwhile (its scrub would take the other daemon's worker for a leftover).

- sandbox: the worker's Landlock sandbox (worker_sandbox = true, the default; worker/sandbox.c)
  against the real driver: a PTX module JIT-compiled at its first load (tests/cuda/modules with
  its PTX image), the VMM program, PyTorch's cuBLAS/cuBLASLt handles made after the session
  started (lazy libraries) and a Triton kernel (PTX JIT through the driver). Any failure, or a
  worker line with `sandbox:`/`Permission denied`/`EACCES` in gpupoold's log, and the failing
  programs run again under worker_sandbox = false: the verdict says whether the sandbox is the
  cause. Exit 1 when the sandbox breaks the driver.
- detach: idle detach with the real driver's process checkpoint. Natively first (no gpupoold
  yet) the host-to-device copy rate of pinned memory; then for each size a PyTorch process
  through gpupool fills that much device memory with seeded random int32, goes idle, is detached
  (idle_detach_after 1 s, policy always); a second client uses the GPU meanwhile; then the first
  calls again: its first call is the reattach time, and its tensors must be bit-exact. Target
  printed per size: reattach <= 20 ms + 2 x the state's host-to-device copy time.
- busy: gpupool's busy seconds (`gpupool_gpu_busy_seconds` on /metrics) for one lease of a
  PyTorch loop (busy, idle, busy) against `nvidia-smi dmon -s u` samples over the same window
  (issue 33). A measurement: exit 1 only when either side has no data.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, Daemon  # noqa: E402

GIB = 1 << 30
# Set by scripts/gpu-validation.sh when its sandbox step found that the sandbox breaks the
# driver: the later checks run without it, to tell about everything else.
SANDBOX_OFF = "worker_sandbox = false\n" if os.environ.get("GPUPOOL_VALIDATION_SANDBOX_OFF") == "1" else ""
REATTACH_BASE_MS = 20.0
SANDBOX_SIGNS = re.compile(r"sandbox:|Permission denied|EACCES", re.I)

# A PyTorch tenant for the detach check: fills SIZE bytes, says `ready`, waits for a line on
# stdin, times its first call, checks its tensors against the same seed, prints one JSON line.
DETACH_CHILD = r"""
import json, sys, time, torch
size = int(sys.argv[1])
piece = min(size, 1 << 30)  # tensors of 1 GiB at most: no index past 2**31 elements
g = torch.Generator(device="cuda")
def fill(i):
    g.manual_seed(31 + i)
    return torch.randint(-2**31, 2**31 - 1, (piece // 4,), dtype=torch.int32, device="cuda", generator=g)
tensors = [fill(i) for i in range(size // piece)]
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
first = int(tensors[0][:1].sum().item())  # the first call after idling: a kernel and its result
reattach_ms = (time.perf_counter() - t0) * 1000
exact = all(torch.equal(t, fill(i)) for i, t in enumerate(tensors))
print(json.dumps({"reattach_ms": reattach_ms, "bit_exact": exact, "first": first}), flush=True)
"""

# The client that uses the GPU while the first one is detached.
OTHER_CHILD = r"""
import torch
a = torch.ones(1024, 1024, device="cuda")
s = float((a @ a).sum().item())
assert s == 1024.0 ** 3, s
print("PASS other client", s)
"""

# The busy check's load: BUSY seconds of matmuls, BUSY of nothing, BUSY of matmuls.
BUSY_CHILD = r"""
import sys, time, torch
busy = float(sys.argv[1])
a = torch.randn(4096, 4096, device="cuda")
def work(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a.copy_(torch.tanh(a @ a))
        torch.cuda.synchronize()
work(busy); time.sleep(busy); work(busy)
print("PASS busy load")
"""

NATIVE_H2D = r"""
import json, time, torch
h = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
d = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
best = float("inf")
for _ in range(3):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    d.copy_(h, non_blocking=True); torch.cuda.synchronize()
    best = min(best, time.perf_counter() - t0)
print(json.dumps({"h2d_gib_s": 1 / best}))
"""


def log(msg: str) -> None:
    print(f"[gpu-checks] {msg}", flush=True)


def size_arg(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": GIB}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG") or 0) * mult)


def run(cmd: list[str], env: dict[str, str] | None, timeout: float) -> tuple[bool, str]:
    try:
        p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return False, f"timed out after {timeout:.0f} s\n{e.stdout or ''}{e.stderr or ''}"
    out = p.stdout + p.stderr
    return p.returncode == 0 and "PASS" in (p.stdout.strip().splitlines() or [""])[-1], out


def metrics_text(d: Daemon) -> str:
    req = urllib.request.Request(f"http://{d.http}/metrics", headers={"Authorization": f"Bearer {d.admin}"})
    with urllib.request.urlopen(req, timeout=30) as reply:
        return reply.read().decode()


def busy_seconds(text: str, gpu: int = 0) -> float | None:
    m = re.search(rf'^gpupool_gpu_busy_seconds_total{{gpu="{gpu}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def dmon_sm_seconds(text: str) -> tuple[float, int]:
    """`nvidia-smi dmon -s u` lines (gpu sm mem enc dec ...): the sm% samples of GPU 0 summed as
    busy seconds at one sample a second, and how many samples there were."""
    total, n = 0.0, 0
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 2 and f[0] == "0" and f[1].replace(".", "", 1).isdigit():
            total += float(f[1]) / 100
            n += 1
    return total, n


def wait_for(what: str, cond: Any, timeout: float) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def close(d: Daemon, timeout: float = 10) -> None:
    """Stop the check's gpupoold and its workers, then wait until no process holds the GPU: the
    next gpupoold (the next check, or the script's) would take a dying worker for a leftover of
    a lease and quarantine the GPU. nvidia-smi only reads (--query-compute-apps)."""
    d.close()
    smi = shutil.which("nvidia-smi")
    end = time.monotonic() + timeout
    while smi is not None and time.monotonic() < end:
        apps = subprocess.run([smi, "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
        if apps.returncode != 0 or not apps.stdout.strip():
            return
        time.sleep(0.2)
    log(f"processes still on the GPU {timeout:.0f} s after gpupoold stopped: the next daemon may quarantine it")


def sandbox_programs(cuda_dir: Path) -> list[tuple[str, list[str]]]:
    py = sys.executable
    mod = cuda_dir / "modules"
    return [
        ("cuda-modules (PTX JIT)", [str(mod), f"{mod}.cubin", f"{mod}.fatbin", f"{mod}.ptx"]),
        ("cuda-vmm", [str(cuda_dir / "vmm")]),
        ("torch-blas_init (lazy cuBLAS/cuBLASLt)", [py, "tests/torch_scripts/blas_init.py"]),
        ("torch-triton_probe (PTX JIT)", [py, "tests/torch_scripts/triton_probe.py"]),
    ]


def sandbox_round(config: str, programs: list[tuple[str, list[str]]], limit: float,
                  simulated: bool = False) -> dict[str, Any]:
    d = Daemon(1, real=not simulated, config=config, name="sandbox")
    results: dict[str, Any] = {}
    try:
        for name, cmd in programs:
            ok, out = run(cmd, d.client_env(), limit)
            results[name] = {"ok": ok, "tail": out.strip().splitlines()[-3:]}
            log(f"  {name}: {'ok' if ok else 'FAILED'}: {(out.strip().splitlines() or [''])[-1][:150]}")
        signs = [ln for ln in d.log_path.read_text(errors="replace").splitlines() if SANDBOX_SIGNS.search(ln)]
    finally:
        close(d)
    return {"programs": results, "log_signs": signs[:20]}


def cmd_sandbox(args: argparse.Namespace) -> int:
    programs = sandbox_programs(args.cuda_dir)
    if args.program:  # NAME=COMMAND: these instead (a program to re-check on its own)
        programs = [(name, shlex.split(cmd)) for name, _, cmd in (p.partition("=") for p in args.program)]
    if args.dry_run:
        for name, cmd in programs:
            print(f"  sandbox: {name}: {' '.join(cmd)} (worker_sandbox = true; again with false if it fails)")
        return 0
    log("worker_sandbox = true (the default): the real driver inside worker/sandbox.c's Landlock rules")
    on = sandbox_round("", programs, args.limit, args.simulated)
    failed = [n for n, r in on["programs"].items() if not r["ok"]]
    result: dict[str, Any] = {"sandbox_on": on}
    for line in on["log_signs"]:
        log(f"  gpupoold log: {line[:200]}")
    if not failed and not on["log_signs"]:
        verdict = "the sandbox lets the real driver work (every program passed, no denial in gpupoold's log)"
        code = 0
    else:
        again = [p for p in programs if p[0] in failed] or programs
        log(f"worker_sandbox = false: again {', '.join(n for n, _ in again)}")
        off = sandbox_round("worker_sandbox = false\n", again, args.limit, args.simulated)
        result["sandbox_off"] = off
        fixed = [n for n in failed if off["programs"].get(n, {}).get("ok")]
        if fixed:
            verdict = (f"THE SANDBOX BREAKS THE DRIVER: {', '.join(fixed)} fail with worker_sandbox = true and "
                       "pass with false; find the paths (strace -f -e trace=%file on the worker), add them to "
                       "worker/sandbox.c and docs/security.md; operators set worker_sandbox = false meanwhile")
            code = 1
        elif failed:
            verdict = (f"{', '.join(failed)} fail with and without the sandbox: not the sandbox's doing "
                       "(see the programs' output)")
            code = 1
        else:
            verdict = ("every program passed, but gpupoold's log shows denials (above): the driver was refused "
                       "a path it then did without; list them in docs/validation.md")
            code = 0
    result["verdict"] = verdict
    print(f"sandbox: {verdict}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return code


DETACH_CONFIG = 'idle_detach_after = 1.0\ndetach_policy = "always"\n'


def detach_round(d: Daemon, size: int, limit: float) -> dict[str, Any]:
    env = d.client_env()
    errors = tempfile.TemporaryFile("w+")  # a file, not a pipe: nobody reads it while the tenant idles
    tenant = subprocess.Popen([sys.executable, "-c", DETACH_CHILD, str(size)], env=env, cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True)

    def stderr_tail() -> str:
        errors.seek(0)
        return errors.read()[-2000:]

    try:
        assert tenant.stdout is not None and tenant.stdin is not None
        seen = []  # anything a library prints before the tenant is ready
        for line in tenant.stdout:
            if line.strip() == "ready":
                break
            seen.append(line)
        else:
            tenant.kill()
            tenant.wait(10)
            raise RuntimeError(f"the tenant did not start: {''.join(seen)[-1000:]}{stderr_tail()}")

        def lease() -> dict[str, Any] | None:
            leases = d.get("/api/v1/leases?state=active")["leases"]
            return leases[0] if leases else None

        t0 = time.monotonic()
        # 1 s idle, then a checkpoint of at most 8 GiB: a detach that has not happened in 30 s
        # will not (the checkpoint failed or is refused here), and the step's time is short.
        wait_for("the detach", lambda: (lease() or {}).get("detach", {}).get("state") == "detached", 30)
        log(f"  detached {time.monotonic() - t0:.1f} s after ready")
        lease_id = (lease() or {})["id"]
        ok, out = run([sys.executable, "-c", OTHER_CHILD], env, limit)  # the GPU used meanwhile
        log(f"  second client while detached: {'ok' if ok else 'FAILED'}: {out.strip().splitlines()[-1:]}")
        d.wait_quiet(limit)
        tenant.stdin.write("go\n")
        tenant.stdin.flush()
        reply, _ = tenant.communicate(timeout=limit)
        if tenant.returncode != 0 or not reply.strip():
            raise RuntimeError(f"the tenant failed after reattach (exit {tenant.returncode}): {stderr_tail()}")
        row = json.loads(reply.strip().splitlines()[-1])
        events = d.get(f"/api/v1/leases/{lease_id}")["events"]
        saved = [float(e["detail"].split("saved in ")[1].split(" s")[0])
                 for e in events if e["state"] == "detached" and "saved in " in e.get("detail", "")]
        row.update(size=size, detach_s=saved[0] if saved else None, other_client_ok=ok)
        return row
    finally:
        if tenant.poll() is None:
            tenant.kill()
        errors.close()


def detach_without_sandbox(d: Daemon, size: int, limit: float) -> dict[str, Any]:
    """After a failed round: the same with worker_sandbox = false, to tell whether the sandbox
    (Landlock, or the worker not being dumpable, which cuCheckpointProcess* may need) is the
    cause. The failed round's gpupoold is stopped first."""
    close(d)
    log(f"  again with worker_sandbox = false ({size / GIB:g} GiB)")
    d2 = Daemon(1, real=True, config=DETACH_CONFIG + "worker_sandbox = false\n", name="detach-nosandbox")
    try:
        row = detach_round(d2, size, limit)
        print(f"detach {size / GIB:g} GiB works with worker_sandbox = false (reattach {row['reattach_ms']:.0f} ms, "
              f"bit-exact {row['bit_exact']}): THE SANDBOX BREAKS THE CHECKPOINT", flush=True)
        row["sandbox"] = False
        return row
    except (RuntimeError, subprocess.TimeoutExpired, KeyError) as e:
        print(f"detach {size / GIB:g} GiB fails with worker_sandbox = false too: not the sandbox ({e})"[:600],
              flush=True)
        return {"size": size, "sandbox": False, "error": str(e)[:2000]}
    finally:
        close(d2)


def cmd_detach(args: argparse.Namespace) -> int:
    sizes = [size_arg(s) for s in args.sizes.split(",")]
    if args.dry_run:
        print(f"  detach: native H2D rate; then sizes {args.sizes}: tenant idle -> detached "
              "(idle_detach_after 1 s, policy always) -> a second client -> reattach, bit-exact")
        return 0
    ok, out = run([sys.executable, "-c", NATIVE_H2D + "\nprint('PASS')"], None, args.limit)
    if not ok:
        print(f"detach: the native host-to-device copy failed:\n{out[-2000:]}")
        return 1
    rate = json.loads(out.strip().splitlines()[0])["h2d_gib_s"]
    log(f"native host-to-device (pinned, 1 GiB): {rate:.1f} GiB/s")
    d = Daemon(1, real=True, config=DETACH_CONFIG + SANDBOX_OFF, name="detach")
    rows: list[dict[str, Any]] = []
    code = 0
    try:
        for size in sizes:
            log(f"{size / GIB:g} GiB of tensors")
            try:
                row = detach_round(d, size, args.limit)
            except (RuntimeError, subprocess.TimeoutExpired, KeyError) as e:
                log(f"  FAILED: {e}")
                tail = [ln for ln in d.log_path.read_text(errors="replace").splitlines()
                        if re.search(r"checkpoint|detach|restore", ln, re.I)][-10:]
                for ln in tail:
                    log(f"  gpupoold log: {ln[:200]}")
                rows.append({"size": size, "error": str(e)[:2000]})
                code = 1
                log("  the larger sizes are not tried: the same failure would take their time too")
                if not SANDBOX_OFF:
                    rows.append(detach_without_sandbox(d, size, args.limit))
                break
            target = REATTACH_BASE_MS + 2 * (size / GIB) / rate * 1000
            row["target_ms"] = target
            met = row["reattach_ms"] <= target
            detach = f"{row['detach_s'] * 1000:.0f} ms" if row.get("detach_s") is not None else "?"
            print(f"detach {size / GIB:g} GiB: detach {detach}, reattach {row['reattach_ms']:.0f} ms "
                  f"(target <= {target:.0f} ms = 20 ms + 2 x {size / GIB:g} GiB / {rate:.1f} GiB/s: "
                  f"{'met' if met else 'MISSED'}), tensors {'bit-exact' if row['bit_exact'] else 'DIFFERENT'}, "
                  f"second client {'ok' if row['other_client_ok'] else 'FAILED'}", flush=True)
            if not (row["bit_exact"] and row["other_client_ok"]):
                code = 1
            rows.append(row)
    finally:
        close(d)
    if args.json:
        args.json.write_text(json.dumps({"h2d_gib_s": rate, "rounds": rows}, indent=2))
    return code


def cmd_busy(args: argparse.Namespace) -> int:
    if args.dry_run:
        print(f"  busy: a PyTorch loop ({args.seconds:g} s busy, idle, busy) through gpupool; "
              "gpupool_gpu_busy_seconds vs nvidia-smi dmon -s u over the same window")
        return 0
    smi = shutil.which("nvidia-smi")
    if smi is None:
        print("busy: nvidia-smi is not here: nothing to compare with")
        return 1
    d = Daemon(1, real=True, config=SANDBOX_OFF, name="busy")
    try:
        before = busy_seconds(metrics_text(d))
        dmon = subprocess.Popen([smi, "dmon", "-s", "u", "-d", "1"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        t0 = time.monotonic()
        ok, out = run([sys.executable, "-c", BUSY_CHILD, str(args.seconds)], d.client_env(), args.limit)
        d.wait_quiet(args.limit)  # the lease ended: its time is counted
        window = time.monotonic() - t0
        dmon.terminate()
        text, _ = dmon.communicate(timeout=10)
        after = busy_seconds(metrics_text(d))
    finally:
        close(d)
    smi_busy, samples = dmon_sm_seconds(text)
    gp_busy = (after - before) if after is not None and before is not None else (after or None)
    print(f"busy: gpupool {gp_busy if gp_busy is None else f'{gp_busy:.1f}'} s, nvidia-smi dmon sm% "
          f"{smi_busy:.1f} s ({samples} samples over {window:.0f} s); load {'ok' if ok else 'FAILED'}", flush=True)
    if gp_busy is not None and smi_busy > 0:
        print(f"busy: gpupool / nvidia-smi = {gp_busy / smi_busy:.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"gpupool_busy_s": gp_busy, "smi_busy_s": smi_busy, "samples": samples,
                                         "window_s": window, "load_ok": ok, "dmon": text[-4000:]}, indent=2))
    return 0 if ok and gp_busy is not None and samples > 0 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="check", required=True)
    for name in ("sandbox", "detach", "busy"):
        p = sub.add_parser(name)
        p.add_argument("--json", type=Path, help="write the results as JSON here")
        p.add_argument("--dry-run", action="store_true", help="print what would run; run nothing")
        p.add_argument("--limit", type=float, default=90.0, help="seconds one program or wait may take")
        if name == "sandbox":
            p.add_argument("--cuda-dir", type=Path, required=True, help="the compiled tests/cuda programs")
            p.add_argument("--program", action="append", metavar="NAME=COMMAND",
                           help="run this instead of the default programs (repeatable): one to re-check alone")
            # Only for tests/test_gpu_validation_steps.py: the machinery against a simulated GPU.
            p.add_argument("--simulated", action="store_true", help=argparse.SUPPRESS)
        if name == "detach":
            p.add_argument("--sizes", default="1G,8G", help="device state of each round (default 1G,8G)")
        if name == "busy":
            p.add_argument("--seconds", type=float, default=6.0, help="each busy (and the idle) phase")
    args = ap.parse_args()
    return {"sandbox": cmd_sandbox, "detach": cmd_detach, "busy": cmd_busy}[args.check](args)


if __name__ == "__main__":
    sys.exit(main())
