"""The `gpupool_gpu_lease_state` code (docs/metrics.md, "Per GPU"; issue 33, item 4): what a GPU
does right now, for Grafana's state timeline of leases.

The leased, busy and reused seconds are not integrated here: the domain's `UsageMeter`
(pool/usage.py) is their one integrator, and http/metrics.py exports its running totals, so
`/metrics` and `gpupoold report` count the same spans. What is left here is a gauge of the
present, computed at each scrape from the slots and the telemetry's last sample.

Pure logic on plain values: no import of the pool, prometheus_client or the event loop.
"""

from __future__ import annotations

# `gpupool_gpu_lease_state`'s codes (docs/metrics.md lists them; the Grafana state timeline maps
# them to names and colours).
FREE = 0  # no lease, in service
LEASED_IDLE = 1  # leased, utilisation 0 in the last sample
LEASED_BUSY = 2  # leased, utilisation above 0
REUSED = 3  # leased by another while a lease detached from it waits in host memory
OUT_OF_SERVICE = 4  # scrubbing, quarantined or drained


def lease_state(leased: bool, util: float, reused: bool, in_service: bool) -> int:
    """The code of a GPU that is `leased` or not, at utilisation `util` (0 to 1, 0 when unknown)
    in the last sample, `reused` (leased while a lease detached from it waits) and `in_service`
    (False: scrubbing, quarantined or drained). Reused takes precedence over idle and busy."""
    if not leased:
        return FREE if in_service else OUT_OF_SERVICE
    if reused:
        return REUSED
    return LEASED_BUSY if util > 0 else LEASED_IDLE
