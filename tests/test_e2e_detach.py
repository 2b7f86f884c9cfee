"""End to end: idle detach (docs/architecture.md, "Idle detach"; pool/detach.py, worker/detach.c).

A tenant that idles while another client waits gives its GPU back: the waiting client gets the
GPU, scrubbed, and the first tenant's next call brings its state back, on the same GPU or on
another of the same model, every byte where it was. Real gpupoold, workers, gpupool-checkpoint
and clients on simulated GPUs.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import GpupoolServer
from test_e2e_leases import MIB, facts, gpu_states, hold_gpu, start_client, wait_until  # noqa: F401


@pytest.fixture
def clients() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()


def detach_server(start_daemon: Any, native_build: Path, tmp_path: Path, gpus: int = 1,
                  **settings: Any) -> GpupoolServer:
    conf = tmp_path / "gpupoold.toml"
    values = {"idle_detach_after": 0.5, **settings}
    conf.write_text("".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in values.items()))
    server = start_daemon("--simulated", str(gpus), "--config", str(conf), build_dir=native_build,
                          simulated=None)
    wait_until("GPUs free", lambda: gpu_states(server) == ["free"] * gpus)
    return server


def finish(proc: subprocess.Popen[str], what: str, timeout: float = 120) -> dict[str, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{out}\n{err}"
    return facts(out)


def lease_of(server: GpupoolServer, lease_id: int) -> dict[str, Any]:
    return server.get_json(f"/api/v1/leases/{lease_id}")


def test_an_idle_tenant_gives_its_gpu_to_a_waiting_client_and_gets_it_back_intact(
        start_daemon: Any, native_build: Path, hold_gpu: Path, tmp_path: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    server = detach_server(start_daemon, native_build, tmp_path)
    first = start_client(server, hold_gpu, 64 * MIB, 6000, seed=41)
    clients.append(first)
    assert first.stdout is not None and "holding" in first.stdout.readline()
    second = start_client(server, hold_gpu, 64 * MIB, 300, seed=42)
    clients.append(second)
    f2 = finish(second, "the waiting client")
    assert f2["exact"] == "1" and f2["nonzero_before"] == "0"
    f1 = finish(first, "the idle tenant")
    assert f1["exact"] == "1" and f1["nonzero_before"] == "0"
    # The second ran while the first was detached: it started after the first had leased.
    assert float(f2["t_leased"]) < float(f1["t_end"])
    leases = server.get_json("/api/v1/leases?state=all")["leases"]
    print(server.log_text())
    first_rec = [le for le in leases if le["client_pid"] == first.pid][0]
    assert first_rec["detaches"] >= 1, first_rec
