"""End to end (issue 32, item 4, acceptance 'fair time'): two busy shares of one simulated GPU
through gpupoold (`share = 2`), each a tests/clients/busy_idle.py tenant launching 5 ms
gp_test_spin kernels back to back (kernels that spin for real time; the GPU's processes take
turns). Their tokens' weights (`gpupoold token create --weight`) reach the shares' workers, whose
pacing (worker/pacing.c) gives each its weight's part of the GPU's time: equal weights 40-60 %
each, 3:1 65-85 % for the heavier. The GPU time is what gpupoold reports: each share's `busy_s`
in the GPU view of /api/v1 (the workers' busy time), and gpupool_share_busy_seconds by token.

The issue measures over 20 s; here each case measures over about 3 s after a 0.5 s warm-up, the span
tests/sim/test_pacing.c found steady (3 s there: 1:1 49.9 %, 3:1 79.1 % over 20 s by hand). A
share's busy time arrives with its worker's stats, at most once a second, so each share's rate is
taken between the first and the last change of its figure that the test saw (both read as they
arrived), not between the window's edges.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import GpupoolServer, require, wait_until
from test_e2e_usage import CLIENT, have_cuda_python
from test_metrics import scrape_text

WARMUP_S = 0.5
WINDOW_S = 3.0
LAUNCH_MS = 5
# Each tenant's work: long enough to outlast the window (equal weights: 6.8 s for both; 3:1: the
# heavier's 4 s done after 6 s), short enough that the test ends soon after it.
BUSY_MS = 3000
HEAVY_BUSY_MS = 4000


def shares(server: GpupoolServer) -> list[dict[str, Any]]:
    (gpu,) = server.get_json("/api/v1/gpus")["gpus"]
    return gpu["shares"]["leases"] if gpu["shares"] else []


def busy_tenant(server: GpupoolServer, token: str, busy_ms: int) -> subprocess.Popen[str]:
    env = server.client_env({"GPUPOOL_MEMORY": "1GiB", "GPUPOOL_TOKEN": token})
    return subprocess.Popen([sys.executable, str(CLIENT), str(busy_ms), str(LAUNCH_MS)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


def rate(points: list[tuple[float, float]]) -> float:
    """GPU seconds per second between the first and the last change of a share's busy time."""
    changes = [p for prev, p in zip(points, points[1:], strict=False) if p[1] != prev[1]]
    assert len(changes) >= 2 and changes[-1][0] - changes[0][0] >= WINDOW_S / 2, points
    (t0, b0), (t1, b1) = changes[0], changes[-1]
    return (b1 - b0) / (t1 - t0)


def measure(server: GpupoolServer, first: str, second: str) -> tuple[float, float, str]:
    """The parts of the GPU's time of a busy share of token `first` and one of `second`, and the
    metrics text scraped while they ran."""
    procs = [busy_tenant(server, first, HEAVY_BUSY_MS if first != second else BUSY_MS),
             busy_tenant(server, second, BUSY_MS)]
    try:
        wait_until("both shares busy", lambda: len(s := shares(server)) == 2
                   and all(x["busy_s"] > 0 for x in s), timeout=30)
        by_pid = {x["client"]["pid"]: x["id"] for x in shares(server)}
        ids = [by_pid[p.pid] for p in procs]
        time.sleep(WARMUP_S)
        points: dict[int, list[tuple[float, float]]] = {i: [] for i in ids}
        end = time.monotonic() + WINDOW_S
        while time.monotonic() < end:
            now = time.monotonic()
            for x in shares(server):
                if x["id"] in points:
                    points[x["id"]].append((now, x["busy_s"]))
            time.sleep(0.05)
        metrics = scrape_text(server)
        assert all(p.poll() is None for p in procs), "a tenant ended before the window did"
    finally:
        for p in procs:  # each ends by itself: its launches were sent ahead, killing it
            out, err = p.communicate(timeout=60)  # would leave its worker to finish them
            assert p.returncode == 0, f"{out}\n{err}\n{server.log_text()[-3000:]}"
    wait_until("the GPU free again", lambda: [g["state"] for g in
                                              server.get_json("/api/v1/gpus")["gpus"]] == ["free"],
               timeout=30)
    a, b = (rate(points[i]) for i in ids)
    print(f"{first == second and 'equal' or '3:1'}: GPU time per second {a:.3f}, {b:.3f}: "
          f"{a / (a + b):.1%} and {b / (a + b):.1%}")
    assert 0.5 < a + b < 1.2, (a, b)  # the GPU was busy, and no more than once over
    return a / (a + b), b / (a + b), metrics


def test_busy_shares_get_the_gpu_time_of_their_tokens_weights(
        start_daemon: Any, native_build: Path, tmp_path: Path) -> None:
    require(have_cuda_python(),
            "cuda-bindings is not installed (it comes with PyTorch: scripts/bootstrap.sh)")
    config = tmp_path / "gpupoold.toml"
    config.write_text("share = 2\nsim_memory_gib = 8\n")
    server = start_daemon("--config", str(config), build_dir=native_build)
    heavy = server.create_token("heavy", "user", "--weight", "3")
    light = server.create_token("light")
    wait_until("GPU 0 free", lambda: [g["state"] for g in server.get_json("/api/v1/gpus")["gpus"]]
               == ["free"], timeout=30)

    one, other, _ = measure(server, light, light)
    assert 0.40 <= one <= 0.60 and 0.40 <= other <= 0.60, (one, other)

    more, less, metrics = measure(server, heavy, light)
    assert 0.65 <= more <= 0.85, (more, less)
    busy = dict(re.findall(r'^gpupool_share_busy_seconds\{gpu="0",token="(\w+)"\} (\S+)$',
                           metrics, re.M))
    assert set(busy) == {"heavy", "light"} and float(busy["heavy"]) > float(busy["light"]) > 0, \
        metrics
    assert "weight 3" in server.log_text()
