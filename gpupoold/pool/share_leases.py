"""Shared GPUs (issue 32, `share` > 1): the part of the lease manager (pool/leases.py, which
inherits it) that places shares with pool/shares.py's policy, starts each share's lease in a
worker of its own and scrubs a shared GPU whole when its last share ends. Apart from
pool/leases.py for length only; the attributes below are the lease manager's.

A share's worker gets `memory_quota` = its size (worker/quota.c counts every byte and zeroes
what it frees, so the GPU needs no scrub between shares), and, in its environment, the pacing
record of its GPU (worker/pacing.c: `GPUPOOL_WORKER_PACE_DIR`, `_PACE_GPU` = the GPU's UUID,
`_SHARE_WEIGHT` = its token's weight, `gpupoold token create --weight`) and, on a simulated
GPU, the shared allocator of that GPU (`GPUPOOL_SIM_SHARED_DIR`, worker/sim/README.md "A GPU
shared by several processes"), in a folder among its sandbox's writable ones (`shares/` beside
the simulated GPUs' memory, or in the cache folder for real GPUs). With `share_mps`, the
workers of shares also get `CUDA_MPS_PIPE_DIRECTORY` and may reach that folder and /dev/shm, so
their contexts join the operator's MPS server (gpupoold never starts one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gpupoold.config.settings import Settings
from gpupoold.gpu.inventory import Gpu
from gpupoold.pool.counters import Counters
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.shares import (
    GpuRoom,
    Request,
    ShareSettings,
    is_share,
    never_fits,
    place_wanted,
    plan,
)
from gpupoold.pool.slots import FREE, LEASED, Lease, Slot
from gpupoold.pool.state import PoolState, in_service
from gpupoold.pool.waitqueue import Waiter, WaitQueue
from gpupoold.store.database import Store, store_errors
from gpupoold.workers.supervisor import WorkerExit, WorkerStartError, WorkerSupervisor

log = logging.getLogger("gpupoold.leases")

# A share detaches when idle like a whole GPU's lease (pool/detach.py), except in the operator's
# MPS server: the driver's process checkpoint of an MPS client is not checked yet.
MPS_SHARE_KEEPS_GPU = ("a share in the operator's MPS server (share_mps) keeps its place: the "
                       "driver's checkpoint of an MPS client is not supported by gpupool yet")
# An MPS client (share_mps) shares memory with its MPS server through /dev/shm/cuda.shm.*
# files the driver names itself; without them it cannot connect, whatever its pipe directory.
MPS_CLIENT_PATHS = ("/dev/shm",)
SHARE_WEIGHT = "1"  # a pre-started worker's; a share of another weight gets a worker of its own


def shares_folder(settings: Settings, gpu: Gpu) -> Path:
    """Where the shares of `gpu` keep their pacing record (and, simulated, their GPU's shared
    allocator): in the folder of the simulated GPU's memory (its first writable folder), else
    in the cache folder, both theirs to write already; never elsewhere in the state directory,
    which a worker does not open (docs/security.md, "The worker")."""
    base = Path(gpu.writable[0]) if gpu.simulated and gpu.writable else settings.effective_cache_dir
    return base / "shares"


def shared_gpu(gpu: Gpu, settings: Settings) -> Gpu:
    """`gpu` as every worker of a shared GPU runs it (the pre-started one too, which the first
    share takes): its GPU's pacing record with weight 1 (a share of another weight gets a worker
    of its own, begin_share; a worker alone on the GPU is never slowed down), and on a simulated
    GPU one allocator for all its processes."""
    folder = shares_folder(settings, gpu)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    pace_gpu = "".join(c for c in gpu.uuid if c.isalnum() or c == "-") or f"gpu{gpu.index}"
    env = dict(gpu.env, GPUPOOL_WORKER_PACE_DIR=str(folder), GPUPOOL_WORKER_PACE_GPU=pace_gpu,
               GPUPOOL_WORKER_SHARE_WEIGHT=SHARE_WEIGHT)
    if gpu.simulated:
        env["GPUPOOL_SIM_SHARED_DIR"] = str(folder)
    writable = (*gpu.writable, str(folder))
    if settings.share_mps:
        env["CUDA_MPS_PIPE_DIRECTORY"] = settings.share_mps
        writable = (*writable, *MPS_CLIENT_PATHS, settings.share_mps)
    return dataclasses.replace(gpu, env=env, writable=writable)


def share_rooms(slots: list[Slot]) -> list[GpuRoom]:
    """What pool/shares.py's policy needs to know of each GPU now."""
    return [GpuRoom(index=s.gpu.index, memory_total=s.gpu.memory_total,
                    free=s.state == FREE and in_service(s), shares=s.share_quotas(),
                    closed=s.share_closed or not in_service(s), claimed_by=s.kept_for)
            for s in slots]


def returning_share(pool: PoolState, w: Waiter) -> Lease | None:
    """The detached share whose waiter `w` is (it comes back as a share), else None."""
    lease = pool.lease(w.returning) if w.returning is not None else None
    return lease if lease is not None and lease.share else None


def placed_as_share(pool: PoolState, w: Waiter) -> bool:
    """Whether pool/shares.py places `w`: a new request of one GPU or a returning share (a
    returning whole-GPU lease is seated by pool/detach.py)."""
    return w.req.gpus <= 1 and (w.returning is None or returning_share(pool, w) is not None)


def share_request(pool: PoolState, w: Waiter) -> Request:
    """Waiter `w` as pool/shares.py's policy sees it."""
    accepts = frozenset(s.gpu.index for s in pool.slots if w.accepts(s.gpu))
    lease = returning_share(pool, w)
    home = lease.home.index if lease is not None and lease.home is not None else None
    return Request(id=w.ticket, memory=w.req.memory, accepts=accepts, home=home)


def share_place_wanted(pool: PoolState, queue: WaitQueue, settings: ShareSettings,
                       may_take: Callable[[Waiter], bool], lease: Lease) -> bool:
    """Whether the place of share `lease` (its count and quota on its GPU) would go to a
    waiter now if it left (pool/detach.py asks before detaching it for the queue): the policy's
    round over the waiters it places, as dispatch_shares runs it, on the rooms without it. When
    it is its GPU's last share, a waiter the policy does not place (several GPUs, a returning
    whole-GPU lease) that may take the GPU counts too: the GPU is free after its whole scrub."""
    slot = lease.slot
    if slot is None:
        return False
    waiters = [w for w in queue.in_turn() if may_take(w) and w.returning != lease.id]
    placed = [w for w in waiters if placed_as_share(pool, w)]
    if place_wanted([share_request(pool, w) for w in placed], share_rooms(pool.slots), settings,
                    slot.gpu.index, lease.id):
        return True
    last = all(other is lease for other in slot.shares) and not slot.share_grants
    return last and any(w.accepts(slot.gpu) for w in waiters if w not in placed)


class SharedGpus:
    """The lease manager's shares of shared GPUs (mixed into LeaseManager)."""

    settings: Settings
    store: Store
    supervisor: WorkerSupervisor
    counters: Counters
    pool: PoolState
    slots: list[Slot]
    queue: WaitQueue
    _closing: bool

    # The lease manager's, used here.
    def _watch(self, lease: Lease) -> Any: ...
    def _clean(self, slot: Slot, lease_ids: list[int]) -> Any: ...
    def _expire(self, lease: Lease) -> None: ...
    def _dispatch(self) -> None: ...
    def _prestart(self, slot: Slot) -> None: ...
    def _own(self, slot: Slot, coro: Any, name: str) -> asyncio.Task[Any]: ...
    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]: ...
    def _take_worker(self, slot: Slot) -> Any: ...
    def _record_start(self, w: Waiter, slot: Slot) -> Any: ...
    def _hand_over(self, lease: Lease, client_fd: int, hello_body: bytes, hello_req: int,
                   before_handover: Callable[[], Awaitable[None]] | None, what: str,
                   fail: Callable[[str | None], Exception], start_timeout: float,
                   devices: list[int] | None = None, memory_quota: int = 0) -> Any: ...
    def may_take(self, w: Waiter) -> bool: ...

    def share_settings(self) -> ShareSettings:
        return ShareSettings.of(self.settings.share, self.settings.share_gpus)

    def _rooms(self) -> list[GpuRoom]:
        return share_rooms(self.slots)

    def _request(self, w: Waiter) -> Request:
        return share_request(self.pool, w)

    def _placed_as_share(self, w: Waiter) -> bool:
        return placed_as_share(self.pool, w)

    def is_share_waiter(self, w: Waiter) -> bool:
        settings = self.share_settings()
        return settings.share > 1 and self._placed_as_share(w) and is_share(
            self._request(w), settings, self._rooms())

    def share_refusal(self, req: Requirements) -> str | None:
        """Why a share asked with `req` can never be placed here (larger than every shared GPU
        it accepts), or None: refused at its hello rather than left to wait forever."""
        settings = self.share_settings()
        if settings.share <= 1 or req.memory <= 0 or req.gpus > 1:
            return None
        accepts = frozenset(s.gpu.index for s in self.slots if req.matches(s.gpu))
        why = never_fits(Request(id=0, memory=req.memory, accepts=accepts), settings, self._rooms())
        return f"GPUPOOL_MEMORY: {why}" if why is not None else None

    def whole_may_take(self, slot: Slot, w: Waiter) -> bool:
        """Whether whole-GPU waiter `w` may take free `slot`: not one kept for another waiter."""
        return slot.kept_for is None or slot.kept_for == w.ticket

    def dispatch_shares(self) -> None:
        """One round of pool/shares.py's placement over the waiters that may take a GPU now
        (in turn): the shares granted, the claims of whole-GPU waiters kept."""
        settings = self.share_settings()
        if settings.share <= 1 or self._closing:
            return
        waiters = [w for w in self.queue.in_turn() if self.may_take(w)
                   and self._placed_as_share(w)]
        if not waiters:
            for s in self.slots:
                self.pool.keep_for(s, None)
            return
        rooms = self._rooms()
        by_ticket = {w.ticket: w for w in waiters}
        out = plan([self._request(w) for w in waiters], rooms, settings)
        for s in self.slots:
            self.pool.keep_for(s, out.claims.get(s.gpu.index))
        for p in out.placements:
            if p.share:
                self._grant_share(self.slots[p.gpu], by_ticket[p.request])

    def _grant_share(self, slot: Slot, w: Waiter) -> None:
        self.queue.granted(w)
        w.granted = [slot]
        self.pool.grant_share(slot, w)
        w.future.set_result(slot)

    async def share_weight(self, token: str) -> int:
        """The share weight of `token` (1 when it has none: no such token, `auth = none`, or the
        store unreachable, which only costs the share its weight, never its lease)."""
        if not token:
            return 1
        try:
            record = await self.store.get_token(token)
        except store_errors() as exc:
            log.warning("token %s: its share weight is unknown (%s); its share runs with weight "
                        "1", token, exc)
            return 1
        return 1 if record is None else record.weight

    async def begin_share(self, w: Waiter, slot: Slot, hello_body: bytes, hello_req: int,
                          client_fd: int,
                          before_handover: Callable[[], Awaitable[None]] | None,
                          fail: Callable[[str | None], Exception], start_timeout: float,
                          keep_gpu: str | None = None) -> Lease:
        """Start the lease of a share granted to `w` on `slot`, in a worker of its own: the
        GPU's pre-started one for its first share, a new one for the others. `fail` makes the
        lease manager's LeaseStartError (None: the worker told the client why); `keep_gpu`: why
        it never detaches when idle, its client asked (None: it may, pool/detach.py)."""
        weight = await self.share_weight(w.token)
        try:
            if weight != int(SHARE_WEIGHT):  # the weight is read when the worker starts
                worker = await self.supervisor.spawn(dataclasses.replace(
                    slot.gpu, env=dict(slot.gpu.env, GPUPOOL_WORKER_SHARE_WEIGHT=str(weight))))
            elif slot.idle_worker is not None or slot.prestart_task is not None:
                worker = await self._take_worker(slot)
            else:
                worker = await self.supervisor.spawn(slot.gpu)
        except WorkerStartError as exc:
            self._release_share(slot, w)
            raise fail(f"the server could not start a worker for a share of GPU "
                       f"{slot.gpu.index}: {exc}") from None
        try:
            lease_id = await self._record_start(w, slot)
        except Exception:
            worker.kill()
            self._release_share(slot, w)
            raise
        lease = Lease(id=lease_id, slot=slot, token=w.token, client=w.client, req=w.req,
                      worker=worker, queued_s=w.waited(), share=True,
                      keep_gpu=keep_gpu or (MPS_SHARE_KEEPS_GPU if self.settings.share_mps
                                                     else None))
        self.counters.inc("leases_started")
        self.pool.start_share(slot, w, lease)
        lease.watcher = self._spawn(self._watch(lease), f"lease-{lease.id}")
        quota = w.req.quota(slot.gpu)
        await self._hand_over(lease, client_fd, hello_body, hello_req, before_handover,
                              f"a share of GPU {slot.gpu.index}", fail, start_timeout,
                              memory_quota=quota)
        log.info("lease %d: a share of GPU %d, %d bytes, weight %d (%d shares on it)", lease.id,
                 slot.gpu.index, quota, weight, len(slot.shares))
        return lease

    def _release_share(self, slot: Slot, w: Waiter) -> None:
        """A share grant nobody used; the GPU is scrubbed whole when nothing is left on it."""
        if self.pool.release_share(slot, w):
            self._own(slot, self._clean(slot, []), f"scrub-{slot.gpu.index}")
        else:
            self._dispatch()

    async def share_ended(self, lease: Lease, slot: Slot, ex: WorkerExit, last: bool) -> None:
        """After `lease` (a share of `slot`) ended and was recorded: a worker that died did not
        zero its memory, so the GPU takes no new share; the share whose end left the GPU empty
        (`last`, decided when it ended: the other shares' watchers may still be recording
        theirs) scrubs it whole."""
        if ex.reason == "worker crashed" and lease.end_override is None:
            log.warning("GPU %d: the worker of share %d died; no new share on it until it is "
                        "scrubbed whole, when its other shares end", slot.gpu.index, lease.id)
            self.pool.close_shares(slot)
        if last and slot.state == LEASED and not slot.shares and not slot.share_grants \
                and slot.lease is None and slot.reserved is None:
            slot.task = asyncio.current_task()
            await self._clean(slot, [lease.id])
        else:
            self._dispatch()
