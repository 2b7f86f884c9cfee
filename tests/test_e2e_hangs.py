"""End to end: no client waits forever on a server that is alive but hung (docs/protocol.md,
"Keepalive"). A live server is never silent towards a waiting client for more than a second: the
worker sends keepalive notices while a call runs long, gpupoold while the client is queued. So a
worker or a gpupoold stopped with SIGSTOP makes the waiting client fail within
GPUPOOL_SERVER_TIMEOUT (3 s here) with a message that says so, while a 60 s kernel on the
simulated device does not trip it. Real gpupoold, workers and CUDA programs built with nvcc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import GpupoolServer
from test_e2e_cuda import cuda_programs, run_program  # noqa: F401 (fixture)
from test_e2e_leases import MIB, hold_gpu, start_client, wait_until  # noqa: F401 (fixture)

TIMEOUT = {"GPUPOOL_SERVER_TIMEOUT": "3"}


@pytest.fixture
def stopped() -> Iterator[list[int]]:
    """Processes a test stopped: continued (and so able to end) whatever happened."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_a_stopped_worker_fails_its_waiting_client(gpupool_server: GpupoolServer,
                                                   cuda_programs, stopped: list[int]) -> None:  # noqa: F811
    server = gpupool_server
    exe = cuda_programs.path("longrun", "shared")
    proc = subprocess.Popen([str(exe), "120"], env=server.client_env(TIMEOUT), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        for _ in range(3):
            assert proc.stdout.readline().startswith("tick")
        (lease,) = server.get_json("/api/v1/leases?state=active")["leases"]
        os.kill(lease["worker_pid"], signal.SIGSTOP)
        stopped.append(lease["worker_pid"])
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, (out, err)
    assert "has not answered for 3 s, not even a keepalive" in err, err
    assert "GPUPOOL_SERVER_TIMEOUT=3" in err and "CUDA_ERROR_DEVICE_UNAVAILABLE" in err, err
    assert 2.5 <= took < 10, took
    print(f"a stopped worker: the client gave up after {took:.1f} s")


def test_a_60_second_kernel_does_not_trip_the_timeout(gpupool_server: GpupoolServer,
                                                      cuda_programs) -> None:  # noqa: F811
    """events.cu spins 60 s in one kernel (gp_test_spin): the worker is inside the launch all
    that time, and its keepalives keep a client with a 3 s timeout waiting."""
    server = gpupool_server
    exe = cuda_programs.path("events", "shared")
    proc = subprocess.run([str(exe), "60000"], env=server.client_env(TIMEOUT), text=True,
                          capture_output=True, timeout=240)
    assert proc.returncode == 0 and "PASS events" in proc.stdout, (proc.stdout, proc.stderr)
    assert "not answered" not in proc.stderr


def test_a_stopped_daemon_fails_a_queued_client(gpupool_server: GpupoolServer, hold_gpu: Path,  # noqa: F811
                                                stopped: list[int]) -> None:
    server = gpupool_server
    holder = start_client(server, hold_gpu, MIB, 30_000, seed=61)
    assert holder.stdout is not None and "holding" in holder.stdout.readline()
    queued = start_client(server, hold_gpu, MIB, 0, seed=62, env=TIMEOUT)
    try:
        wait_until("the second client queued",
                   lambda: len(server.get_json("/api/v1/queue")["queue"]) == 1)
        os.kill(server.proc.pid, signal.SIGSTOP)
        stopped.append(server.proc.pid)
        t0 = time.monotonic()
        out, err = queued.communicate(timeout=60)
        took = time.monotonic() - t0
        os.kill(server.proc.pid, signal.SIGCONT)
        assert queued.returncode != 0, (out, err)
        assert "stopped answering while we waited for a GPU" in err, err
        assert 2.5 <= took < 10, took
        print(f"a stopped daemon: the queued client gave up after {took:.1f} s")
        # The daemon goes on: the holder finishes and the GPU comes back.
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=30)
        wait_until("the GPU free again", lambda: [g["state"] for g in server.get_json(
            "/api/v1/gpus")["gpus"]] == ["free"], timeout=30)
    finally:
        for p in (holder, queued):
            if p.poll() is None:
                p.kill()
            p.communicate()
