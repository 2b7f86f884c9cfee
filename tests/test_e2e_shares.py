"""End to end (issue 32, daemon part, item 4): gpupoold with `share = 4` on one simulated GPU of
32 GiB, real clients (tests/clients/hold_gpu.c through the shim). Four clients asking 8 GiB each
run at the same time (their leases overlap in the history), a fifth waits; a whole-GPU client
that came before the fifth gets the GPU once the running shares have ended and the GPU was
scrubbed whole, and no new share lands meanwhile (it is not starved); the fifth runs after it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

from conftest import wait_until
from test_e2e_leases import ended_leases, facts, hold_gpu, start_client  # noqa: F401 (fixture)
from test_metrics import scrape_text

MIB = 1 << 20
SHARE = {"GPUPOOL_MEMORY": "8GiB"}


def active(server: Any) -> list[dict[str, Any]]:
    return server.get_json("/api/v1/leases?state=active")["leases"]


def queued_pids(server: Any) -> list[int]:
    return [w["client"]["pid"] for w in server.get_json("/api/v1/queue")["queue"]]


def test_four_shares_at_once_a_fifth_waits_a_whole_gpu_request_is_not_starved(
        start_daemon: Any, native_build: Path, hold_gpu: Path, tmp_path: Path) -> None:  # noqa: F811
    config = tmp_path / "gpupoold.toml"
    # Idle detach off: the idle shares would detach for the whole-GPU request (issue 32, item 5,
    # tests/test_e2e_share_detach.py); here it waits for them to end.
    config.write_text("share = 4\nsim_memory_gib = 32\nidle_detach_after = 0\n")
    server = start_daemon("--config", str(config), build_dir=native_build)
    wait_until("GPU 0 free", lambda: [g["state"] for g in server.get_json("/api/v1/gpus")["gpus"]]
               == ["free"], timeout=30)

    shares = [start_client(server, hold_gpu, 8 * MIB, 2500, seed=i + 1, env=SHARE) for i in range(4)]
    wait_until("four shares leased at once", lambda: len(active(server)) == 4, timeout=30)
    (gpu,) = server.get_json("/api/v1/gpus")["gpus"]
    assert gpu["lease"] is None and gpu["shares"]["max"] == 4
    assert sorted(s["client"]["pid"] for s in gpu["shares"]["leases"]) == sorted(p.pid for p in shares)
    assert {s["memory_quota"] for s in gpu["shares"]["leases"]} == {8 << 30}
    metrics = scrape_text(server)
    assert 'gpupool_gpu_shares{gpu="0"} 4.0' in metrics, metrics
    quota = re.search(r'^gpupool_share_memory_quota_bytes\{gpu="0",token="[^"]+"\} (\S+)$', metrics, re.M)
    assert quota is not None and float(quota.group(1)) == 4 * (8 << 30), metrics
    whole = start_client(server, hold_gpu, 8 * MIB, 300, seed=9)
    wait_until("the whole-GPU client queued", lambda: queued_pids(server) == [whole.pid], timeout=10)
    fifth = start_client(server, hold_gpu, 8 * MIB, 300, seed=5, env=SHARE)
    wait_until("the fifth share queued", lambda: queued_pids(server) == [whole.pid, fifth.pid],
               timeout=10)
    assert len(active(server)) == 4  # nothing more on the GPU

    procs: list[subprocess.Popen[str]] = [*shares, whole, fifth]
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"client {i} failed ({proc.returncode}):\n{out}\n{err}\n" \
                                     f"{server.log_text()[-3000:]}"
        f = facts(out)
        assert f["exact"] == "1" and f["nonzero_before"] == "0", f

    wait_until("six leases ended", lambda: len(ended_leases(server)) == 6, timeout=30)
    records = {r["client_pid"]: r for r in ended_leases(server)}
    four = [records[p.pid] for p in shares]
    assert max(r["started"] for r in four) < min(r["ended"] for r in four), \
        f"the four shares did not overlap: {[(r['started'], r['ended']) for r in four]}"
    last = max(four, key=lambda r: r["ended"])
    wait_until("the last share's whole scrub recorded",
               lambda: {r["client_pid"]: r for r in ended_leases(server)}[last["client_pid"]]
               ["scrub_ok"] is True, timeout=30)
    w, five = records[whole.pid], records[fifth.pid]
    assert w["started"] >= last["ended"], "the whole-GPU lease began before the shares ended"
    assert five["started"] >= w["ended"], "a share landed while the whole-GPU client waited"
    logged = server.log_text()
    assert logged.count("a share of GPU 0, 8589934592 bytes") == 5, logged[-3000:]
    assert logged.count("memory quota 8192 MiB") == 5, logged[-3000:]  # each share's worker says it


def test_a_killed_share_leaves_only_zeros_to_the_next_share(
        start_daemon: Any, native_build: Path, hold_gpu: Path, tmp_path: Path) -> None:  # noqa: F811
    """The isolation pattern on a shared GPU (issue 32): a share writes its pattern and is
    SIGKILLed while another share holds the GPU (so no whole scrub runs between them); the next
    share, placed first fit in the freed memory of the simulated GPU's shared allocator, reads
    only zeros, because the killed share's worker zeroed its memory before it exited."""
    config = tmp_path / "gpupoold.toml"
    config.write_text("share = 4\nsim_memory_gib = 32\n")
    server = start_daemon("--config", str(config), build_dir=native_build)
    wait_until("GPU 0 free", lambda: [g["state"] for g in server.get_json("/api/v1/gpus")["gpus"]]
               == ["free"], timeout=30)
    size = 32 * MIB
    victim = start_client(server, hold_gpu, size, 60_000, seed=0xAB, env=SHARE)
    wait_until("the first share wrote its pattern",
               lambda: any(le["client"]["pid"] == victim.pid and le["bytes_h2d"] >= size
                           for le in active(server)), timeout=30)
    neighbour = start_client(server, hold_gpu, size, 60_000, seed=7, env=SHARE)
    wait_until("the second share wrote", lambda: any(
        le["client"]["pid"] == neighbour.pid and le["bytes_h2d"] >= size for le in active(server)),
        timeout=30)
    scrubs = server.log_text().count("GPU 0 clean")
    victim.kill()
    victim.communicate(timeout=10)
    wait_until("the killed share's lease ended", lambda: len(active(server)) == 1, timeout=30)
    out = subprocess.run([str(hold_gpu), str(size), "0", "3"], env=server.client_env(SHARE),
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}\n{server.log_text()[-3000:]}"
    f = facts(out.stdout)
    assert f["nonzero_before"] == "0" and f["exact"] == "1", f
    assert server.log_text().count("GPU 0 clean") == scrubs, "a whole scrub ran between the shares"
    neighbour.kill()
    neighbour.communicate(timeout=10)
