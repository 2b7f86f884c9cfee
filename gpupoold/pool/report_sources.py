"""What a usage report reads (pool/report.py's inputs), in one place for its two readers: the
admin API (`GET /api/v1/report`, `gpupoold report`) and the dashboard's Utilisation page. Two
copies of this had already drifted once (which minute rows a period counts), so both read here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from gpupoold.pool.report import LeaseFacts, first_row
from gpupoold.pool.usage_recorder import UsageRecorder
from gpupoold.store.database import LeaseRecord, Store


async def usage_of(store: Store, recorder: UsageRecorder | None,
                   local_gpus: Callable[[], Iterable[int]],
                   since: float, until: float) -> tuple[list[tuple[str, int]], list[dict[str, Any]]]:
    """The GPUs a report covers and the minute rows of every minute [since, until) overlaps.

    The recorder writes what it holds first, so the figures run up to now rather than up to its
    last periodic write. On a shared store (PostgreSQL) the GPUs are every server's, so a
    fleet's report sums its servers; on this server's own SQLite file, its own GPUs (`local_gpus`,
    asked only then)."""
    if recorder is not None:
        await recorder.flush()
    if store.path is None:
        gpus = await store.usage_gpus()
    else:
        gpus = [(store.server, index) for index in local_gpus()]
    minutes = await store.usage_minutes(first_row(since), until)
    return gpus, minutes


def lease_facts(records: Iterable[LeaseRecord]) -> list[LeaseFacts]:
    """What the report needs of each lease record."""
    return [LeaseFacts(r.token_name, r.server, r.gpu_index, r.queued_s, r.detaches, r.detached_s)
            for r in records]
