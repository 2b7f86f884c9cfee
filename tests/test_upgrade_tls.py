"""Upgrading a running pool to TLS by default (docs/packaging.md, "Upgrades"): a server of the
previous release served plain TCP and had no identity; the upgraded one makes its identity at its
first start, takes over the leases that ran across the restart (their sessions stay as they
began), and tells a client still configured for plain TCP, in one line, how to pin it."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from conftest import GpupoolServer
from test_e2e_leases import MIB, facts, gpu_states, hold_gpu, start_client, wait_until  # noqa: F401


def active_ids(server: GpupoolServer) -> set[int]:
    return {le["id"] for le in server.get_json("/api/v1/leases?state=active")["leases"]}


def test_an_upgraded_server_makes_its_identity_and_keeps_the_running_lease(
        start_daemon: Any, native_build: Path, hold_gpu: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    # The previous release: plain TCP, no identity in the state directory.
    old = start_daemon("--simulated", "2", build_dir=native_build, simulated=None, tls=False)
    assert old.fingerprint is None and not (old.state_dir / "identity").exists()
    wait_until("both GPUs free", lambda: gpu_states(old) == ["free", "free"])
    running = start_client(old, hold_gpu, 16 * MIB, 8_000, seed=41, loops=-1)
    clients.append(running)
    assert running.stdout is not None and "holding" in running.stdout.readline()
    leases = active_ids(old)
    plain_env = old.client_env()  # what a client of the previous release has
    assert plain_env["GPUPOOL_TLS"] == "0"

    assert old.stop() == 0, old.log_text()[-3000:]
    assert "lease(s) continue without gpupoold" in old.log_text()
    new = start_daemon("--simulated", "2", build_dir=native_build, simulated=None,
                       state_dir=old.state_dir)  # no TLS setting: the new default
    assert new.fingerprint is not None and new.fingerprint.startswith("SHA256:")
    assert (new.state_dir / "identity" / "server.key").stat().st_mode & 0o777 == 0o600
    assert "made a new identity for this server" in new.log_text()
    wait_until("the lease taken over", lambda: active_ids(new) == leases, timeout=20)

    # The running lease ends as it began, bit-exact, its session untouched by the new default.
    out, err = running.communicate(timeout=120)
    assert running.returncode == 0, err
    assert facts(out)["exact"] == "1" and int(facts(out)["copies"]) > 0

    # A client still set up for plain TCP gets the one-line fix, at once, not a hang.
    plain_env["GPUPOOL_SERVER"] = new.address
    t0 = time.monotonic()
    refused = subprocess.run([str(hold_gpu), str(MIB), "0", "42"], env=plain_env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and time.monotonic() - t0 < 10
    assert "requires TLS" in refused.stderr and "gpupool login" in refused.stderr, refused.stderr
    # Pinned, it is served.
    pinned = subprocess.run([str(hold_gpu), str(MIB), "0", "43"], env=new.client_env(),
                            capture_output=True, text=True, timeout=60)
    assert pinned.returncode == 0, pinned.stderr
    # The identity is kept across the next restart (an upgrade never makes a new one).
    assert new.stop() == 0
    again = start_daemon("--simulated", "2", build_dir=native_build, simulated=None,
                         state_dir=old.state_dir)
    assert again.fingerprint == new.fingerprint
    assert "made a new identity" not in again.log_text()
