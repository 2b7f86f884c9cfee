"""A process with several GPUs, the native side (issue 37): one worker holds every device of the
lease, and the shim shows them all.

The worker is driven directly, without gpupoold: tests/tools/mini_server.py hands each client to
a worker with --devices (what gpupoold's worker_session says), on a simulated device configured
with 4 devices. tests/c/multi_gpu.c checks what the program sees: 4 devices, distinct pointer
ranges, pointer attributes, the peer answers and copies between every ordered pair, bit-exact.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, require, run_client
from worker_client import DEFAULT_VA_BASE, DEFAULT_VA_SIZE, gp, next_frame


def sim_config(tmp_path: Path, devices: int) -> Path:
    path = tmp_path / "sim.conf"
    path.write_text(f"device_count = {devices}\n")
    return path


def sim_config_with_peers(tmp_path: Path, peers: int) -> Path:
    """As gpupoold writes a simulated GPU's config (gpupoold/gpu/sim.py): device 0 and the
    server's other GPUs as peers, each with its memory file; the worker opens the k-th peer as
    ordinal k (1-based; gpupoold's device_ordinal)."""
    path = tmp_path / "sim.conf"
    lines = ["device_count = 1", f"memory_file = {tmp_path / 'gpu0.mem'}"]
    for gpu in range(1, peers + 1):  # UUID, PCI address (a bus of its own), memory file
        uuid, bus = f"{gpu:02x}" * 16, 0x18 + 0x10 * gpu
        lines.append(f"peer = {uuid} 0000:{bus:02x}:00.0 {tmp_path / f'gpu{gpu}.mem'}")
    path.write_text("\n".join(lines) + "\n")
    return path


def client_env(address: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env.update(GPUPOOL_CONFIG="none", GPUPOOL_TLS="0", GPUPOOL_SERVER=address)
    env.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    return env


def start_mini_server(build: Path, tmp_path: Path, devices: str, config: Path,
                      ) -> Iterator[tuple[str, Path]]:
    worker, sim = build / "gpupool-worker", build / "libgpupool-sim.so"
    require(worker.is_file() and sim.is_file(), "needs the worker and the simulated device")
    env = {**os.environ, "GPUPOOL_SIM_CONFIG": str(config)}
    env.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    log = tmp_path / "mini_server.log"  # the workers log here too: a pipe could fill up
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "tools" / "mini_server.py"), "--worker",
             str(worker), "--driver", str(sim), "--simulated", "--cache-dir",
             str(tmp_path / "cache"), "--devices", devices],
            stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL, text=True,
            env=env, start_new_session=True)
    assert proc.stdout is not None
    with proc.stdout:
        line = proc.stdout.readline()
        m = re.match(r"listening on (\S+)", line)
        try:
            assert m, f"mini_server did not start: {line!r}\n{log.read_text()}"
            yield m.group(1), log
        finally:
            os.killpg(proc.pid, 9)
            proc.wait()


@pytest.fixture(params=["devices", "peers"])
def four_gpus(request: pytest.FixtureRequest, native_build: Path, tmp_path: Path,
              ) -> Iterator[tuple[str, Path]]:
    """4 GPUs for one worker: 4 devices of one config, or (as gpupoold's simulated GPUs are) its
    device 0 and 3 peers."""
    config = (sim_config(tmp_path, 4) if request.param == "devices"
              else sim_config_with_peers(tmp_path, 3))
    yield from start_mini_server(native_build, tmp_path, "0,1,2,3", config)


@pytest.mark.san
def test_four_devices_peer_copies_and_pointer_attributes(native_build: Path,
                                                         four_gpus: tuple[str, Path]) -> None:
    address, log = four_gpus
    exe = native_build / "tests" / "multi_gpu"
    require(exe.is_file(), f"{exe} not built")
    proc = run_client([exe, "4"], env=client_env(address), timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "PASS multi_gpu:" in proc.stdout, out + log.read_text()
    worker_log = log.read_text(errors="replace")
    for mark in ("AddressSanitizer", "runtime error:"):
        assert mark not in out + worker_log, out + worker_log
    assert "the lease has 4 devices" in worker_log


def hello_reply(build: Path, tmp_path: Path, *extra: str) -> gp.HelloReply:
    """The worker's answer to a plain hello, started with `extra` arguments."""
    ours, theirs = socket.socketpair()
    ours.settimeout(60)
    hello = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=os.getpid(),
                     host="testhost", user="tester", program="test_multi_gpu", token="", gpu="",
                     model="", min_memory=0, va_base=DEFAULT_VA_BASE, va_size=DEFAULT_VA_SIZE)
    env = {**os.environ, "GPUPOOL_SIM_CONFIG": str(sim_config(tmp_path, 4))}
    proc = subprocess.Popen(
        [str(build / "gpupool-worker"), "--fd", str(theirs.fileno()), "--driver",
         str(build / "libgpupool-sim.so"), "--device", "0", "--cache-dir", str(tmp_path / "c"),
         "--session-id", "0x1234", "--hello-req", "1", "--simulated", *extra],
        stdin=subprocess.PIPE, stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), env=env)
    theirs.close()
    try:
        assert proc.stdin is not None
        proc.stdin.write(hello.encode())
        proc.stdin.close()
        op, req, body = next_frame(ours, [])
        assert (op, req) == (gp.Hello.OP, 1)
        return gp.HelloReply.decode(body)
    finally:
        ours.close()
        proc.wait(timeout=60)


@pytest.mark.san
def test_hello_reply_device_count(native_build: Path, tmp_path: Path) -> None:
    assert hello_reply(native_build, tmp_path).device_count == 1
    assert hello_reply(native_build, tmp_path, "--devices", "0,2,3").device_count == 3
    # The lease's first device must be the worker's own: anything else is a daemon mismatch.
    refused = hello_reply(native_build, tmp_path, "--devices", "1,2")
    assert refused.result == gp.GP_EREFUSED
    assert "first device is GPU 1 but this worker serves GPU 0" in refused.message
    # A device the server does not have is named.
    missing = hello_reply(native_build, tmp_path, "--devices", "0,7")
    assert missing.result != 0 and "GPU 7 of the lease (device 1)" in missing.message
