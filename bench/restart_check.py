#!/usr/bin/env python3
"""A job that keeps its GPU across gpupoold restarts: the restart check for a real GPU.

    python bench/restart_check.py [--real] [--seconds 45] [--json PATH]

Starts gpupoold on fixed ports (bench/soak.py's Daemon), runs one job through the shim, restarts
gpupoold with SIGTERM at a third of the time and with SIGKILL at two thirds, and checks that the
job finished well, that it had one lease, ended by itself ("client exit"), and that both new
daemons took it over. With --real the daemon serves the real GPU 0 (reset policy never) and the
job is a PyTorch training loop (tests/torch_scripts/train_steps.py: every step synchronises);
without it, on a simulated GPU, the job streams copies and checks each one
(tests/clients/hold_gpu.c), which is what CI runs (tests/test_restart_check.py).
scripts/gpu-validation.sh runs it as its `restart` step.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak  # noqa: E402

ROOT = soak.ROOT


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--real", action="store_true", help="the real GPU 0 and a PyTorch job")
    ap.add_argument("--seconds", type=float, default=45.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    daemon = soak.Daemon(1, real=args.real)
    job: subprocess.Popen[str] | None = None
    result: dict[str, object] = {"real": args.real, "seconds": args.seconds, "ok": False}
    try:
        daemon.wait_quiet(timeout=300)
        if args.real:
            cmd = [sys.executable, str(ROOT / "tests" / "torch_scripts" / "train_steps.py"),
                   str(args.seconds)]
        else:
            hold, _ = soak.build_clients()
            cmd = [str(hold), str(64 << 20), str(int(args.seconds * 1000)), "7", "-1"]
        t0 = time.monotonic()
        job = subprocess.Popen(cmd, env=daemon.client_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        gaps = []
        for when, how in ((args.seconds / 3, "SIGTERM"), (args.seconds * 2 / 3, "SIGKILL")):
            time.sleep(max(0.0, t0 + when - time.monotonic()))
            if job.poll() is not None:
                break
            gaps.append((how, round(daemon.restart(how), 2)))
            soak.log(f"restarted gpupoold ({how}) with the job running")
        out, err = job.communicate(timeout=args.seconds + 600)
        daemon.wait_quiet(timeout=300)
        leases = daemon.get("/api/v1/leases?state=all")["leases"]
        logs = "".join(p.read_text(errors="replace") for p in daemon.state.glob("gpupoold-*.log"))
        takeovers = logs.count("taken over: GPU")
        ok_output = ("PASS train_steps" in out) if args.real else ("exact=1" in out)
        result.update(restarts=gaps, job_exit=job.returncode, job_tail=(out + err)[-2000:],
                      leases=[{k: r[k] for k in ("id", "end_reason", "end_detail", "scrub_ok")}
                              for r in leases], takeovers=takeovers)
        result["ok"] = (job.returncode == 0 and ok_output and len(leases) == 1
                        and leases[0]["end_reason"] == "client exit" and takeovers == len(gaps)
                        and len(gaps) == 2)
    finally:
        if job is not None and job.poll() is None:
            job.send_signal(signal.SIGKILL)
            job.communicate()
        daemon.close()
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(f"restart_check: {'PASS' if result['ok'] else 'FAIL'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
