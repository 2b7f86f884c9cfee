"""Background tasks of the daemon's components (telemetry, metrics, membership, keepalives, the
dashboard's history): how one is stopped."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (None or finished: nothing to do) and wait until it is gone, so that it
    does nothing after this returns."""
    if task is None or task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
