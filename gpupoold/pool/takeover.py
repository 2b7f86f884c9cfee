"""Taking over the previous gpupoold's leases at start-up: the part of the lease manager
(pool/leases.py, which inherits it) that finds where each open lease of the store is now, adopts
its worker on its GPU or detached, and closes the records of those nobody takes over. Apart from
pool/leases.py for length only: it is the lease manager's policy, with its state and helpers
(`LeaseManager.start` calls it; the attributes below are the lease manager's).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from typing import Any

import gpupool_protocol as gp

from gpupoold.config.settings import Settings
from gpupoold.log import journal_fields
from gpupoold.pool.counters import Counters
from gpupoold.pool.detach import IdleDetacher
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.share_leases import MPS_SHARE_KEEPS_GPU
from gpupoold.pool.shares import ShareSettings
from gpupoold.pool.slots import ATTACHED, DETACHED, Lease, Slot
from gpupoold.pool.state import PoolState
from gpupoold.pool.waitqueue import ClientInfo
from gpupoold.store.database import LeaseRecord, Store
from gpupoold.workers.supervisor import AdoptError, Worker, WorkerStats, WorkerSupervisor

log = logging.getLogger("gpupoold.leases")

ADOPT_SLACK = 60.0  # seconds beyond worker_orphan_grace that a busy worker has to answer ADOPT
# Seconds start-up waits for the previous daemon's workers to answer their adoption before it
# places their leases: an idle one (a detached lease's is parked) answers within milliseconds.
ADOPT_PEEK = 2.0
# Why a lease never detaches when its client's hello asked so (GP_HELLO_KEEP_GPU); a lease taken
# over says the same by its worker's word (worker_adopted's GP_ADOPTED_KEEP_GPU).
KEEPS_GPU_ASKED = "its client asked to keep its GPU while idle (GPUPOOL_KEEP_GPU=1 or keep_gpu = true)"


class PreviousLeases:
    """The lease manager's take-over of a previous daemon's leases (mixed into LeaseManager)."""

    settings: Settings
    store: Store
    supervisor: WorkerSupervisor
    counters: Counters
    pool: PoolState
    slots: list[Slot]
    detacher: IdleDetacher
    _closing: bool

    # The lease manager's, used here.
    def _watch(self, lease: Lease) -> Any: ...
    def _clean(self, slot: Slot, lease_ids: list[int]) -> Any: ...
    def _clean_together(self, slots: list[Slot], lease_id: int) -> Any: ...
    def _expire(self, lease: Lease) -> None: ...
    def _dispatch(self) -> None: ...

    def _slot_of(self, rec: LeaseRecord, index: int | None = None) -> Slot | None:
        """The slot of a previous lease's GPU (the one it started on, or `index`), if this
        daemon still serves that very GPU (the record's UUID is the one it started on's)."""
        at = rec.gpu_index if index is None else index
        if not 0 <= at < len(self.slots):
            return None
        slot = self.slots[at]
        if at == rec.gpu_index and rec.gpu_uuid and slot.gpu.uuid and rec.gpu_uuid != slot.gpu.uuid:
            return None
        return slot

    async def _last_gpu(self, rec: LeaseRecord) -> int:
        """The GPU a previous lease was on last, as the store has it: that of its last detach
        or attach event (an idle lease that detaches comes back on any GPU of the same model,
        pool/detach.py), else the one it started on. The record's gpu_index stays the GPU it
        started on: the history draws each stretch from it and the events
        (dashboard/timeline.py), so rewriting it would move the lease's first stretch too."""
        try:
            events = await self.store.lease_events(rec.id)
        except Exception:
            log.exception("lease %d: reading its events failed; looking for it on the GPU it "
                          "started on (%d)", rec.id, rec.gpu_index)
            return rec.gpu_index
        moves = [e["gpu"] for e in events
                 if e["state"] in (ATTACHED, DETACHED) and e["gpu"] is not None]
        return int(moves[-1]) if moves else rec.gpu_index

    async def _gpus_of(self, rec: LeaseRecord) -> list[Slot] | str:
        """Every GPU of a previous lease of several GPUs, in its program's order, or why it
        cannot be taken over. Where it is: the GPUs its last idle-detach event names (it may
        have come back on others, pool/detach.py: schema v15 keeps them all), else those it
        started on (the store's `gpus`, schema 12: its worker's own GPU first). Not taken over:
        one of them is not served here, or it moved and its events were written before v15
        (they name device 0's GPU only, so where the others are is not known)."""
        try:
            events = await self.store.lease_events(rec.id)
        except Exception:
            log.exception("lease %d: reading its events failed", rec.id)
            return "its events could not be read (the log says why)"
        moves = [e for e in events if e["state"] in (ATTACHED, DETACHED)]
        where = list(moves[-1].get("gpus") or []) if moves else list(rec.gpus)
        if len(where) != len(rec.gpus):  # events written before v15
            if any(e["state"] == ATTACHED and str(e.get("detail") or "").startswith("moved from")
                   for e in events):
                return ("it moved to other GPUs after an idle detach, recorded before the "
                        "store kept all of them (schema v15): it knows only the first")
            where = list(rec.gpus)  # never moved: still on the GPUs it started on
        slots = [self._slot_of(rec, index) for index in where]
        missing = [index for index, slot in zip(where, slots, strict=True) if slot is None]
        if missing:
            return f"GPU {', '.join(map(str, missing))} of it is not served any more"
        return [slot for slot in slots if slot is not None]

    async def _close_unowned(self, gone: list[LeaseRecord], several: list[tuple[LeaseRecord, str]],
                             unscrubbed: list[LeaseRecord], placed: dict[int, Slot | None],
                             adopting: dict[int, tuple[LeaseRecord, int]]) -> dict[int, list[int]]:
        """Close the records of the previous daemon's leases nobody takes over (`gone`: their
        workers are gone; `several`: leases of several GPUs that cannot be), and find those that
        ended before their GPU's scrub (`unscrubbed`): GPU index -> their lease ids, whose scrub
        the start-up scrub of that GPU is, or (a GPU in `adopting`) its whole scrub after the
        leases taken over on it end."""
        orphaned: dict[int, list[int]] = {}
        for rec in gone:
            last = placed[rec.id]  # (its GPU's start-up scrub is recorded for it)
            index = last.gpu.index if last else rec.gpu_index
            # Beside shares taken over (issue 32), its GPU is scrubbed whole after they end.
            await self._close_previous(rec, "gpupoold stopped while the lease was active and its "
                                       "worker is gone; " + (
                                           f"GPU {index} is scrubbed whole when the leases "
                                           "taken over on it (its other shares) end; no new "
                                           "share lands on it before"
                                           if index in adopting else
                                           "its GPU was scrubbed at the next start"))
            orphaned.setdefault(index, []).append(rec.id)
        for rec, why in several:
            log.warning("lease %d of the previous gpupoold held GPUs %s and cannot be taken "
                        "over: %s; its worker was ended and its GPUs are scrubbed", rec.id,
                        ", ".join(map(str, rec.gpus)), why, extra=journal_fields(rec.id))
            await self._close_previous(rec, f"gpupoold restarted and could not take over the "
                                       f"lease of several GPUs ({why}); its GPUs were scrubbed "
                                       "at the start")
            orphaned.setdefault(rec.gpus[0], []).append(rec.id)
        if gone:
            log.warning("closed %d lease record(s) left open by a previous gpupoold", len(gone))
        # A lease that ended while the previous daemon stopped before its GPU's scrub: the
        # start-up scrub of that very GPU is its scrub.
        for rec in unscrubbed:
            slot = self._slot_of(rec, await self._last_gpu(rec))  # (where it ended)
            if slot is not None:
                log.info("lease %d ended before the previous gpupoold stopped, its GPU not yet "
                         "scrubbed: the next scrub of GPU %d (%s) is recorded for it", rec.id,
                         slot.gpu.index, "after the leases taken over on it end"
                         if slot.gpu.index in adopting else "at this start",
                         extra=journal_fields(rec.id, slot.gpu.index))
                orphaned.setdefault(slot.gpu.index, []).append(rec.id)
        return orphaned

    def _on_now(self, answer: asyncio.Task[Worker | AdoptError], placed: Slot | None,
                ) -> Slot | None:
        """The GPU an attached previous lease is on: its worker's word (the UUID it runs on) once
        it has answered, else the store's (`placed`: a worker busy in a call answers later, and
        its GPU must be kept leased meanwhile; _adopt checks the UUID then). None when the store
        places it on no GPU served here (its record names another GPU than this server's of
        that index): the worker's word does not overrule a record that does not match."""
        if placed is None:
            return None
        worker = answer.result() if answer.done() and not answer.cancelled() else None
        if isinstance(worker, Worker) and worker.uuid:
            said = next((s for s in self.slots if s.gpu.uuid == worker.uuid), None)
            if said is not None:
                return said
        return placed

    async def _close_previous(self, rec: LeaseRecord, detail: str) -> None:
        """Close the record of a previous daemon's lease that nobody takes over: with the end
        its worker recorded when it ended alone (worker/adopt.c), else as "daemon lost"."""
        end = await asyncio.to_thread(self.supervisor.end_record, rec.id)
        reason, stats = "daemon lost", WorkerStats()
        if end is not None:
            stats = WorkerStats.from_counters(end.counters)
            reason = end.reason or "daemon lost"
            detail = end.detail or detail
        try:
            await self.store.lease_ended(rec.id, time.time(), reason, detail, stats.bytes_h2d,
                                         stats.bytes_d2h, dict(stats.calls),
                                         module_bytes=stats.module_bytes)
        except Exception:
            log.exception("lease %d: closing its record failed", rec.id)
        self.counters.inc("leases_ended", reason=reason)
        await asyncio.to_thread(self.supervisor.forget_lease, rec.id)

    async def _adoption(self, placed: Slot | None, sock: socket.socket,
                        pid: int) -> Worker | AdoptError:
        """Adopt the worker of a previous daemon's lease (on `placed`, where the store says it
        is): the worker once it has answered, or why it could not be adopted. A worker busy in
        one call answers when it returns; one that has not answered a minute after its own grace
        would have ended has lost its way."""
        slot = placed or (self.slots[0] if self.slots else None)
        if slot is None:
            sock.close()
            return AdoptError("this gpupoold serves no GPU")
        try:
            return await self.supervisor.adopt(
                slot.gpu, sock, pid, max_wait=self.settings.worker_orphan_grace + ADOPT_SLACK)
        except AdoptError as exc:
            return exc

    async def _answered(self, slot: Slot, rec: LeaseRecord,
                        answer: asyncio.Task[Worker | AdoptError], pid: int) -> Worker:
        """The worker of previous lease `rec` on `slot`, once it has answered its adoption, or
        AdoptError: it could not be adopted, or it serves another lease or GPU (it is retired)."""
        worker = await answer
        if isinstance(worker, AdoptError):
            raise worker
        if worker.adopted_detached is not None:  # it answered late, yet parked
            await self.supervisor.retire(worker)
            raise AdoptError(f"worker pid {pid} says its lease is detached, but it did not "
                             f"answer within {ADOPT_PEEK:g} s")
        if worker.session_id != rec.id:
            await self.supervisor.retire(worker)
            raise AdoptError(f"worker pid {pid} serves session {worker.session_id}, not "
                             f"lease {rec.id}")
        if worker.uuid and slot.gpu.uuid and worker.uuid != slot.gpu.uuid:
            await self.supervisor.retire(worker)
            raise AdoptError(f"worker pid {pid} runs on {worker.uuid}, not on GPU "
                             f"{slot.gpu.index} ({slot.gpu.uuid})")
        worker.gpu = slot.gpu  # (asked on the store's word; its UUID names this GPU)
        return worker

    def _lease_of(self, rec: LeaseRecord, worker: Worker, slot: Slot | None, gpus: int = 1,
                  share: bool = False) -> Lease:
        """The lease of a previous daemon's record, as its worker says it was asked for (its
        memory: its quota, the share's size; whether its client asked to keep its GPU, which a
        share under MPS always does); watched by the task taking it over."""
        req = worker.request
        keep_gpu = _keeps_gpu(worker) or (
            MPS_SHARE_KEEPS_GPU if share and self.settings.share_mps else None)
        return Lease(id=rec.id, slot=slot, token=rec.token_name,
                     client=ClientInfo(host=rec.client_host, user=rec.client_user,
                                       pid=rec.client_pid, program=rec.program, peer=rec.peer),
                     req=Requirements(gpu=str(req.get("gpu") or ""),
                                      model=str(req.get("model") or ""),
                                      min_memory=_nonneg(req.get("min_memory")),
                                      gpus=gpus, memory=_nonneg(req.get("memory")),
                                      # a part of a spread lease stays one: its links
                                      # (remoting/peer_links.py) find it by these
                                      spread_group=rec.spread_group, part=rec.part,
                                      parts=rec.parts),
                     worker=worker, queued_s=rec.queued_s, started=rec.started,
                     watcher=asyncio.current_task(), share=share, keep_gpu=keep_gpu)

    def _limit_time(self, lease: Lease) -> None:
        """max_lease_seconds counts from the lease's start, not from its take-over."""
        limit = self.settings.max_lease_seconds
        if limit > 0:
            left = max(0.0, limit - (time.time() - lease.started))
            lease.timer = asyncio.get_running_loop().call_later(left, self._expire, lease)

    def _shared_here(self, slot: Slot) -> bool:
        """Whether this daemon's configuration shares `slot`'s GPU (`share`, `share_gpus`)."""
        return ShareSettings.of(self.settings.share, self.settings.share_gpus).shared(
            slot.gpu.index)

    async def _adopt_on(self, slot: Slot, entries: list[tuple[LeaseRecord, int]],
                        answers: dict[int, asyncio.Task[Worker | AdoptError]],
                        unzeroed: list[int] | None = None) -> None:
        """Take over the previous daemon's leases of one GPU each that were on `slot` (record,
        worker pid): one is a whole-GPU lease as before, unless its worker has a memory quota
        and this daemon shares the GPU: then, as several on one GPU always are, its shares
        (issue 32; the previous daemon shared it, whatever this one's `share` says now).
        `unzeroed` (None: nothing): `slot` may hold memory nobody zeroed (the closed records of
        leases on it nobody takes over, listed; or it was closed to new shares when the previous
        daemon stopped): it takes no new share until scrubbed whole, which records their scrub."""
        if len(entries) == 1:
            rec, pid = entries[0]
            worker = await answers[rec.id]
            if not (isinstance(worker, Worker) and _ran_as_share(worker)
                    and self._shared_here(slot)):
                await self._adopt(slot, rec, answers[rec.id], pid, orphans=unzeroed or [])
                return
        await self._adopt_shares(slot, entries, answers, unzeroed)

    async def _adopt_shares(self, slot: Slot, entries: list[tuple[LeaseRecord, int]],
                            answers: dict[int, asyncio.Task[Worker | AdoptError]],
                            unzeroed: list[int] | None = None) -> None:
        """Take over the previous daemon's shares of `slot` as its shares, in one step once
        every worker answered (none is counted before the others' quotas are known), each
        watched as any share: its end zeroes its memory, the last one's scrubs the GPU whole
        (share_leases.py). One that cannot be taken over ends: its worker retired (or gone),
        its record closed, and as nothing says its memory was zeroed the GPU takes no new share
        until it is scrubbed whole after the others; with none taken over, it is scrubbed now."""
        taken: list[Lease] = []
        failed: list[int] = []
        for rec, pid in entries:
            try:
                worker = await self._answered(slot, rec, answers[rec.id], pid)
                if _nonneg(worker.request.get("memory")) <= 0:
                    await self.supervisor.retire(worker)
                    raise AdoptError(f"worker pid {pid} held GPU {slot.gpu.index} whole (no "
                                     f"memory quota), and other leases of the previous gpupoold "
                                     f"were on it too")
            except AdoptError as exc:
                log.error("share %d of GPU %d could not be taken over: %s; GPU %d takes no new "
                          "share until its other shares end and it is scrubbed whole", rec.id,
                          slot.gpu.index, exc, slot.gpu.index,
                          extra=journal_fields(rec.id, slot.gpu.index))
                await self._close_previous(rec, f"gpupoold restarted and could not take over "
                                                f"the share: {exc}")
                failed.append(rec.id)
                continue
            taken.append(self._lease_of(rec, worker, slot, share=True))
        if unzeroed is not None and taken:
            log.warning("GPU %d: a share of the previous gpupoold %s, its memory maybe not "
                        "zeroed: no new share on it until it is scrubbed whole, when the shares "
                        "taken over end", slot.gpu.index,
                        f"ended while it was down (lease {', '.join(map(str, unzeroed))})"
                        if unzeroed else "had died before it stopped",
                        extra=journal_fields(gpu=slot.gpu.index))
        if self.pool.adopted_shares(slot, taken, closed=bool(failed) or unzeroed is not None):
            if not self._closing:
                await self._clean(slot, [*failed, *(unzeroed or [])])
            return
        for lease in taken:
            self.counters.inc("leases_adopted")
            self._limit_time(lease)
            lease.watcher = self._spawn(self._watch(lease), f"lease-{lease.id}")
            log.info("lease %d taken over: a share of GPU %d, %d bytes, %s, worker pid %d (it "
                     "served %.1f s without gpupoold)", lease.id, slot.gpu.index,
                     lease.req.quota(slot.gpu), lease.client.describe(), lease.worker.pid,
                     lease.worker.orphaned_s,
                     extra=journal_fields(lease.id, slot.gpu.index, lease.client.describe()))
        if not self._shared_here(slot) or len(taken) > self.settings.share:
            log.warning("GPU %d: %d share(s) of the previous gpupoold taken over, where this "
                        "configuration shares it %s: they run on, and it takes no new share "
                        "(nor a whole-GPU lease) until they have ended and it is scrubbed whole",
                        slot.gpu.index, len(taken),
                        f"{self.settings.share} ways" if self._shared_here(slot) else "not at all")
        self._dispatch()  # room for new shares beside them

    async def _adopt(self, slot: Slot, rec: LeaseRecord,
                     answer: asyncio.Task[Worker | AdoptError], pid: int,
                     others: list[Slot] | None = None, orphans: list[int] | None = None) -> None:
        """Take over a previous daemon's lease on `slot` (state leased meanwhile), and a lease of
        several GPUs on `others` too (its worker holds them all), then watch it as any other; a
        worker that cannot be adopted ends and its GPUs are scrubbed (recorded for `orphans`
        too: closed records of leases that were on them). A lease taken over ends with its
        GPUs' whole scrub, as any whole-GPU lease: nobody gets them before."""
        others = others or []
        try:
            worker = await self._answered(slot, rec, answer, pid)
        except AdoptError as exc:
            on = ", ".join(str(s.gpu.index) for s in (slot, *others))
            log.error("lease %d on GPU %s could not be taken over: %s; %s scrubbed", rec.id, on,
                      exc, "its GPUs are" if others else "its GPU is",
                      extra=journal_fields(rec.id, slot.gpu.index))
            await self._close_previous(rec, f"gpupoold restarted and could not take over the "
                                            f"lease: {exc}")
            if not self._closing:  # (the scrub ends the take-over; one failing quarantined alone)
                if others:
                    await self._clean_together([slot, *others], rec.id)
                else:
                    await self._clean(slot, [rec.id, *(orphans or [])])
            return
        lease = self._lease_of(rec, worker, slot, gpus=1 + len(others))
        self.pool.adopted(slot, lease, others)
        self.counters.inc("leases_adopted")
        self._limit_time(lease)
        log.info("lease %d taken over: GPU %s, %s, worker pid %d (it served %.1f s without "
                 "gpupoold)", lease.id, ", ".join(str(s.gpu.index) for s in lease.slots()),
                 lease.client.describe(), worker.pid, worker.orphaned_s,
                 extra=journal_fields(lease.id, slot.gpu.index, lease.client.describe()))
        await self._watch(lease)

    async def _adopt_detached(self, rec: LeaseRecord, worker: Worker,
                              placed: Slot | None, homes: list[Slot] | None = None) -> None:
        """Take over a previous daemon's lease that was detached when it stopped (its worker
        said so, worker/adopt.c): active again on no GPU, its client's next call brings it back
        on the GPU it left (its worker's word, else the store's: `placed`) or another of the
        same model, as after any detach (pool/detach.py). A lease of several GPUs left all of
        `homes` (the store's, program order) and comes back on as many."""
        home = next((s for s in self.slots if worker.uuid and s.gpu.uuid == worker.uuid), placed)
        why = None
        if worker.session_id != rec.id:
            why = f"worker pid {worker.pid} serves session {worker.session_id}, not lease {rec.id}"
        elif home is None:
            why = (f"the GPU it was detached from ({worker.uuid or rec.gpu_uuid}) is not served "
                   f"any more: its saved state can be restored on that model only")
        elif homes and home is not homes[0]:
            why = (f"its worker says it left GPU {home.gpu.index} first, and its record says "
                   f"GPU {homes[0].gpu.index}")
        if why is not None:
            log.error("detached lease %d cannot be taken over: %s; ending it", rec.id, why,
                      extra=journal_fields(rec.id))
            await self.supervisor.retire(worker)
            await self._close_previous(rec, f"gpupoold restarted and could not take over the "
                                            f"detached lease: {why}")
            return
        assert home is not None and worker.adopted_detached is not None
        # A share (its worker has a quota, issue 32) comes back as a share, through the share
        # placement (room for its quota), when the GPU it left is shared here; else whole.
        share = len(homes or []) <= 1 and _ran_as_share(worker) and self._shared_here(home)
        lease = dataclasses.replace(
            self._lease_of(rec, worker, None, gpus=len(homes) if homes else 1, share=share),
            detaches=rec.detaches, detached_s=rec.detached_s)
        self.pool.adopted_detached(lease, home.gpu, worker.adopted_detached,
                                   await self._detached_since(rec.id),
                                   [s.gpu for s in homes or []])
        self.counters.inc("leases_adopted")
        self._limit_time(lease)
        log.info("lease %d taken over detached (from GPU %s, %d bytes of device memory saved), "
                 "%s, worker pid %d: its client's next call brings it back on %s", lease.id,
                 ", ".join(str(s.gpu.index) for s in homes or [home]), worker.adopted_detached,
                 lease.client.describe(), worker.pid,
                 "a share of a shared GPU" if share else "a GPU",
                 extra=journal_fields(lease.id, home.gpu.index, lease.client.describe()))
        self.detacher.resume(lease)
        self._dispatch()  # a waiter its token's max_gpus_per_token held back may be again
        await self._watch(lease)

    async def _detached_since(self, lease_id: int) -> float | None:
        """When the lease's last detach was recorded (its time detached goes on from there
        across the restart), or None."""
        try:
            events = await self.store.lease_events(lease_id)
        except Exception:
            log.exception("lease %d: reading its events failed; its time detached counts from "
                          "now", lease_id)
            return None
        last = events[-1] if events else None
        return float(last["at"]) if last is not None and last["state"] == DETACHED else None

    async def _refuse_previous(self, rec: LeaseRecord,
                               answer: asyncio.Task[Worker | AdoptError], why: str) -> None:
        """A previous lease this daemon cannot take over (its GPU is gone or taken): end its
        worker and close the record."""
        log.error("lease %d of the previous gpupoold cannot be taken over: %s; ending it",
                  rec.id, why, extra=journal_fields(rec.id))
        worker = await answer
        if isinstance(worker, Worker):
            await self.supervisor.retire(worker)
        await self._close_previous(rec, f"gpupoold restarted and could not take over the "
                                        f"lease: {why}")


def _ran_as_share(worker: Worker) -> bool:
    """Whether a previous daemon's worker served a share of a shared GPU, by its word
    (GP_ADOPTED_SHARE); a worker from before protocol 1.7 says nothing: then whether it has a
    memory quota (a whole-GPU lease's quota on an unshared GPU reads as a share)."""
    flags = getattr(worker, "adopted_flags", 0)
    if flags & gp.GP_ADOPTED_SAID:
        return bool(flags & gp.GP_ADOPTED_SHARE)
    return _nonneg(worker.request.get("memory")) > 0


def _keeps_gpu(worker: Worker) -> str | None:
    """Why a previous daemon's lease never detaches, by its worker's word, or None."""
    if getattr(worker, "adopted_flags", 0) & gp.GP_ADOPTED_KEEP_GPU:
        return KEEPS_GPU_ASKED
    return None


def _nonneg(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
