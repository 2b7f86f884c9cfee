"""The 2-minute soak (bench/soak.py): a mixed load of short, long, streaming, idle and
kernel-launching clients on 2 simulated GPUs, clients SIGKILLed every few seconds and gpupoold
restarted twice (SIGTERM, then SIGKILL). It must report every client not killed served with its
data bit-exact, no lease lost, no worker crash, every lease scrubbed after, and the daemon's file
descriptors and memory when idle at the end within 10 % of the start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO, require

SOAK_SECONDS = 120


def test_two_minute_soak(native_build: Path, tmp_path: Path) -> None:
    require(Path("/usr/local/cuda/include/cuda.h").exists() or
            Path("/usr/include/cuda.h").exists(), "cuda.h (CUDA toolkit) for the soak's clients")
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--seconds",
                           str(SOAK_SECONDS), "--json", str(out)], capture_output=True, text=True,
                          timeout=SOAK_SECONDS + 600, cwd=REPO)
    print(proc.stdout)
    assert out.exists(), f"the soak did not finish:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    r = json.loads(out.read_text())
    assert r["leases_lost"] == 0, r["lost_detail"]
    assert r["worker_crashes"] == 0, "\n\n".join(r["crash_detail"])
    assert not r["clients_failed"], "\n\n".join(r["clients_failed"])  # (a str: shown whole)
    assert r["unscrubbed"] == 0, r["unscrubbed_detail"]
    served = sum(r["clients_served"].values())
    assert served >= 100 and r["clients_killed"] >= 5 and len(r["restarts"]) == 2, r
    assert r["verified_bytes"] > 1 << 30
    fds0, fds1 = r["fds"]
    rss0, rss1 = r["rss"]
    assert abs(fds1 - fds0) <= max(1, 0.1 * fds0), r["fds"]
    assert rss1 <= 1.1 * rss0, r["rss"]
    assert proc.returncode == 0, proc.stdout
