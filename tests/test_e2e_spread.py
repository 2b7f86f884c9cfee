"""A program of 4 GPUs whose lease is spread over two servers of 2 (issue 37, item 3, `spread =
true`): two `gpupoold --simulated 2` of one fleet (one PostgreSQL), a ctypes program
(tests/clients/spread_gpus.py) with GPUPOOL_GPUS=4 GPUPOOL_SPREAD=1. The shim holds one
connection per part and sends each call to the part of its device: the program sees 4 devices
with distinct address ranges that cuPointerGetAttribute names right, peer access inside a server
only, and copies between every ordered pair of devices bit-exact (through the client between the
servers). Each server's lease record names the group and its part; a SIGKILL of the program ends
and scrubs both parts. (The connect step alone, and 3 parts of one mini server:
tests/test_shim_spread_connect.py.)"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, require, wait_until

CLIENT = REPO / "tests" / "clients" / "spread_gpus.py"
SIZE = (9 << 20) + 4097  # two chunks of the client's bounce path, the second odd


def read_until(proc: subprocess.Popen[str], mark: str, timeout: float) -> list[str]:
    """The program's lines up to `mark` (or its end, or the timeout). Reads the pipe's bytes
    itself: select() cannot see lines already in the text wrapper's buffer (two lines that came
    together would wait for the timeout)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    lines: list[str] = []
    pending = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not select.select([fd], [], [], 0.5)[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            lines.append(line.decode().strip())
            if lines[-1] == mark:
                return lines
    return lines


# A library with a global: each part's worker has its own copy (spread_gpus.py checks it).
GLOBAL_SOURCE = r"""
extern "C" __device__ unsigned char gp_spread_g[4096];
extern "C" __global__ void gp_test_noop() { gp_spread_g[threadIdx.x] = 1; }
"""


@pytest.fixture(scope="module")
def global_cubin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    require(Path(nvcc).exists(), "nvcc is not installed (needed to build the test cubin)")
    d = tmp_path_factory.mktemp("spread_cubin")
    (d / "g.cu").write_text(GLOBAL_SOURCE)
    subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-o", str(d / "g.cubin"), str(d / "g.cu")],
                   check=True, capture_output=True)
    return d / "g.cubin"


def test_four_gpus_from_two_servers_peer_copies_and_a_sigkill_scrubs_both_parts(
        start_daemon: Any, native_build: Path, pg_url: str, global_cubin: Path) -> None:
    a, b = (start_daemon("--database", pg_url, simulated=2, build_dir=native_build, tls=False)
            for _ in range(2))
    wait_until("A sees the fleet's 4 GPUs",
               lambda: [(v["state"], len(v["gpus"])) for v in a.get_json("/api/v1/fleet")[
                   "servers"]] == [("up", 2), ("up", 2)])
    servers = {f"{s.host}:{s.port}" for s in (a, b)}
    env = a.client_env({"GPUPOOL_SERVER": ",".join(sorted(servers)), "GPUPOOL_GPUS": "4",
                        "GPUPOOL_SPREAD": "1", "GPUPOOL_CONNECT_TIMEOUT": "20",
                        "GPUPOOL_TEST_GLOBAL_CUBIN": str(global_cubin)})
    with subprocess.Popen([sys.executable, str(CLIENT), "4", str(SIZE), "hold"], env=env,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        lines = read_until(proc, "holding", 120)
        out = "\n".join(lines)
        assert lines and lines[-1] == "holding", (
            f"{out}\n{proc.stderr.read() if proc.poll() is not None and proc.stderr else ''}")
        # A library loaded once runs its kernel on both parts (review finding 1).
        assert "kernel on device 0 ok" in lines and "kernel on device 2 ok" in lines, out
        assert "vmm on device 3 ok" in lines, out  # VMM on device 3's part (finding 4)
        assert "module of device 2 ok" in lines, out  # named from device 0 (finding 7)
        assert "library globals per part ok" in lines, out  # a copy of a global per part
        # Peer access inside a server (devices 0-1, 2-3), none across.
        peers = {(int(i), int(j)): int(v) for i, j, v in re.findall(r"peer (\d) (\d) (\d)", out)}
        assert peers == {(i, j): int(i // 2 == j // 2) for i in range(4) for j in range(4)
                         if i != j}, out
        # Each part is a lease of its server; the records link the parts.
        leases = a.get_json("/api/v1/leases?state=active")["leases"]
        assert sorted((le["part"], le["parts"], len(le["gpus"])) for le in leases) == [
            (0, 2, 2), (1, 2, 2)], leases
        assert len({le["spread_group"] for le in leases}) == 1 and leases[0]["spread_group"]
        assert len({le["server"] for le in leases}) == 2, leases
        os.kill(proc.pid, signal.SIGKILL)  # (a failed check: leaving the block closes its stdin)
    for le in leases:  # both parts end as a client lost, and both servers scrub their GPUs
        wait_until(f"part {le['part']} ended and scrubbed", lambda le=le: a.get_json(
            f"/api/v1/leases/{le['id']}").get("scrub_ok") is not None, timeout=60)
        record = a.get_json(f"/api/v1/leases/{le['id']}")
        assert record["end_reason"] == "client lost" and record["scrub_ok"] is True, record
    for s in (a, b):
        wait_until("the server's GPUs free", lambda s=s: [
            g["state"] for g in s.get_json("/api/v1/gpus")["gpus"]] == ["free"] * 2)
