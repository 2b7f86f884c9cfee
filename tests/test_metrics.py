"""`GET /metrics` (docs/metrics.md) against a real
gpupoold on simulated GPUs: every family with its type, the values a real lease moves, the GPU
state gauge, the token rules, the process collector, no `_created` series, OpenMetrics for a
scraper that asks for it, and `promtool check metrics` on a real scrape.
"""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import GpupoolServer, have, require
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
from test_e2e_leases import hold_gpu, start_client, wait_until  # noqa: F401 - hold_gpu: fixture

from gpupoold import __version__
from gpupoold.workers import supervisor as workers_module

MIB = 1 << 20

# Contract section 1: (name as the parser reports it, type). Counters are reported without
# their `_total` suffix, histograms without `_bucket/_sum/_count`.
FAMILIES = {
    "gpupool_gpu_info": "gauge", "gpupool_gpu_state": "gauge", "gpupool_gpu_draining": "gauge",
    "gpupool_gpu_utilization_ratio": "gauge", "gpupool_gpu_memory_utilization_ratio": "gauge",
    "gpupool_gpu_memory_used_bytes": "gauge", "gpupool_gpu_memory_total_bytes": "gauge",
    "gpupool_gpu_temperature_celsius": "gauge", "gpupool_gpu_power_watts": "gauge",
    "gpupool_gpu_power_limit_watts": "gauge", "gpupool_gpu_energy_joules": "counter",
    "gpupool_gpu_sm_clock_hertz": "gauge", "gpupool_gpu_memory_clock_hertz": "gauge",
    "gpupool_gpu_ecc_uncorrected_errors": "counter", "gpupool_gpu_xid_errors": "counter",
    "gpupool_gpu_remapped_rows_pending": "gauge", "gpupool_gpu_remapped_rows_failure": "gauge",
    "gpupool_gpu_lease_idle": "gauge", "gpupool_gpu_leased_seconds": "counter",
    "gpupool_gpu_busy_seconds": "counter", "gpupool_gpu_reused_seconds": "counter",
    "gpupool_gpu_lease_state": "gauge", "gpupool_token_busy_seconds": "counter",
    "gpupool_leases_active": "gauge", "gpupool_queue_length": "gauge",
    "gpupool_lease_requests": "counter", "gpupool_queue_wait_seconds": "histogram",
    "gpupool_lease_duration_seconds": "histogram", "gpupool_lease_ends": "counter",
    "gpupool_gpu_seconds": "counter",
    "gpupool_calls": "counter", "gpupool_copy_bytes": "counter",
    "gpupool_call_duration_seconds": "histogram", "gpupool_connections": "counter",
    "gpupool_auth_failures": "counter", "gpupool_admission_refusals": "counter",
    "gpupool_peer_links": "counter",
    "gpupool_scrub_duration_seconds": "histogram", "gpupool_scrub_failures": "counter",
    "gpupool_reset_duration_seconds": "histogram", "gpupool_reset_failures": "counter",
    "gpupool_build_info": "gauge",
}


OPENMETRICS = "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5"


def scrape_text(server: GpupoolServer, token: str | None = None, accept: str = "") -> str:
    """The body of GET /metrics with `token` (None: the test user token; "": none), in the
    text format 0.0.4, or OpenMetrics with accept=OPENMETRICS (what Prometheus sends)."""
    token = server.token if token is None else token
    req = urllib.request.Request(server.http_url + "/metrics")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if accept:
        req.add_header("Accept", accept)
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200
        want = "application/openmetrics-text; version=1.0.0" if accept else \
            "text/plain; version=0.0.4"
        assert resp.headers["Content-Type"].startswith(want), resp.headers["Content-Type"]
        return resp.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, /, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), float("nan"))


def test_every_family_has_its_type(gpupool_server: GpupoolServer) -> None:
    server = gpupool_server
    wait_until("GPU free", lambda: value(scrape_text(server), "gpupool_gpu_state", gpu="0",
                                         state="free") == 1)
    text = scrape_text(server)
    types = {fam.name: fam.type for fam in text_string_to_metric_families(text)}
    missing = {n: t for n, t in FAMILIES.items() if types.get(n) != t}
    assert not missing, f"families missing or of the wrong type: {missing}\n{text}"
    info = [s for f in text_string_to_metric_families(text) if f.name == "gpupool_gpu_info"
            for s in f.samples]
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["gpu"] == "0" and info[0].labels["simulated"] == "true"
    assert "simulated" in info[0].labels["name"].lower() and info[0].labels["uuid"]
    (build,) = [s for f in text_string_to_metric_families(text) if f.name == "gpupool_build_info"
                for s in f.samples]
    assert build.labels["server"]  # this server's name in a fleet (config/identity.py)
    assert value(text, "gpupool_build_info", version=__version__,
                 protocol=info_protocol(text), server=build.labels["server"]) == 1
    # One series per state, 1 for the current one.
    states = {s: value(text, "gpupool_gpu_state", gpu="0", state=s)
              for s in ("free", "leased", "scrubbing", "quarantined", "drained")}
    assert states == {"free": 1, "leased": 0, "scrubbing": 0, "quarantined": 0, "drained": 0}
    assert value(text, "gpupool_gpu_memory_total_bytes", gpu="0") > 0
    # A simulated GPU's sensors follow its utilisation (gpupoold/gpu/sim.py): idle here.
    assert value(text, "gpupool_gpu_temperature_celsius", gpu="0") == 32
    assert value(text, "gpupool_gpu_power_watts", gpu="0") == 70
    assert value(text, "gpupool_gpu_power_limit_watts", gpu="0") == 700
    assert value(text, "gpupool_gpu_sm_clock_hertz", gpu="0") == 345e6
    # The startup scrub was observed.
    assert value(text, "gpupool_scrub_duration_seconds_count") >= 1
    assert value(text, "gpupool_leases_active") == 0 and value(text, "gpupool_queue_length") == 0
    # The daemon's own process, and no _created series.
    assert types.get("process_resident_memory_bytes") == "gauge"
    assert types.get("process_cpu_seconds") == "counter" and types.get("process_open_fds")
    assert not [line for line in text.splitlines() if "_created" in line]


def test_openmetrics_for_a_scraper_that_asks(gpupool_server: GpupoolServer) -> None:
    """Prometheus asks for OpenMetrics first: it gets it, strictly valid (prometheus_client's
    OpenMetrics parser refuses any deviation, # EOF included), with the same families and
    values as the text format."""
    server = gpupool_server
    wait_until("GPU free", lambda: value(scrape_text(server), "gpupool_gpu_state", gpu="0",
                                         state="free") == 1)
    om = scrape_text(server, accept=OPENMETRICS)
    assert om.endswith("# EOF\n")
    families = {fam.name: fam for fam in openmetrics_families(om)}
    text_types = {fam.name: fam.type for fam in text_string_to_metric_families(scrape_text(
        server))}
    assert {n: f.type for n, f in families.items() if n.startswith("gpupool_")} == \
        {n: t for n, t in text_types.items() if n.startswith("gpupool_")}
    state = families["gpupool_gpu_state"]
    assert {s.labels["state"]: s.value for s in state.samples if s.labels["gpu"] == "0"} == \
        {"free": 1, "leased": 0, "scrubbing": 0, "quarantined": 0, "drained": 0}
    assert "process_cpu_seconds" in families
    assert not [line for line in om.splitlines() if "_created" in line]


def info_protocol(text: str) -> str:
    for fam in text_string_to_metric_families(text):
        if fam.name == "gpupool_build_info":
            return str(fam.samples[0].labels["protocol"])
    raise AssertionError("no gpupool_build_info")


def test_a_lease_moves_the_counters(gpupool_server: GpupoolServer, hold_gpu: Path,  # noqa: F811
                                    ) -> None:
    server = gpupool_server
    wait_until("GPU free", lambda: value(scrape_text(server), "gpupool_gpu_state", gpu="0",
                                         state="free") == 1)
    before = scrape_text(server)
    proc = start_client(server, hold_gpu, 8 * MIB, 1500, seed=3)
    try:
        live = wait_until("the state gauge shows leased", lambda: (
            t := scrape_text(server), value(t, "gpupool_gpu_state", gpu="0", state="leased") == 1
            and value(t, "gpupool_copy_bytes_total", direction="h2d") >= 8 * MIB and t)[-1])
        assert value(live, "gpupool_gpu_state", gpu="0", state="free") == 0
        assert value(live, "gpupool_leases_active") == 1
        assert value(live, "gpupool_gpu_seconds_total", token="tests") > 0
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    after = wait_until("the lease ended and its GPU scrubbed", lambda: (
        t := scrape_text(server),
        value(t, "gpupool_lease_ends_total", reason="client_exit") == 1
        and value(t, "gpupool_gpu_state", gpu="0", state="free") == 1 and t)[-1])

    def grew(name: str, /, **labels: str) -> float:
        old = value(before, name, **labels)
        return value(after, name, **labels) - (0 if old != old else old)  # NaN: absent before

    assert grew("gpupool_calls_total", **{"class": "copy"}) >= 2
    assert grew("gpupool_calls_total", **{"class": "alloc"}) >= 1
    assert grew("gpupool_copy_bytes_total", direction="h2d") >= 8 * MIB
    assert grew("gpupool_copy_bytes_total", direction="d2h") >= 8 * MIB
    assert grew("gpupool_lease_requests_total", result="granted") == 1
    assert grew("gpupool_connections_total") >= 1
    assert grew("gpupool_lease_duration_seconds_count") == 1
    assert value(after, "gpupool_lease_duration_seconds_sum") >= 1.5
    assert grew("gpupool_queue_wait_seconds_count") == 1
    assert grew("gpupool_scrub_duration_seconds_count") == 1
    assert value(after, "gpupool_gpu_seconds_total", token="tests") >= 1.5
    # Utilisation (issue 33, item 4): the lease's time on GPU 0, to within one telemetry period
    # (1 s), and no more busy time than leased time.
    leased = grew("gpupool_gpu_leased_seconds_total", gpu="0")
    assert abs(leased - grew("gpupool_lease_duration_seconds_sum")) <= 1.0, leased
    assert 0 <= grew("gpupool_gpu_busy_seconds_total", gpu="0") <= leased
    assert value(after, "gpupool_gpu_lease_state", gpu="0") == 0  # free again
    # The ended lease's totals stay (counters never go down once the lease is gone).
    assert value(after, "gpupool_copy_bytes_total", direction="h2d") >= value(
        live, "gpupool_copy_bytes_total", direction="h2d")
    assert value(after, "gpupool_leases_active") == 0
    calls = sum(value(after, "gpupool_calls_total", **{"class": c})
                for c in ("launch", "copy", "alloc", "sync", "other"))
    count = value(after, "gpupool_call_duration_seconds_count")
    assert value(after, "gpupool_call_duration_seconds_bucket", le="+Inf") == count
    if hasattr(workers_module, "LATENCY_BUCKETS"):  # the workers report their latency
        assert 0 < count <= calls + 16  # every executed frame, calls plus a few control ones
        assert value(after, "gpupool_call_duration_seconds_sum") > 0


def test_a_token_is_needed(gpupool_server: GpupoolServer) -> None:
    server = gpupool_server
    with pytest.raises(urllib.error.HTTPError) as info:
        scrape_text(server, token="")
    with info.value as exc:
        assert exc.code == 401
        assert "Bearer" in exc.headers["WWW-Authenticate"]
        assert "token" in exc.read().decode()
    with pytest.raises(urllib.error.HTTPError) as info:
        scrape_text(server, token="gpt_0123456789ab_" + "A" * 43)
    info.value.close()
    assert info.value.code == 401
    text = scrape_text(server)  # the user token
    assert value(text, "gpupool_auth_failures_total", interface="http", reason="missing") == 1
    assert value(text, "gpupool_auth_failures_total", interface="http", reason="unknown") == 1


def test_metrics_anonymous(start_daemon: Any, native_build: Path, tmp_path: Path) -> None:
    config = tmp_path / "gpupoold.toml"
    config.write_text("metrics_anonymous = true\n")
    server = start_daemon("--config", str(config), build_dir=native_build)
    text = scrape_text(server, token="")
    assert value(text, "gpupool_gpu_info", gpu="0", **gpu_labels(text)) == 1
    # Only /metrics: the API's views still need a token.
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server.http_url + "/api/v1/gpus", timeout=10)
    info.value.close()
    assert info.value.code == 401
    # A token that is sent is still checked.
    with pytest.raises(urllib.error.HTTPError) as info:
        scrape_text(server, token="gpt_0123456789ab_" + "A" * 43)
    info.value.close()
    assert info.value.code == 401


def gpu_labels(text: str) -> dict[str, str]:
    for fam in text_string_to_metric_families(text):
        if fam.name == "gpupool_gpu_info":
            labels = dict(fam.samples[0].labels)
            labels.pop("gpu")
            return labels
    raise AssertionError("no gpupool_gpu_info")


def test_promtool_check_metrics(gpupool_server: GpupoolServer, hold_gpu: Path,  # noqa: F811
                                ) -> None:
    require(have("promtool"), "promtool (Debian's prometheus package; scripts/bootstrap.sh "
                              "installs it when run as root) is needed to lint the exposition")
    server = gpupool_server
    wait_until("GPU free", lambda: value(scrape_text(server), "gpupool_gpu_state", gpu="0",
                                         state="free") == 1)
    proc = start_client(server, hold_gpu, MIB, 0, seed=5)
    assert proc.wait(timeout=60) == 0, proc.communicate()
    proc.communicate()
    text = wait_until("the lease ended", lambda: (
        t := scrape_text(server), value(t, "gpupool_lease_ends_total", reason="client_exit") == 1
        and t)[-1])
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), (
        f"promtool check metrics:\n{check.stdout}\n{check.stderr}\n--- exposition:\n{text}")
    # The same scrape as OpenMetrics: promtool (2.42, Debian's) lints only the text format (it
    # reads a counter's OpenMetrics family name without _total as a missing HELP), so the strict
    # OpenMetrics parser checks it instead.
    om = scrape_text(server, accept=OPENMETRICS)
    assert sum(1 for _ in openmetrics_families(om)) == sum(
        1 for _ in text_string_to_metric_families(text))
