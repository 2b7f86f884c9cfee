"""Peer copies of a spread lease from server to server (issue 37, item 3; docs/multi-gpu.md,
"Across servers", step 6). Two gpupoold of 2 simulated GPUs each on one PostgreSQL, each in a
network namespace of its own with its own address and TLS identity (the links' set-up looks up
each server's registered address and pins its registered fingerprint, so the servers must not
share an address), and the client in a third; the harness is bench/spread_bench.py's (its own
subnet and names here, so that the two can run at once). A client of GPUPOOL_GPUS=4 spread
(tests/clients/spread_gpus.py: peer copies between all 12 ordered pairs of devices, bit-exact):

- GPUPOOL_SPREAD_COPY=server: every copy right, and the data went from server to server: the
  client's own counts (GPUPOOL_CALL_COUNTS) show a peer_send and a peer_recv per copy across
  servers, one link per direction, and the bytes it sent stay far below what the path through
  the client would have sent (each such copy a host-to-device of its size);
- the servers unable to reach each other (an unreachable route in each one's namespace; the
  client still reaches both), GPUPOOL_SPREAD_COPY=auto: one line per direction saying that the
  copies between those servers go through this client and why, and every copy still bit-exact,
  through the client;
- the same with GPUPOOL_SPREAD_COPY=server: the first copy across servers fails with
  CUDA_ERROR_NOT_SUPPORTED and a line that says so, what to set, and the servers' words (what
  the operator can do, never "go through the client").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from conftest import REPO, require

sys.path.insert(0, str(REPO / "bench"))
import spread_bench  # noqa: E402

CLIENT = REPO / "tests" / "clients" / "spread_gpus.py"
SIZE = (2 << 20) + 4097  # three of the link's 1 MiB data records, the last odd
ACROSS = 9  # copies across servers: 8 ordered pairs and one async peer copy from device 3 to 0


def run_client(lan: spread_bench.Lan, a: spread_bench.Server, token: str,
               mode: str) -> subprocess.CompletedProcess[str]:
    env = spread_bench.client_env(a, token, GPUPOOL_SPREAD_COPY=mode, GPUPOOL_CALL_COUNTS="1")
    return subprocess.run(["ip", "netns", "exec", lan.ns["client"], sys.executable, str(CLIENT),
                           "4", str(SIZE)], env=env, capture_output=True, text=True, timeout=180)


def counts_of(proc: subprocess.CompletedProcess[str],
              servers: dict[str, spread_bench.Server]) -> dict[str, Any]:
    said = proc.stdout + proc.stderr
    logs = "".join(f"\n--- gpupoold {h}:\n{s.log_text()[-6000:]}" for h, s in servers.items())
    assert proc.returncode == 0 and "PASS spread_gpus pairs=12" in proc.stdout, said + logs
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("counts ")]
    counts: dict[str, Any] = json.loads(line[len("counts "):])
    assert counts["enabled"], counts
    return counts


def frames(counts: dict[str, Any], op: str) -> int:
    return int(counts["ops"].get(op, {}).get("frames", 0))


def test_peer_copies_go_server_to_server_and_through_the_client_when_the_servers_are_cut_off(
        native_build: Path, pg_server: Any, pg_url: str) -> None:
    del native_build  # built: the harness runs build/
    require(os.geteuid() == 0, "root is needed for network namespaces")
    require(shutil.which("ip") is not None, "ip (iproute2) is needed")
    name = urllib.parse.urlsplit(pg_url).path.lstrip("/")
    database = f"postgresql://gpupool@/{name}?host={pg_server.dir}&port={pg_server.port}"
    lan = spread_bench.Lan(net="10.204.0", prefix="gpl")
    servers: dict[str, spread_bench.Server] = {}
    try:
        servers, token = spread_bench.start_fleet(lan, database)
        a, b = servers["a"], servers["b"]

        def quiet() -> None:
            spread_bench.wait("both servers' GPUs free",
                              lambda: all(s.quiet() for s in servers.values()))

        # Server to server: right, and the data never came through the client.
        proc = run_client(lan, a, token, "server")
        counts = counts_of(proc, servers)
        assert "go through this client" not in proc.stderr, proc.stderr
        assert frames(counts, "peer_link") == 4, counts  # one link each way, two ends each
        assert frames(counts, "peer_send") == frames(counts, "peer_recv") == ACROSS, json.dumps(counts)
        # Sent: the program's 4 uploads of SIZE, its VMM check's 2 MiB and small frames; through
        # the client each copy across servers would add SIZE more (9 of them).
        assert counts["bytes_sent"] < 6 * SIZE, json.dumps(counts)

        # The servers cannot reach each other: auto copies through the client, saying so once
        # per direction.
        lan.cut("a", "b")
        quiet()
        proc = run_client(lan, a, token, "auto")
        counts = counts_of(proc, servers)
        said = [ln for ln in proc.stderr.splitlines() if "go through this client" in ln]
        assert len(said) == 2, proc.stderr
        assert any(f"from server {a.address} to server {b.address} go through this client: " in ln
                   for ln in said), said
        assert any(f"from server {b.address} to server {a.address} go through this client: " in ln
                   for ln in said), said
        assert frames(counts, "peer_send") == 0 and frames(counts, "peer_link") == 4, counts
        assert counts["bytes_sent"] > (4 + ACROSS) * SIZE, counts

        # server: the copy fails, with words.
        quiet()
        proc = run_client(lan, a, token, "server")
        said_all = proc.stdout + proc.stderr
        assert proc.returncode == 1, said_all
        assert "FAIL spread_gpus: cuMemcpyPeer -> CUDA_ERROR_NOT_SUPPORTED (801)" in proc.stdout, (
            said_all)
        assert (f"a copy from server {a.address} to server {b.address} cannot go server to "
                "server: " in proc.stderr), proc.stderr
        assert "set it to auto to copy through this client" in proc.stderr, proc.stderr
        # The servers' words say what happened and what the operator can do; what the client
        # does is the client's to say, and in this mode nothing goes through it.
        assert "go through the client" not in proc.stderr, proc.stderr
        assert "open the remoting port between the fleet's servers" in proc.stderr, proc.stderr
    finally:
        for s in servers.values():
            s.close()
        lan.close()
