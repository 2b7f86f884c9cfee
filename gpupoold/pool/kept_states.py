"""Drained and quarantined GPUs, kept across restarts in the store's gpu_state table (and imported
once from the file an older gpupoold kept them in), and shared GPUs closed to new shares (a dead
share's worker may have left memory unzeroed, issue 32: a restart that takes the GPU's other
shares over keeps it closed until its whole scrub). The lease manager (pool/leases.py) loads
them at start and saves them after each drain, undrain, clear or quarantine, and (`follow`)
whenever a GPU's share_closed changes; pool/state.py restores them on the slots."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from gpupoold.pool.events import EventBus, GpuChanged
from gpupoold.pool.slots import Slot
from gpupoold.store.database import Store

log = logging.getLogger("gpupoold.leases")

LEGACY_STATE_FILE = "gpu-state.json"  # where drained/quarantined GPUs were kept before the store


def state_key(slot: Slot) -> str:
    """A GPU's key in the store's gpu_state table: its UUID (its index when it has none)."""
    return slot.gpu.uuid or str(slot.gpu.index)


class KeptStates:
    """The drained and quarantined GPUs of `slots` in `store`."""

    def __init__(self, store: Store, state_dir: Path, slots: Sequence[Slot]) -> None:
        self.store = store
        self.slots = slots
        self.legacy_file = state_dir / LEGACY_STATE_FILE

    async def load(self) -> dict[str, Any]:
        """Drained and quarantined GPUs from the store, after importing the file an older
        gpupoold kept them in (once: the file is removed when the store has them)."""
        legacy = await asyncio.to_thread(self._read_legacy)
        if legacy is not None:
            states = await self.store.gpu_states()
            if not states and legacy:
                await self.store.save_gpu_states(legacy, self._keys())
                log.info("drained/quarantined GPUs imported into the database from %s",
                         self.legacy_file)
            await asyncio.to_thread(self.legacy_file.unlink, missing_ok=True)
        return await self.store.gpu_states()

    def save(self) -> Coroutine[Any, Any, None]:
        """Save what the slots are now (the snapshot is taken at this call, not when the
        returned coroutine runs: the store runs its calls in order, so the last one wins)."""
        return self.store.save_gpu_states(self._snapshot(), self._keys())

    def follow(self, events: EventBus,
               spawn: Callable[[Coroutine[Any, Any, None]], object]) -> Callable[[], None]:
        """Save again (through `spawn`, off the event loop's path) each time a GPU's
        share_closed changes: closed by a dead share's worker (pool/share_leases.py,
        pool/detach.py), opened by its whole scrub. Returns the unsubscribe."""
        closed = {s.gpu.index: s.share_closed for s in self.slots}

        def changed(event: GpuChanged) -> None:
            slot = next((s for s in self.slots if s.gpu.index == event.index), None)
            if slot is not None and slot.share_closed != closed.get(slot.gpu.index):
                closed[slot.gpu.index] = slot.share_closed
                spawn(self.save())

        return events.subscribe(GpuChanged, changed)

    def _read_legacy(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.legacy_file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.error("cannot read %s (%s): its drained/quarantined GPUs are not imported (the "
                      "file is left in place; fix or remove it)", self.legacy_file, exc)
            return None
        if not isinstance(data, dict):
            return {}
        return {str(k): {"draining": bool(v.get("draining")), "quarantine": v.get("quarantine")}
                for k, v in data.items() if isinstance(v, dict)}

    def _keys(self) -> list[str]:
        return [state_key(s) for s in self.slots]

    def _snapshot(self) -> dict[str, Any]:
        return {state_key(s): {"draining": s.draining, "quarantine": s.quarantine}
                | ({"share_closed": True} if s.share_closed else {})
                for s in self.slots if s.draining or s.quarantine or s.share_closed}
