"""bench/restart_check.py in its simulated mode: the check a lent GPU runs with a PyTorch job
(scripts/gpu-validation.sh, step `restart`) keeps working here: a job streaming copies survives
gpupoold restarted with SIGTERM and then SIGKILL, with one lease taken over twice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_restart_check_passes_on_the_simulated_device(native_build: Path, tmp_path: Path) -> None:
    out = tmp_path / "restart.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "restart_check.py"), "--seconds",
                           "12", "--json", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["ok"] and r["takeovers"] == 2 and [h for h, _ in r["restarts"]] == ["SIGTERM",
                                                                                "SIGKILL"]
