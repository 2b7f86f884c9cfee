"""End to end (issue 37, acceptance 1): gpupoold on 4 simulated GPUs; clients speaking the 1.6
hello with gpus = 4 get all four at once, a second such client waits until all 4 are free, a
1-GPU client queued behind it is served after it, and the SIGKILL of a client frees and scrubs
all 4 (the API's lease view and the history list the lease's GPUs); and tests/c/multi_gpu.c with
GPUPOOL_GPUS=4 through gpupoold and the real worker.

Each client is a process of its own (SIGKILL is the client's death, not a closed socket in the
test) speaking the plaintext protocol: the daemon runs with `--tls off` (as tests/test_version_skew.py
does)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, GpupoolServer, wait_until

# A client process: sends its hello (gpus = argv[4]), prints the hello reply's result and
# message once it has one, holds the lease until its stdin closes, then says goodbye.
CLIENT = r"""
import os, socket, sys
import gpupool_protocol as gp
host, port, token, gpus = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
s = socket.create_connection((host, port), timeout=120)
hello = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=os.getpid(), host="multi",
                 user="tester", program=f"gpus{gpus}", token=token, va_base=0x200000000000,
                 va_size=1 << 40, gpus=gpus)
s.sendall(gp.encode_frame(hello, 1))
def read(n):
    data = b""
    while len(data) < n:
        got = s.recv(n - len(data))
        if not got:
            sys.exit("connection closed before the hello reply")
        data += got
    return data
while True:
    length, op, flags, req = gp.HEADER.unpack(read(gp.HEADER.size))
    body = read(length)
    if op == gp.Hello.OP:
        break
reply = gp.HelloReply.decode(body)
print(reply.result, reply.message.replace("\n", " "), flush=True)
sys.stdin.read()
s.sendall(gp.encode_frame(gp.Goodbye(), 0))
"""


@pytest.fixture
def multi_server(native_build: Path, start_daemon: Callable[..., GpupoolServer]) -> GpupoolServer:
    return start_daemon(build_dir=native_build, simulated=4, tls=False)


@pytest.fixture
def spawn(multi_server: GpupoolServer) -> Iterator[Callable[[int], subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    env = {**os.environ, "PYTHONPATH": str(REPO / "protocol" / "python")}

    def start(gpus: int) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", CLIENT, multi_server.host,
                              str(multi_server.port), multi_server.token, str(gpus)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        for pipe in (p.stdin, p.stdout):
            if pipe is not None:
                pipe.close()


def granted(p: subprocess.Popen[str], timeout: float = 30) -> bool:
    """Whether client `p` printed a successful hello reply within `timeout` (False: nothing
    yet); a refusal fails the test with its message."""
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    if not ready:
        return False
    line = p.stdout.readline()
    assert line.startswith("0 "), f"hello refused: {line!r}"
    return True


def active(server: GpupoolServer) -> list[dict[str, Any]]:
    return server.get_json("/api/v1/leases?state=active")["leases"]


def queued(server: GpupoolServer) -> list[str]:
    return [w["client"]["program"] for w in server.get_json("/api/v1/queue")["queue"]]


def test_four_gpus_all_or_nothing_in_order_and_a_sigkill_scrubs_all(
        multi_server: GpupoolServer, spawn: Callable[[int], subprocess.Popen[str]]) -> None:
    server = multi_server
    wait_until("4 free GPUs with pre-started workers", lambda: [
        (g["state"], g["worker_ready"]) for g in server.get_json("/api/v1/gpus")["gpus"]]
        == [("free", True)] * 4)
    first = spawn(4)
    assert granted(first)
    [lease] = active(server)
    assert lease["gpus"] == [0, 1, 2, 3] and lease["gpu"] == 0, lease
    # GPU 0's worker opened all four (each simulated GPU's worker: its own ordinal 0, its peers
    # after it)
    server.wait_for_log(r"the lease has 4 devices")
    assert [g["lease"]["id"] for g in server.get_json("/api/v1/gpus")["gpus"]] == [lease["id"]] * 4

    second = spawn(4)
    wait_until("the second 4-GPU client queued", lambda: queued(server) == ["gpus4"])
    small = spawn(1)
    wait_until("the 1-GPU client queued behind it", lambda: queued(server) == ["gpus4", "gpus1"])
    assert not granted(second, 0.2) and not granted(small, 0)

    scrubs = [server.log_text().count(f"GPU {i} clean:") for i in range(4)]  # (at start-up)
    os.kill(first.pid, signal.SIGKILL)
    assert granted(second), "the second 4-GPU client did not get the 4 GPUs freed"
    assert queued(server) == ["gpus1"]  # all 4 went to the client ahead of it
    wait_until("the killed lease's 4 GPUs scrubbed", lambda: server.get_json(
        f"/api/v1/leases/{lease['id']}")["scrub_ok"] is not None)
    record = server.get_json(f"/api/v1/leases/{lease['id']}")
    assert record["end_reason"] == "client lost" and record["scrub_ok"] is True, record
    assert record["gpus"] == [0, 1, 2, 3], record
    log = server.log_text()  # each of the 4 scrubbed once more before the second client's lease
    assert [log.count(f"GPU {i} clean:") for i in range(4)] == [n + 1 for n in scrubs], log[-3000:]

    assert second.stdin is not None
    second.stdin.close()  # its goodbye: the 1-GPU client is next
    assert granted(small)
    [one] = active(server)
    assert one["gpus"] == [0] and one["client"]["program"] == "gpus1", one
    assert small.stdin is not None
    small.stdin.close()
    wait_until("every GPU scrubbed and free", lambda: [
        g["state"] for g in server.get_json("/api/v1/gpus")["gpus"]] == ["free"] * 4)
    assert [r["end_reason"] for r in server.get_json("/api/v1/leases?state=ended")["leases"]
            ].count("client exit") == 2


def test_a_program_with_four_gpus_through_gpupoold(
        native_build: Path, start_daemon: Callable[..., GpupoolServer]) -> None:
    """tests/c/multi_gpu.c (4 devices, distinct pointer ranges, pointer attributes, peer copies
    between every ordered pair, bit-exact) with GPUPOOL_GPUS=4 through gpupoold on 4 simulated
    GPUs and the real worker: GPU 0's worker opens the other three (its config's peers), and the
    lease's end scrubs all four."""
    exe = native_build / "tests" / "multi_gpu"
    assert exe.is_file(), f"{exe} not built"
    server = start_daemon(build_dir=native_build, simulated=4)
    wait_until("4 free GPUs", lambda: [g["state"] for g in server.get_json("/api/v1/gpus")["gpus"]]
               == ["free"] * 4)
    proc = subprocess.run([str(exe), "4"], env=server.client_env({"GPUPOOL_GPUS": "4"}),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "PASS multi_gpu:" in proc.stdout, proc.stdout + proc.stderr
    wait_until("the lease's end recorded", lambda: server.get_json(
        "/api/v1/leases?state=ended")["leases"])
    [record] = server.get_json("/api/v1/leases?state=ended")["leases"]
    assert record["gpus"] == [0, 1, 2, 3] and record["end_reason"] == "client exit", record
    server.wait_for_log(r"the lease has 4 devices")
    wait_until("all 4 scrubbed and free", lambda: [
        g["state"] for g in server.get_json("/api/v1/gpus")["gpus"]] == ["free"] * 4)
    assert server.get_json(f"/api/v1/leases/{record['id']}")["scrub_ok"] is True
