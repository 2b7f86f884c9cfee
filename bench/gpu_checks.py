#!/usr/bin/env python3
"""Checks only a real GPU can answer, for scripts/gpu-validation.sh (docs/validation.md).

    python bench/gpu_checks.py sandbox --cuda-dir DIR [--program NAME=COMMAND ...] [--json PATH]
    python bench/gpu_checks.py detach [--sizes 1G,8G] [--json PATH]
    python bench/gpu_checks.py busy [--seconds 6] [--json PATH]
    python bench/gpu_checks.py shares [--tenants 4] [--memory 16G] [--seconds 3] [--json PATH]
    python bench/gpu_checks.py ipc [--memory 8G] [--ipc-share build/tests/ipc_share] [--json PATH]
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
- shares (issue 32): gpupoold with `share = 4` on GPU 0. A PyTorch tenant's fixed matmul loop
  alone through gpupool (a share alone on the GPU: the reference, in the same run), then four
  tenants with GPUPOOL_MEMORY=16G at once (gpupoold must show four shares of that quota): each's
  loops a second against alone (a fair share is 1/4; printed, not judged), and each must see
  its quota as the GPU's total (torch.cuda.mem_get_info, total_memory) and get OutOfMemoryError
  past it. Then the zero-after-free check: a neighbour keeps the GPU shared (no whole scrub
  between tenants), a tenant fills every byte its quota gets with 0xAB and is SIGKILLed, and a
  tenant asking for all the room left reads every byte it gets: only zeros. Exit 1 on a wrong
  quota, no OOM, fewer than four shares at once, or a non-zero byte.
- ipc (issue 37, the single-GPU paths): gpupoold with `share = 2`; two processes of one token
  (each its own lease and worker on GPU 0) pass a CUDA tensor with torch.multiprocessing (CUDA
  IPC memory and event handles), bit-exact both ways; with --ipc-share, tests/c/ipc_share's
  export, import and stranger (another token refused); then a 1-GPU lease through the multi-GPU
  code path (GPUPOOL_GPUS=1 named) runs a small PyTorch job. Exit 1 on any failure.

--simulated (shares, ipc, sandbox): against a simulated GPU, for scripts/gpu-validation.sh --smoke
and the tests: no PyTorch kernel runs there, so the loops and fills are copies.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
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
    if smi is None:  # the simulated GPU (--simulated): no driver to ask
        return
    end = time.monotonic() + timeout
    while time.monotonic() < end:
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


# ------------------------------------------------------------------------------ shares (issue 32)
# A tenant of a shared GPU. Modes:
#   load QUOTA SECONDS KERNELS   checks its quota (torch.cuda.mem_get_info total, the device's
#                                total_memory, a tensor past it raises OutOfMemoryError), says
#                                `ready`, waits for a line, runs a fixed loop for SECONDS and
#                                prints one JSON line (loops a second); the loop is a 4096^2
#                                matmul on a real GPU, a 16 MiB copy there and back on the
#                                simulated one (KERNELS 0: it runs no PyTorch kernel)
#   fill CHUNK KERNELS           fills every byte it can get with 0xAB (chunks of CHUNK, halved
#                                past the quota), prints `filled N`, then `ready`, and waits to be killed
#   hold                         a small tensor, `ready`, waits for a line (keeps the GPU shared)
#   read CHUNK KERNELS           allocates every byte it can get and counts the non-zero ones
SHARE_CHILD = r"""
import json, sys, time, torch
mode = sys.argv[1]
MIB = 1 << 20

def grab(chunk, each):
    # Tensors of `chunk` bytes until the quota (or the GPU) refuses one, then halves down to 2 MiB.
    # A reduction's own scratch memory may find no room once nearly every byte is taken: the
    # tensor it was for is given back and the grab ends there (that tensor is not counted).
    got, size = [], chunk
    while size >= 2 * MIB:
        try:
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            size //= 2
            continue
        try:
            each(t)
        except torch.cuda.OutOfMemoryError:
            del t
            break
        got.append(t)
    torch.cuda.synchronize()
    return got

if mode == "load":
    quota, seconds, kernels = int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
    free, total = torch.cuda.mem_get_info(0)
    props = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(free + 2 * MIB, dtype=torch.uint8, device="cuda")
        oom = False
    except torch.cuda.OutOfMemoryError:
        oom = True
    if kernels:
        a = torch.randn(4096, 4096, device="cuda")
        def step():
            a.copy_(torch.tanh(a @ a))
        flop = 2 * 4096 ** 3
    else:
        host = torch.arange(16 * MIB, dtype=torch.int32).to(torch.uint8)
        dev = torch.empty(16 * MIB, dtype=torch.uint8, device="cuda")
        def step():
            dev.copy_(host)
            host.copy_(dev)
        flop = 0
    step(); torch.cuda.synchronize()  # warm: cuBLAS handle, first launch
    print("ready", flush=True)
    sys.stdin.readline()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        n += 10
    dt = time.perf_counter() - t0
    print(json.dumps({"quota": quota, "mem_get_info_total": total, "total_memory": props, "oom_past_quota": oom,
                      "loops": n, "seconds": dt, "loops_per_s": n / dt, "tflops": n * flop / dt / 1e12}), flush=True)
elif mode == "fill":
    chunk, kernels = int(sys.argv[2]), sys.argv[3] == "1"
    pattern = None if kernels else torch.full((chunk,), 0xAB, dtype=torch.uint8)  # the copies' source
    got = grab(chunk, (lambda t: t.fill_(0xAB)) if kernels else (lambda t: t.copy_(pattern[: t.numel()])))
    print(f"filled {sum(t.numel() for t in got)}", flush=True)
    print("ready", flush=True)
    time.sleep(3600)
elif mode == "hold":
    keep = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.readline()
else:  # read
    chunk, kernels = int(sys.argv[2]), sys.argv[3] == "1"
    nonzero = []
    def count(t):
        if not kernels:
            nonzero.append(int(t.cpu().count_nonzero()))
            return
        # max first: a reduction with no tensor-sized temporary (count_nonzero makes one), so it
        # runs with the GPU nearly full; the exact count only when a byte is not zero.
        if int(t.max()) == 0:
            nonzero.append(0)
            return
        try:
            nonzero.append(int(torch.count_nonzero(t)))
        except torch.cuda.OutOfMemoryError:
            nonzero.append(1)  # at least one; no room to count them all
    got = grab(chunk, count)
    print(json.dumps({"read": sum(t.numel() for t in got), "nonzero": sum(nonzero)}), flush=True)
"""


class Tenant:
    """A child Python process through gpupool whose stdout lines arrive on a queue (so a wait
    for `ready` has a deadline); stderr goes to a file, read when it fails."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.errors = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, *args], env=env, cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.errors, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, prefix: str, timeout: float) -> str:
        """The first line starting with `prefix` (a library's own lines before it are skipped)."""
        end = time.monotonic() + timeout
        seen: list[str] = []
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{self.name}: no `{prefix}` line in {timeout:.0f} s: {self.tail(seen)}") from None
            if line is None:
                self.proc.wait(10)
                raise RuntimeError(f"{self.name} exited {self.proc.returncode} before `{prefix}`: {self.tail(seen)}")
            if line.startswith(prefix):
                return line
            seen.append(line)

    def tell(self, line: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def tail(self, seen: list[str]) -> str:
        self.errors.seek(0)
        return ("\n".join(seen[-5:]) + "\n" + self.errors.read()[-1500:]).strip()

    def result(self, timeout: float) -> dict[str, Any]:
        """Its JSON line, after which it must exit 0."""
        row = json.loads(self.expect("{", timeout))
        self.proc.wait(timeout)
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {self.tail([])}")
        return row

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.errors.close()


def share_env(d: Daemon, memory: int) -> dict[str, str]:
    return {**d.client_env(), "GPUPOOL_MEMORY": str(memory)}


def active_leases(d: Daemon) -> list[dict[str, Any]]:
    return list(d.get("/api/v1/leases?state=active")["leases"])


def shares_load(d: Daemon, args: argparse.Namespace, quota: int) -> dict[str, Any]:
    """The loop alone through gpupool (a share alone on the GPU), then four tenants at once."""
    kernels = "0" if args.simulated else "1"
    cmd = ["-c", SHARE_CHILD, "load", str(quota), str(args.seconds), kernels]
    alone = Tenant("the tenant alone", cmd, share_env(d, quota))
    try:
        alone.expect("ready", args.limit)
        alone.tell()
        ref = alone.result(args.seconds + args.limit)
    finally:
        alone.stop()
    log(f"  alone: {ref['loops_per_s']:.1f} loops/s ({ref['tflops']:.1f} TFLOP/s)")
    d.wait_quiet(args.limit)
    tenants = [Tenant(f"tenant {i}", cmd, share_env(d, quota)) for i in range(args.tenants)]
    try:
        for t in tenants:
            t.expect("ready", args.limit)
        gpu = d.get("/api/v1/gpus")["gpus"][0]
        at_once = len((gpu.get("shares") or {}).get("leases") or [])
        quotas = sorted({s["memory_quota"] for s in (gpu.get("shares") or {}).get("leases") or []})
        for t in tenants:
            t.tell()
        rows = [t.result(args.seconds + args.limit) for t in tenants]
    finally:
        for t in tenants:
            t.stop()
    for i, row in enumerate(rows):
        row["of_alone"] = row["loops_per_s"] / ref["loops_per_s"] if ref["loops_per_s"] else None
        log(f"  tenant {i}: {row['loops_per_s']:.1f} loops/s = {row['of_alone']:.2f} of alone; "
            f"mem_get_info total {row['mem_get_info_total']}, OOM past the quota {row['oom_past_quota']}")
    return {"alone": ref, "tenants": rows, "shares_at_once": at_once, "quotas_seen_by_gpupoold": quotas}


def shares_zero(d: Daemon, args: argparse.Namespace, quota: int, chunk: int) -> dict[str, Any]:
    """The isolation pattern: a neighbour keeps the GPU shared (so no whole scrub runs between
    the tenants), a tenant fills what it can with 0xAB and is SIGKILLed, and a tenant asking for
    all the room left reads every byte it can get: only zeros."""
    kernels = "0" if args.simulated else "1"
    total = int(d.get("/api/v1/gpus")["gpus"][0].get("memory_total") or 0)
    small = 64 << 20
    neighbour = Tenant("the neighbour", ["-c", SHARE_CHILD, "hold"], share_env(d, small))
    victim = reader = None
    try:
        neighbour.expect("ready", args.limit)
        victim = Tenant("the 0xAB tenant", ["-c", SHARE_CHILD, "fill", str(chunk), kernels], share_env(d, quota))
        filled = int(victim.expect("filled ", args.limit).split()[1])
        victim.expect("ready", args.limit)
        log(f"  the 0xAB tenant filled {filled / GIB:.2f} GiB of its {quota / GIB:.2f} GiB quota; SIGKILL")
        victim.proc.kill()
        victim.proc.wait(10)
        wait_for("the killed tenant's lease to end", lambda: len(active_leases(d)) == 1, args.limit)
        # All the room the GPU has left beside the neighbour, less a margin for its context: the
        # reader's memory then covers what the killed tenant held, wherever the driver puts it.
        room = total - small - max(chunk, GIB // 2) if total else quota
        reader = Tenant("the reader", ["-c", SHARE_CHILD, "read", str(chunk), kernels], share_env(d, room))
        row = reader.result(args.limit * 2)
    finally:
        for t in (neighbour, victim, reader):
            if t is not None:
                t.stop()
    row.update(filled=filled, reader_quota=room, gpu_memory=total)
    print(f"shares zero: the 0xAB tenant filled {filled / GIB:.2f} GiB and was SIGKILLed; the next tenant "
          f"read {row['read'] / GIB:.2f} GiB: {row['nonzero']} non-zero bytes "
          f"({'only zeros' if row['nonzero'] == 0 else 'LEFT BEHIND'})", flush=True)
    return row


def cmd_shares(args: argparse.Namespace) -> int:
    quota = size_arg(args.memory)
    chunk = min(GIB, quota // 4)
    config = f"share = {args.tenants}\n" + (f"sim_memory_gib = {args.sim_memory_gib}\n" if args.simulated else "")
    if args.dry_run:
        print(f"  shares: gpupoold with {config.strip().replace(chr(10), ', ')}; the loop alone, then "
              f"{args.tenants} PyTorch tenants with GPUPOOL_MEMORY={args.memory} at once ({args.seconds:g} s each); "
              "quota and OOM seen by each; a 0xAB tenant SIGKILLed, the next reads only zeros")
        return 0
    d = Daemon(1, real=not args.simulated, config=config + SANDBOX_OFF, name="shares")
    result: dict[str, Any] = {"quota": quota, "tenants": args.tenants}
    code = 0
    try:
        try:
            load = shares_load(d, args, quota)
            result["load"] = load
            bad = [i for i, r in enumerate(load["tenants"])
                   if not (r["mem_get_info_total"] == quota == r["total_memory"] and r["oom_past_quota"])]
            ratios = [r["of_alone"] for r in load["tenants"]]
            print(f"shares load: {load['shares_at_once']} shares at once; each's loop against alone: "
                  f"{', '.join(f'{x:.2f}' for x in ratios)} (sum {sum(ratios):.2f}; a fair share is "
                  f"{1 / args.tenants:.2f}); quota seen and OOM past it: "
                  f"{'every tenant' if not bad else 'WRONG for tenant ' + ', '.join(map(str, bad))}", flush=True)
            if bad or load["shares_at_once"] != args.tenants or load["quotas_seen_by_gpupoold"] != [quota]:
                code = 1
        except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
            print(f"shares load: FAILED: {e}"[:1500], flush=True)
            result["load_error"] = str(e)[:3000]
            code = 1
        try:
            d.wait_quiet(args.limit)
            zero = shares_zero(d, args, quota, chunk)
            result["zero"] = zero
            if zero["nonzero"] or not zero["filled"]:
                code = 1
        except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
            print(f"shares zero: FAILED: {e}"[:1500], flush=True)
            result["zero_error"] = str(e)[:3000]
            code = 1
    finally:
        close(d)
    print(f"shares: {'PASS' if code == 0 else 'FAIL'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return code


# ------------------------------------------------------------------------------ ipc (issue 37)
# Two processes of one token on the same GPU (share = 2: each its own lease and worker) exchange
# a CUDA tensor with torch.multiprocessing (spawn): PyTorch sends a CUDA IPC memory handle and an
# event handle; the child reads the parent's values bit-exact and writes its own into the same
# memory, which the parent then reads bit-exact. No kernel: the values move by copies only, so
# the simulated GPU runs it too. Written to a file: spawn imports the parent's main module.
IPC_TORCH = r"""
import json, sys, time
import torch
import torch.multiprocessing as mp

N = int(sys.argv[1]) // 4

def values(seed):
    return torch.randint(-2**31, 2**31 - 1, (N,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))

def child(inbox, outbox):
    t = inbox.get()  # opens the parent's memory (cuIpcOpenMemHandle) and waits on its event
    same = torch.equal(t.cpu(), values(1))
    t.copy_(values(2))
    torch.cuda.synchronize()
    outbox.put({"child_read_exact": same, "child_device": str(t.device)})
    inbox.get()  # the parent has read: the memory may go
    del t

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    t = values(1).cuda()
    p = ctx.Process(target=child, args=(inbox, outbox))
    t0 = time.perf_counter()
    p.start()
    inbox.put(t)
    row = outbox.get(timeout=float(sys.argv[2]))
    row["round_s"] = time.perf_counter() - t0
    torch.cuda.synchronize()
    row["parent_read_exact"] = torch.equal(t.cpu(), values(2))
    inbox.put("done")
    p.join(30)
    row["child_exit"] = p.exitcode
    print(json.dumps(row), flush=True)
"""

# A 1-GPU lease through the multi-GPU code path (GPUPOOL_GPUS=1 named): one device; a small job
# (a matmul against the CPU's on a real GPU; copies there and back on the simulated one).
ONE_GPU_JOB = r"""
import json, sys, torch
kernels = sys.argv[1] == "1"
count = torch.cuda.device_count()
first = torch.empty(1, device="cuda")  # the first CUDA call: the lease
print("ready", flush=True)
sys.stdin.readline()
a = torch.randn(512, 512, generator=torch.Generator().manual_seed(5))
if kernels:
    ok = torch.allclose((a.cuda() @ a.cuda()).cpu(), a @ a, rtol=1e-3, atol=1e-2)
else:
    ok = torch.equal(a.cuda().cpu(), a)
print(json.dumps({"device_count": count, "job_ok": bool(ok), "name": torch.cuda.get_device_name(0)}), flush=True)
"""


def ipc_c_program(d: Daemon, exe: Path, memory: int, limit: float) -> dict[str, Any]:
    """tests/c/ipc_share (as tests/test_e2e_ipc.py): export in one process, import in a second of
    the same token, a third of another token refused; each prints PASS."""
    env = share_env(d, memory)
    made = subprocess.run([sys.executable, "-m", "gpupoold", "token", "create", "--name", "ipc-stranger",
                           "--state-dir", str(d.state)], env=d.env, cwd=ROOT, capture_output=True, text=True,
                          check=True)
    stranger_token = made.stdout.strip().splitlines()[-1]
    size = str(1 << 20 | 4093)
    with tempfile.TemporaryDirectory() as tmp:
        handle = str(Path(tmp) / "handle")
        exporter = subprocess.Popen([str(exe), "export", handle, size], env=env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert exporter.stdout is not None
            first = exporter.stdout.readline().strip()
            if first != "READY":
                raise RuntimeError(f"ipc_share export: {first} {exporter.stdout.read()[-1500:]}")
            out = {}
            for mode, token in (("import", d.token), ("stranger", stranger_token)):
                p = subprocess.run([str(exe), mode, handle, size], env={**env, "GPUPOOL_TOKEN": token},
                                   capture_output=True, text=True, timeout=limit)
                out[mode] = p.stdout.strip().splitlines()[-1:]
                out[f"{mode}_stderr"] = p.stderr.strip().splitlines()[-3:]
                out[f"{mode}_ok"] = p.returncode == 0 and f"PASS ipc_share {mode}" in p.stdout
            text, _ = exporter.communicate("check\n", timeout=limit)
            out["export"] = text.strip().splitlines()[-1:]
            out["export_ok"] = exporter.returncode == 0 and "PASS ipc_share export" in text
        finally:
            if exporter.poll() is None:
                exporter.kill()
                exporter.wait(10)
    return out


def cmd_ipc(args: argparse.Namespace) -> int:
    memory = size_arg(args.memory)
    config = "share = 2\n" + ("sim_memory_gib = 2\n" if args.simulated else "")
    if args.dry_run:
        print(f"  ipc: gpupoold with share = 2; torch.multiprocessing (spawn) passes a CUDA tensor of "
              f"{args.bytes >> 20} MiB between two processes of one token (GPUPOOL_MEMORY={args.memory} each), "
              "bit-exact both ways"
              + (f"; {args.ipc_share} export/import/stranger" if args.ipc_share else "")
              + "; then a 1-GPU lease with GPUPOOL_GPUS=1 running a small PyTorch job")
        return 0
    kernels = "0" if args.simulated else "1"
    d = Daemon(1, real=not args.simulated, config=config + SANDBOX_OFF, name="ipc")
    result: dict[str, Any] = {}
    code = 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "ipc_torch.py"
            script.write_text(IPC_TORCH)
            try:
                t = Tenant("the torch IPC parent", [str(script), str(args.bytes), str(args.limit)],
                           share_env(d, memory))
                try:
                    row = t.result(args.limit * 2)
                finally:
                    t.stop()
                ok = row["child_read_exact"] and row["parent_read_exact"] and row["child_exit"] == 0
                print(f"ipc torch: a {args.bytes >> 20} MiB CUDA tensor through torch.multiprocessing: child read "
                      f"{'bit-exact' if row['child_read_exact'] else 'WRONG values'}, parent read the child's "
                      f"{'bit-exact' if row['parent_read_exact'] else 'WRONG values'}, child exit "
                      f"{row['child_exit']}, {row['round_s']:.1f} s from the child's start", flush=True)
                result["torch"] = row
                code |= 0 if ok else 1
            except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
                print(f"ipc torch: FAILED: {e}"[:1500], flush=True)
                result["torch_error"] = str(e)[:3000]
                code = 1
        if args.ipc_share:
            try:
                d.wait_quiet(args.limit)
                row = ipc_c_program(d, args.ipc_share, memory, args.limit)
                ok = row["export_ok"] and row["import_ok"] and row["stranger_ok"]
                print(f"ipc ipc_share: export {row['export']}, import {row['import']}, stranger {row['stranger']}",
                      flush=True)
                result["ipc_share"] = row
                code |= 0 if ok else 1
            except (RuntimeError, subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
                print(f"ipc ipc_share: FAILED: {e}"[:1500], flush=True)
                result["ipc_share_error"] = str(e)[:3000]
                code = 1
        try:
            d.wait_quiet(args.limit)
            job = Tenant("the 1-GPU job", ["-c", ONE_GPU_JOB, kernels], {**d.client_env(), "GPUPOOL_GPUS": "1"})
            try:
                job.expect("ready", args.limit)
                (lease,) = active_leases(d)
                job.tell()
                row = job.result(args.limit)
            finally:
                job.stop()
            row["lease_gpus"] = lease.get("gpus")
            ok = row["device_count"] == 1 and row["job_ok"] and row["lease_gpus"] == [0]
            print(f"ipc one-gpu lease: GPUPOOL_GPUS=1, {row['device_count']} device ({row['name']}), lease on GPUs "
                  f"{row['lease_gpus']}, job {'ok' if row['job_ok'] else 'WRONG'}", flush=True)
            result["one_gpu"] = row
            code |= 0 if ok else 1
        except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
            print(f"ipc one-gpu lease: FAILED: {e}"[:1500], flush=True)
            result["one_gpu_error"] = str(e)[:3000]
            code = 1
    finally:
        close(d)
    print(f"ipc: {'PASS' if code == 0 else 'FAIL'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="check", required=True)
    for name in ("sandbox", "detach", "busy", "shares", "ipc"):
        p = sub.add_parser(name)
        p.add_argument("--json", type=Path, help="write the results as JSON here")
        p.add_argument("--dry-run", action="store_true", help="print what would run; run nothing")
        p.add_argument("--limit", type=float, default=90.0, help="seconds one program or wait may take")
        if name in ("sandbox", "shares", "ipc"):
            # scripts/gpu-validation.sh --smoke and the tests: the machinery against a simulated GPU.
            p.add_argument("--simulated", action="store_true", help=argparse.SUPPRESS)
        if name == "sandbox":
            p.add_argument("--cuda-dir", type=Path, required=True, help="the compiled tests/cuda programs")
            p.add_argument("--program", action="append", metavar="NAME=COMMAND",
                           help="run this instead of the default programs (repeatable): one to re-check alone")
        if name == "detach":
            p.add_argument("--sizes", default="1G,8G", help="device state of each round (default 1G,8G)")
        if name == "busy":
            p.add_argument("--seconds", type=float, default=6.0, help="each busy (and the idle) phase")
        if name == "shares":
            p.add_argument("--tenants", type=int, default=4, help="shares of the GPU, tenants at once (default 4)")
            p.add_argument("--memory", default="16G", help="each tenant's GPUPOOL_MEMORY (default 16G)")
            p.add_argument("--seconds", type=float, default=3.0, help="each loop, alone and together")
            p.add_argument("--sim-memory-gib", type=int, default=1, help=argparse.SUPPRESS)
        if name == "ipc":
            p.add_argument("--memory", default="8G", help="each IPC process's GPUPOOL_MEMORY (default 8G)")
            p.add_argument("--bytes", type=int, default=64 << 20, help="the tensor passed (default 64 MiB)")
            p.add_argument("--ipc-share", type=Path, help="tests/c/ipc_share, built: run it as well")
    args = ap.parse_args()
    # The script's step limit ends a check with SIGTERM (timeout): leave through the finally
    # blocks, so that the check's gpupoold (a session of its own, out of timeout's reach) stops
    # and does not hold the GPU against the next step's.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    checks = {"sandbox": cmd_sandbox, "detach": cmd_detach, "busy": cmd_busy, "shares": cmd_shares, "ipc": cmd_ipc}
    return checks[args.check](args)


if __name__ == "__main__":
    sys.exit(main())
