"""Nothing only in memory (issue 34, item 4), end to end: gpupoold on a real PostgreSQL, two
leases that end while PostgreSQL is stopped (their records go to the spool in the state
directory), gpupoold SIGKILLed during the outage, PostgreSQL started again, gpupoold restarted
on the same state directory: the lease history has both leases, each once, with the end they
really had (not the "gpupoold stopped" that a lost record would leave)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ApiError, wait_until
from test_e2e_leases import hold_gpu, start_client  # noqa: F401  (hold_gpu is a fixture)
from test_metrics import scrape_text, value

from gpupoold.store.database import StoreDB
from gpupoold.store.spool import SPOOL_NAME, peek

MIB = 1 << 20


def test_sigkill_during_a_database_outage_loses_no_lease_record(
        start_daemon: Any, native_build: Path, hold_gpu: Path, pg_server: Any,  # noqa: F811
        pg_url: str, clients: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    config = tmp_path / "gpupoold.toml"
    config.write_text("metrics_anonymous = true\n")  # scraped during the outage: no token check
    args = ("--database", pg_url, "--config", str(config))
    a = start_daemon(*args, simulated=2, build_dir=native_build)
    holders = [start_client(a, hold_gpu, MIB, 1500, seed) for seed in (1, 2)]
    clients += holders
    wait_until("two leases", lambda: len(
        a.get_json("/api/v1/leases?state=active")["leases"]) == 2, timeout=30)
    spool = a.state_dir / SPOOL_NAME
    pg_server.stop()
    try:
        for p in holders:  # the leases run on and end during the outage
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
        wait_until("both lease ends in the spool", lambda: len(
            [r for r in peek(spool) if r.call == "lease_ended"]) == 2, timeout=30)
        text = scrape_text(a, token="")  # what an operator's alert sees
        assert value(text, "gpupool_store_spool_bytes") > 0, text
        assert value(text, "gpupool_store_spool_records") >= 2, text  # the 2 ends at least
        with pytest.raises(ApiError) as refused:  # a token cannot be checked: said so
            a.get_json("/api/v1/gpus")
        assert refused.value.status == 503, refused.value
        assert "cannot reach its database" in refused.value.body, refused.value
        killed_at = time.time()
        a.kill()  # SIGKILL: nothing is flushed on the way out
    finally:
        pg_server.start()
    b = start_daemon(*args, simulated=2, build_dir=native_build, state_dir=a.state_dir)
    b.wait_for_log(r"the store is reachable again: \d+ record\(s\) written from the spool")
    assert not spool.exists()
    db = StoreDB(pg_url)
    try:
        history = db.leases("all", 100)
    finally:
        db.close()
    pids = sorted(p.pid for p in holders)
    mine = [r for r in history if r.client_pid in pids]
    assert sorted(r.client_pid for r in mine) == pids, mine  # each lease once
    for r in mine:
        assert r.end_reason == "client exit" and r.ended is not None and r.ended < killed_at, r
        assert r.scrub_ok is not None, r  # its GPU's scrub, made during the outage, too
