"""The Prometheus exporter: `GET /metrics` (docs/metrics.md lists every name and label).

`DaemonMetrics` holds one `CollectorRegistry` per application (not prometheus_client's global
one: a process may run several daemons, the tests do). In it:

- histograms observed from the lease manager's events (pool/events.py, subscribed in app.py): the
  queue wait and the lease duration (at a lease's start and end), the scrub and reset durations
  (after each clean);
- the totals of ended leases that the workers reported (calls by class, bytes by direction, the
  call latency histogram, GPU-seconds by token name), added once per lease end (`lease_ended`);
- `Collector`, which builds everything else at scrape time from what the daemon already holds in
  memory: the lease manager's slots and active leases (their workers' latest stats), the
  telemetry cache, the event counters (pool/counters.py) and the GPU time accounting's running
  totals (pool/usage.py's `UsageMeter`, the one integrator of leased/busy/reused seconds: the
  counters and `gpupoold report` count the same spans). No NVML call, no SQLite, no per-call
  Python: a scrape costs about the same with or without traffic.

A value a GPU does not report (a simulated GPU's temperature, power...) has no sample; it is
never exported as 0.

The registry also holds prometheus_client's process collector (`process_cpu_seconds_total`,
`process_resident_memory_bytes`, open file descriptors...: the daemon's own process). No
`_created` series: they double the histograms' series for a value nobody graphs
(prometheus_client's `disable_created_metrics`, process-wide: gpupoold is the whole process).
A scraper that asks for OpenMetrics (`Accept: application/openmetrics-text`, as Prometheus
does by default) gets it; anything else gets the text format 0.0.4.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import gpupool_protocol as gp
from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector as _CollectorBase

from gpupoold import __version__
from gpupoold.http.utilisation import lease_state
from gpupoold.pool.events import EventBus, GpuCleaned, LeaseAttached, LeaseEnded, LeaseGranted
from gpupoold.tasks import stop_task
from gpupoold.workers import supervisor as _workers

if TYPE_CHECKING:
    from gpupoold.gpu.telemetry import Telemetry
    from gpupoold.pool.counters import Counters
    from gpupoold.pool.leases import LeaseManager
    from gpupoold.pool.usage import UsageMeter
    from gpupoold.workers.supervisor import WorkerStats

# Text exposition format 0.0.4, unless the scraper asks for OpenMetrics (choose_encoder).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The workers' call latency buckets (worker/README.md, "Control channel"), as the workers count them.
LATENCY_BUCKETS: tuple[float, ...] = _workers.LATENCY_BUCKETS

QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 600, 1800, 3600)
LEASE_DURATION_BUCKETS = (1, 10, 60, 300, 600, 1800, 3600, 7200, 14400, 28800, 86400)
SCRUB_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
RESET_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Idle detach: from the first call after an idle to the lease on a GPU again (queueing included).
REATTACH_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

CALL_CLASSES = ("launch", "copy", "alloc", "sync", "other")
GPU_STATES = ("free", "leased", "scrubbing", "quarantined", "drained")
LEASE_REQUEST_RESULTS = ("granted", "redirected", "auth", "requirements", "queue_full",
                         "queue_timeout", "abandoned", "malformed", "version", "shutdown",
                         "store", "other")
IDLE_WINDOW = 300.0  # seconds of zero utilisation after which a leased GPU counts as idle


def latency_of(stats: WorkerStats) -> tuple[list[int], int]:
    """(per-bucket counts, not cumulative, len(LATENCY_BUCKETS) + 1; sum in ns) of a worker's
    stats (zeros from a worker that predates the histogram: WorkerStats' defaults)."""
    counts = stats.latency_counts
    if len(counts) != len(LATENCY_BUCKETS) + 1:
        counts = [0] * (len(LATENCY_BUCKETS) + 1)
    return list(counts), stats.latency_sum_ns


@dataclass
class EndedTotals:
    """What the ended leases' workers reported, summed (the live ones are added at scrape)."""

    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CALL_CLASSES, 0))
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    latency_counts: list[int] = field(
        default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum_ns: int = 0
    gpu_seconds: dict[str, float] = field(default_factory=dict)  # by token name

    def add(self, stats: WorkerStats) -> None:
        for k in CALL_CLASSES:
            self.calls[k] += int(stats.calls.get(k, 0))
        self.bytes_h2d += stats.bytes_h2d
        self.bytes_d2h += stats.bytes_d2h
        counts, total = latency_of(stats)
        self.latency_counts = [a + b for a, b in zip(self.latency_counts, counts, strict=True)]
        self.latency_sum_ns += total


class DaemonMetrics:
    """The per-application registry, its histograms and the ended leases' totals."""

    def __init__(self) -> None:
        disable_created_metrics()  # before the histograms: they would carry _created series
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.queue_wait = Histogram(
            "gpupool_queue_wait_seconds", "Time a granted lease request waited for its GPU.",
            buckets=QUEUE_WAIT_BUCKETS, registry=self.registry)
        self.lease_duration = Histogram(
            "gpupool_lease_duration_seconds", "Duration of ended leases.",
            buckets=LEASE_DURATION_BUCKETS, registry=self.registry)
        self.scrub_duration = Histogram(
            "gpupool_scrub_duration_seconds",
            "Time to clean a GPU between tenants (memory scrub, health check, and a reset when "
            "one was done).", buckets=SCRUB_BUCKETS, registry=self.registry)
        self.reset_duration = Histogram(
            "gpupool_reset_duration_seconds", "Duration of GPU resets (successful or not).",
            buckets=RESET_BUCKETS, registry=self.registry)
        self.reattach_latency = Histogram(
            "gpupool_lease_reattach_seconds",
            "Idle detach: time from a detached lease's first call to its lease on a GPU again "
            "(queueing and restoring its memory included).", buckets=REATTACH_BUCKETS,
            registry=self.registry)
        self.ended = EndedTotals()
        self.collector: Collector | None = None
        self._idle_task: asyncio.Task[None] | None = None

    # -------------------------------------------------------------------------- events
    def subscribe(self, bus: EventBus) -> list[Callable[[], None]]:
        """Follow the lease manager's events (pool/events.py); returns the unsubscribe calls."""
        return [bus.subscribe(LeaseGranted, self.lease_granted),
                bus.subscribe(LeaseEnded, self.lease_ended),
                bus.subscribe(GpuCleaned, self.cleaned),
                bus.subscribe(LeaseAttached, self.lease_attached)]

    def lease_attached(self, e: LeaseAttached) -> None:
        self.reattach_latency.observe(max(0.0, e.latency_s))

    def lease_granted(self, e: LeaseGranted) -> None:
        self.queue_wait.observe(max(0.0, e.queued_s))

    def lease_ended(self, e: LeaseEnded) -> None:
        """A lease ended with its worker's final stats: published in the same event-loop step
        that removes the lease from the active ones, so no scrape counts it twice or not at all."""
        duration_s = max(0.0, e.duration_s)
        self.lease_duration.observe(duration_s)
        self.ended.add(e.stats)
        # GPU-seconds: a lease of several GPUs (issue 37) held each of them for its duration
        gpu_s = duration_s * max(1, len(e.gpus))
        self.ended.gpu_seconds[e.token] = self.ended.gpu_seconds.get(e.token, 0.0) + gpu_s

    def cleaned(self, e: GpuCleaned) -> None:
        self.scrub_duration.observe(max(0.0, e.duration_s))
        if e.reset is not None:
            d = e.reset.get("duration_s")
            self.reset_duration.observe(float(d) if isinstance(d, int | float) else 0.0)

    # -------------------------------------------------------------------------- wiring
    def attach(self, leases: LeaseManager, telemetry: Telemetry | None, counters: Counters,
               interval: float, usage: UsageMeter | None = None) -> None:
        """Register the scrape-time collector (`usage`: the GPU time accounting's meter, whose
        running totals are the leased/busy/reused counters; None: not exported) and start
        following the GPUs' utilisation (for `gpupool_gpu_lease_idle`)."""
        self.collector = Collector(self, leases, telemetry, counters, usage)
        self.registry.register(self.collector)
        self._idle_task = asyncio.create_task(self._follow_utilisation(interval),
                                              name="metrics-idle")

    async def close(self) -> None:
        await stop_task(self._idle_task)
        self._idle_task = None

    async def _follow_utilisation(self, interval: float) -> None:
        while True:
            if self.collector is not None:
                self.collector.note_utilisation()
            await asyncio.sleep(interval)

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """The registry in the format the `Accept` header asks for: (body, content type)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


class Collector(_CollectorBase):
    """Builds the scrape-time families (everything but the histograms above)."""

    def __init__(self, metrics: DaemonMetrics, leases: LeaseManager,
                 telemetry: Telemetry | None, counters: Counters,
                 usage: UsageMeter | None = None) -> None:
        self.metrics = metrics
        self.leases = leases
        self.telemetry = telemetry
        self.counters = counters
        self.usage = usage
        # GPU index -> monotonic time of the last telemetry sample with utilisation > 0 (or of
        # the start of following it).
        self._busy_at: dict[int, float] = {}

    def note_utilisation(self) -> None:
        """Look at the telemetry cache (cheap, in memory): remember when each GPU was busy."""
        if self.telemetry is None:
            return
        now = time.monotonic()
        for slot in self.leases.slots:
            i = slot.gpu.index
            live = self.telemetry.live(i)
            util = live.get("gpu_util")
            if i not in self._busy_at or (isinstance(util, int | float) and util > 0):
                self._busy_at[i] = now

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self._gpus()
        yield from self._utilisation()
        yield from self._leases()
        yield from self._data_plane()
        yield from self._service()

    # -------------------------------------------------------------------------------- GPUs
    def _gpus(self) -> Iterator[Metric]:
        slots = self.leases.slots
        info = GaugeMetricFamily("gpupool_gpu_info", "Identity of each GPU (value 1).",
                                 labels=["gpu", "uuid", "name", "pci_bus_id", "simulated"])
        state = GaugeMetricFamily("gpupool_gpu_state",
                                  "1 for the GPU's current state, 0 for the others.",
                                  labels=["gpu", "state"])
        draining = GaugeMetricFamily("gpupool_gpu_draining",
                                     "1 when a drain is pending or in effect.", labels=["gpu"])
        stuck = GaugeMetricFamily("gpupool_gpu_stuck", "1 while the watchdog finds the GPU "
                                  "unable to move on by itself (it repairs it).", labels=["gpu"])
        idle = GaugeMetricFamily("gpupool_gpu_lease_idle", "1 when the GPU is leased and its "
                                 "utilisation was 0 in every sample of the last 5 minutes.",
                                 labels=["gpu"])
        gauges = {
            "gpu_util": GaugeMetricFamily("gpupool_gpu_utilization_ratio",
                                          "GPU utilisation, 0 to 1.", labels=["gpu"]),
            "memory_util": GaugeMetricFamily("gpupool_gpu_memory_utilization_ratio",
                                             "Memory controller utilisation, 0 to 1.",
                                             labels=["gpu"]),
            "memory_used": GaugeMetricFamily("gpupool_gpu_memory_used_bytes",
                                             "Device memory in use.", labels=["gpu"]),
            "memory_total": GaugeMetricFamily("gpupool_gpu_memory_total_bytes",
                                              "Device memory size.", labels=["gpu"]),
            "temperature_c": GaugeMetricFamily("gpupool_gpu_temperature_celsius",
                                               "GPU temperature.", labels=["gpu"]),
            "power_w": GaugeMetricFamily("gpupool_gpu_power_watts", "Power draw.",
                                         labels=["gpu"]),
            "power_limit_w": GaugeMetricFamily("gpupool_gpu_power_limit_watts",
                                               "Power limit.", labels=["gpu"]),
            "sm_clock_mhz": GaugeMetricFamily("gpupool_gpu_sm_clock_hertz", "SM clock.",
                                              labels=["gpu"]),
            "mem_clock_mhz": GaugeMetricFamily("gpupool_gpu_memory_clock_hertz",
                                               "Memory clock.", labels=["gpu"]),
        }
        scale = {"gpu_util": 0.01, "memory_util": 0.01, "sm_clock_mhz": 1e6,
                 "mem_clock_mhz": 1e6}
        energy = CounterMetricFamily("gpupool_gpu_energy_joules",
                                     "Energy used since the driver loaded.", labels=["gpu"])
        ecc = CounterMetricFamily("gpupool_gpu_ecc_uncorrected_errors",
                                  "Uncorrected ECC errors (volatile: since the driver loaded).",
                                  labels=["gpu"])
        xid = CounterMetricFamily("gpupool_gpu_xid_errors",
                                  "XID errors the daemon has seen.", labels=["gpu"])
        rows_pending = GaugeMetricFamily("gpupool_gpu_remapped_rows_pending",
                                         "1 when a row remap waits for a GPU reset.",
                                         labels=["gpu"])
        rows_failure = GaugeMetricFamily("gpupool_gpu_remapped_rows_failure",
                                         "1 when a row could not be remapped.", labels=["gpu"])
        now = time.monotonic()
        for slot in slots:
            g = slot.gpu
            gpu = str(g.index)
            info.add_metric([gpu, g.uuid or "", g.name, g.pci_bus_id or "",
                             "true" if g.simulated else "false"], 1)
            for st in GPU_STATES:
                state.add_metric([gpu, st], 1 if slot.state == st else 0)
            draining.add_metric([gpu], 1 if slot.draining else 0)
            stuck.add_metric([gpu], 1 if slot.stuck is not None else 0)
            busy_at = self._busy_at.get(g.index)
            is_idle = (slot.lease is not None and busy_at is not None
                       and now - busy_at >= IDLE_WINDOW
                       and time.time() - slot.lease.started >= IDLE_WINDOW)
            idle.add_metric([gpu], 1 if is_idle else 0)
            if self.telemetry is None:
                continue
            live = self.telemetry.live(g.index)
            for key, family in gauges.items():
                value = live.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    family.add_metric([gpu], value * scale.get(key, 1))
            value = live.get("energy_j")
            if isinstance(value, int | float):
                energy.add_metric([gpu], value)
            for key, fam in (("ecc_uncorrected", ecc), ("xid_errors", xid)):
                value = live.get(key)
                if isinstance(value, int) and not isinstance(value, bool):
                    fam.add_metric([gpu], value)
            for key, fam in (("remapped_rows_pending", rows_pending),
                             ("remapped_rows_failure", rows_failure)):
                value = live.get(key)
                if isinstance(value, bool):
                    fam.add_metric([gpu], 1 if value else 0)
        yield info
        yield state
        yield draining
        yield stuck
        yield from gauges.values()
        yield energy
        yield ecc
        yield xid
        yield rows_pending
        yield rows_failure
        yield idle

    def _utilisation(self) -> Iterator[Metric]:
        """The usage meter's running totals (pool/usage.py: advanced every telemetry interval
        and at each lease's end, so an open lease's time counts up to the last sampling round)
        and each GPU's state now."""
        leased = CounterMetricFamily("gpupool_gpu_leased_seconds", "Seconds a lease held the GPU.",
                                     labels=["gpu"])
        busy = CounterMetricFamily("gpupool_gpu_busy_seconds", "Seconds the GPU executed work "
                                   "while leased (leased time weighted by its utilisation).",
                                   labels=["gpu"])
        reused = CounterMetricFamily("gpupool_gpu_reused_seconds", "Idle detach: seconds the GPU "
                                     "was leased while a lease detached from it waited.",
                                     labels=["gpu"])
        state = GaugeMetricFamily("gpupool_gpu_lease_state", "What the GPU does, as a code: 0 "
                                  "free, 1 leased idle, 2 leased busy, 3 reused (leased while a "
                                  "lease detached from it waits), 4 out of service.",
                                  labels=["gpu"])
        totals = self.usage.gpus if self.usage is not None else {}
        detached_from = {lease.home.index for lease in self.leases.active()
                         if lease.slot is None and lease.home is not None}
        for slot in self.leases.slots:
            i = slot.gpu.index
            t = totals.get(i)
            if t is not None:
                leased.add_metric([str(i)], t.leased_s)
                busy.add_metric([str(i)], t.busy_s)
                reused.add_metric([str(i)], t.reused_s)
            util = self.telemetry.live(i).get("gpu_util") if self.telemetry is not None else None
            ratio = (float(util) / 100 if isinstance(util, int | float)
                     and not isinstance(util, bool) else 0.0)
            state.add_metric([str(i)], lease_state(slot.lease is not None, ratio,
                                                   i in detached_from,
                                                   slot.state in ("free", "leased")))
        yield leased
        yield busy
        yield reused
        yield state
        tokens = CounterMetricFamily("gpupool_token_busy_seconds", "GPU-seconds the token's "
                                     "leases kept their GPUs executing work, by token name.",
                                     labels=["token"])
        token_busy = self.usage.token_busy_s if self.usage is not None else {}
        for token, value in sorted(token_busy.items()):
            tokens.add_metric([token], value)
        yield tokens

    # ------------------------------------------------------------------------------ leases
    def _leases(self) -> Iterator[Metric]:
        lm = self.leases
        c = self.counters
        active = list(lm.active())
        yield GaugeMetricFamily("gpupool_leases_active", "Leases in progress.",
                                value=len(active))
        yield GaugeMetricFamily("gpupool_queue_length", "Clients waiting for a GPU.",
                                value=len(lm.queue))
        req = CounterMetricFamily("gpupool_lease_requests",
                                  "Lease requests (hellos) by result.", labels=["result"])
        for result in LEASE_REQUEST_RESULTS:
            req.add_metric([result], c.get("lease_requests", result=result))
        yield req
        ends = CounterMetricFamily("gpupool_lease_ends", "Ended leases by reason.",
                                   labels=["reason"])
        for reason, value in sorted(_by_label(c, "leases_ended", "reason").items()):
            ends.add_metric([reason.replace(" ", "_")], value)
        yield ends
        seconds = dict(self.metrics.ended.gpu_seconds)
        now = time.time()
        for lease in active:
            held = max(0.0, now - lease.started) * (1 + len(lease.other_slots))  # each of its GPUs
            seconds[lease.token] = seconds.get(lease.token, 0.0) + held
        gs = CounterMetricFamily("gpupool_gpu_seconds",
                                 "GPU-seconds leased, by token name.", labels=["token"])
        for token, value in sorted(seconds.items()):
            gs.add_metric([token], value)
        yield gs
        yield GaugeMetricFamily("gpupool_leases_detached",
                                "Idle detach: active leases without a GPU (their state in host "
                                "memory).", value=sum(1 for lease in active if lease.slot is None))
        yield GaugeMetricFamily("gpupool_detached_bytes",
                                "Idle detach: device memory of detached leases held in the "
                                "server's host memory.", value=lm.detacher.held_bytes())
        yield from _shares(lm)
        yield CounterMetricFamily("gpupool_lease_detaches",
                                  "Idle detach: times an idle lease gave its GPU back.",
                                  value=c.get("detaches"))
        re = CounterMetricFamily("gpupool_lease_reattaches", "Idle detach: detached leases "
                                 "back on a GPU, by whether it was another GPU.", labels=["moved"])
        for moved in ("no", "yes"):
            re.add_metric([moved], c.get("reattaches", moved=moved))
        yield re

    # -------------------------------------------------------------------------- data plane
    def _data_plane(self) -> Iterator[Metric]:
        ended = self.metrics.ended
        calls = dict(ended.calls)
        h2d, d2h = ended.bytes_h2d, ended.bytes_d2h
        counts = list(ended.latency_counts)
        sum_ns = ended.latency_sum_ns
        for lease in self.leases.active():
            s = lease.worker.stats
            for k in CALL_CLASSES:
                calls[k] += int(s.calls.get(k, 0))
            h2d += s.bytes_h2d
            d2h += s.bytes_d2h
            lc, ls = latency_of(s)
            counts = [a + b for a, b in zip(counts, lc, strict=True)]
            sum_ns += ls
        fam = CounterMetricFamily("gpupool_calls", "Calls the workers executed, by class.",
                                  labels=["class"])
        for k in CALL_CLASSES:
            fam.add_metric([k], calls[k])
        yield fam
        fam = CounterMetricFamily("gpupool_copy_bytes", "Bytes copied between the clients and "
                                  "the GPUs, by direction.", labels=["direction"])
        fam.add_metric(["h2d"], h2d)
        fam.add_metric(["d2h"], d2h)
        yield fam
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*LATENCY_BUCKETS, float("inf")), counts, strict=True):
            running += n
            buckets.append(("+Inf" if bound == float("inf") else _float_text(bound), running))
        yield HistogramMetricFamily("gpupool_call_duration_seconds",
                                    "Time the workers spent on each call.", buckets=buckets,
                                    sum_value=sum_ns / 1e9)
        yield CounterMetricFamily("gpupool_connections", "Remoting connections accepted.",
                                  value=self.counters.get("connections"))
        auth = CounterMetricFamily("gpupool_auth_failures", "Refused credentials, by "
                                   "interface and reason.", labels=["interface", "reason"])
        for interface, name in (("remoting", "auth_refused"), ("http", "http_auth_refused")):
            for reason, value in sorted(_by_label(self.counters, name, "reason").items()):
                auth.add_metric([interface, reason], value)
        yield auth
        # Fair admission (remoting/admission.py, http/limits.py): connections closed at once
        # and hellos refused without a token check, by interface and reason.
        adm = CounterMetricFamily("gpupool_admission_refusals", "Connections or requests refused "
                                  "by the admission limits, by interface and reason.",
                                  labels=["interface", "reason"])
        for interface, name in (("remoting", "admission_refused"),
                                ("http", "http_admission_refused")):
            for reason, value in sorted(_by_label(self.counters, name, "reason").items()):
                adm.add_metric([interface, reason], value)
        yield adm
        # Server-to-server links of spread leases (remoting/peer_links.py, issue 37).
        links = CounterMetricFamily("gpupool_peer_links", "Server-to-server links of spread "
                                    "leases: the workers' requests and the other servers' "
                                    "peer_hellos, by result.", labels=["side", "result"])
        for side, results in (("connect", ("ok", "refused")), ("accept", ("ok", "refused")),
                              ("hello", ("ok", "refused", "auth"))):
            for result in results:
                links.add_metric([side, result],
                                 self.counters.get("peer_links", side=side, result=result))
        yield links

    # ------------------------------------------------------------------- scrub, reset, build
    def _service(self) -> Iterator[Metric]:
        yield CounterMetricFamily("gpupool_scrub_failures",
                                  "GPU cleanings that failed (the GPU was quarantined).",
                                  value=self.counters.get("scrubs", result="failed"))
        yield CounterMetricFamily("gpupool_reset_failures", "GPU resets that failed.",
                                  value=self.counters.get("resets", result="failed"))
        yield CounterMetricFamily("gpupool_watchdog_repairs", "GPUs the watchdog found stuck "
                                  "and repaired (or quarantined).",
                                  value=self.counters.get("watchdog_repairs"))
        # `server`: its name among the servers sharing a store (the Grafana dashboard's server
        # filter: a fleet is scraped server by server, each its own `instance`).
        build = GaugeMetricFamily("gpupool_build_info", "gpupoold's version and protocol, and "
                                  "this server's name in its fleet (value 1).",
                                  labels=["version", "protocol", "server"])
        build.add_metric([__version__, f"{gp.MAJOR}.{gp.MINOR}", self.leases.store.server], 1)
        yield build
        # The record spool (store/spool.py): records an unreachable database could not take
        # yet, kept on disk until it is back (a stand-in store without one exports 0).
        store = self.leases.store
        yield GaugeMetricFamily("gpupool_store_spool_bytes", "Size of the record spool in "
                                "bytes: records waiting for the database (0: none).",
                                value=getattr(store, "spool_bytes", 0))
        yield GaugeMetricFamily("gpupool_store_spool_records", "Records in the record spool "
                                "that the database does not have yet.",
                                value=getattr(store, "pending", 0))


# The application's DaemonMetrics (app.py sets it).
METRICS_KEY = web.AppKey("gpupool_metrics", DaemonMetrics)


async def metrics_endpoint(request: web.Request) -> web.Response:
    """GET /metrics: OpenMetrics when the scraper asks for it, else the text format 0.0.4."""
    from gpupoold.http.auth import ApiError

    metrics = request.app.get(METRICS_KEY)
    if metrics is None or metrics.collector is None:
        raise ApiError(503, "the metrics are not ready: gpupoold is starting or stopping",
                       "try again in a few seconds")
    body, content_type = metrics.exposition(request.headers.get("Accept", ""))
    return web.Response(body=body, headers={"Content-Type": content_type})


def _shares(lm: LeaseManager) -> Iterator[Metric]:
    """Shared GPUs (issue 32): each GPU's shares, and their memory by token (the metrics name
    tokens, never lease ids: docs/metrics.md)."""
    count = GaugeMetricFamily("gpupool_gpu_shares", "Shared GPUs: leases running as shares of "
                              "the GPU.", labels=["gpu"])
    used = GaugeMetricFamily("gpupool_share_memory_bytes", "Shared GPUs: device memory the "
                             "shares of a token hold on the GPU.", labels=["gpu", "token"])
    quota = GaugeMetricFamily("gpupool_share_memory_quota_bytes", "Shared GPUs: the memory "
                              "quotas of a token's shares on the GPU.", labels=["gpu", "token"])
    busy = GaugeMetricFamily("gpupool_share_busy_seconds", "Shared GPUs: GPU time the running "
                             "shares of a token have had on the GPU since they started "
                             "(simulated GPUs; 0 on real GPUs).", labels=["gpu", "token"])
    sharing = lm.share_settings()
    for slot in lm.slots:
        if not sharing.shared(slot.gpu.index):
            continue
        gpu = str(slot.gpu.index)
        count.add_metric([gpu], len(slot.shares))
        by_token: dict[str, tuple[int, int, int]] = {}
        for lease in slot.shares:
            u, q, b = by_token.get(lease.token, (0, 0, 0))
            stats = lease.worker.stats
            by_token[lease.token] = (u + stats.mem_used, q + lease.req.quota(slot.gpu),
                                     b + stats.busy_ns)
        for token, (u, q, b) in sorted(by_token.items()):
            used.add_metric([gpu, token], u)
            quota.add_metric([gpu, token], q)
            busy.add_metric([gpu, token], b / 1e9)
    yield count
    yield used
    yield quota
    yield busy


def _by_label(counters: Counters, name: str, label: str) -> dict[str, int]:
    return counters.by_label(name, label)


def _float_text(value: float) -> str:
    return repr(float(value))
