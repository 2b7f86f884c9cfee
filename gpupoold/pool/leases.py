"""Leases: one whole GPU per client process, a FIFO queue when all are taken, a scrub after each.

Each GPU is a `Slot` in one of five states (free, leased, scrubbing, quarantined, drained): the
state diagram is pool/state.py's, which alone moves slots and leases; this module is the policy
that decides when (a grant, a lease's start and end, a scrub's result, an operator's action, the
watchdog's repair), and calls its transitions.

A lease ends when its worker exits: the client said goodbye ("client exit"), its connection was
lost ("client lost"), the worker crashed, an operator ended it ("revoked"), it reached
`max_lease_seconds` ("max duration"), or the daemon stopped. Every end is written to the store
with the bytes moved, then the GPU is scrubbed and checked (gpu/cleaner.py) and the result is added
to the same record. A free GPU keeps a pre-started worker (driver loaded, context created) so that
a new client's hello is answered without waiting for initialisation.

At start-up every GPU is scrubbed before its first lease (a previous daemon may have died with
leases open: their records are closed as "daemon lost" and get that scrub's result), and workers
a dead daemon left behind are killed; leases whose workers still run are taken over, on their GPUs
or, detached when that daemon stopped, on none (their client's next call brings them back):
pool/takeover.py, the part of this policy that takes them over.
Drained and quarantined GPUs stay so across restarts (in the store's gpu_state table).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import gpupool_protocol as gp

from gpupoold.config.settings import Settings
from gpupoold.gpu.cleaner import CleanResult, GpuCleaner
from gpupoold.gpu.inventory import Inventory
from gpupoold.log import journal_fields
from gpupoold.pool.counters import Counters
from gpupoold.pool.detach import Checkpointer, IdleDetacher
from gpupoold.pool.events import EventBus
from gpupoold.pool.fleet import FleetQueue
from gpupoold.pool.kept_states import KeptStates
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.share_leases import SharedGpus, shared_gpu
from gpupoold.pool.slots import ATTACHED, ATTACHING, DETACHED, DRAINED, FREE, LEASED, QUARANTINED, Lease, Slot
from gpupoold.pool.state import PoolState, in_service
from gpupoold.pool.takeover import ADOPT_PEEK, KEEPS_GPU_ASKED, PreviousLeases
from gpupoold.pool.waitqueue import ClientInfo, Waiter, WaitQueue
from gpupoold.pool.watchdog import Watchdog, stuck_reason
from gpupoold.store.database import LeaseRecord, NewLease, Store
from gpupoold.workers.supervisor import (
    MAX_DEVICES,
    AdoptError,
    Worker,
    WorkerExit,
    WorkerStartError,
    WorkerSupervisor,
    device_ordinal,
)

log = logging.getLogger("gpupoold.leases")

START_TIMEOUT = 30.0  # seconds a worker has to answer a handed-over hello
END_GRACE = 10.0  # seconds a worker told to end a lease has before SIGKILL
PRESTART_RETRY = 5.0  # seconds before a failed pre-start is tried again


class LeaseError(Exception):
    """An API request the lease manager refuses; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


class QueueFull(Exception):
    """The queue is at `max_queue`, or the token's waiting clients at `max_queue_per_token`."""


class ShuttingDown(Exception):
    """The daemon is stopping: no new leases."""


class LeaseStartError(Exception):
    """The granted GPU could not start the lease; the message is for the client (None: the
    worker already answered the client itself)."""

    def __init__(self, message: str | None) -> None:
        super().__init__(message or "")
        self.message = message


class LeaseManager(PreviousLeases, SharedGpus):
    def __init__(self, inventory: Inventory, settings: Settings, store: Store,
                 supervisor: WorkerSupervisor, cleaner: GpuCleaner, counters: Counters,
                 events: EventBus | None = None, checkpointer: Checkpointer | None = None,
                 shared_store: bool = False) -> None:
        self.settings = settings
        # Where grants, ends, scrubs and state changes are published (pool/events.py): the metrics
        # and the dashboard subscribe; this module knows neither.
        self.events = events if events is not None else EventBus()
        self.store = store
        self.supervisor = supervisor
        self.cleaner = cleaner
        self.counters = counters
        # The GPUs' and the leases' states and their one writer (pool/state.py).
        sharing = self.share_settings()  # shared GPUs' workers share an allocator and pacing
        self.pool = PoolState([shared_gpu(g, settings) if sharing.shared(g.index) else g
                               for g in inventory.gpus], self.events)
        self.slots = self.pool.slots
        self.queue = WaitQueue()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        # GPUs whose leases continue without gpupoold after close() (their workers wait for the
        # next daemon): a simulated GPU's memory file must outlive this daemon for them.
        self.kept_gpus: frozenset[int] = frozenset()
        self.kept_states = KeptStates(store, settings.state_dir, self.slots)
        # The other two policies, built with what they use of this one.
        self.detacher = IdleDetacher(
            self.pool, self.queue, settings, store, counters, checkpointer or Checkpointer(None),
            spawn=self._spawn, scrub=self._scrub_soon, seat=self._seat_returning,
            abandon=self.abandon, may_take=self.may_take, dispatch=self._dispatch,
            closing=lambda: self._closing)
        # With a shared store the fleet queue (pool/fleet.py) grants the GPUs, not _dispatch.
        self.fleet: FleetQueue | None = None
        if shared_store:
            self.fleet = FleetQueue(self.pool, self.queue, store, settings.max_gpus_per_token,
                                    grant=self._grant, claim=self._claim,
                                    release=self._release_unused, closing=lambda: self._closing)

    # ---------------------------------------------------------------------------- life cycle
    async def start(self) -> None:
        """Take over from the previous gpupoold, then put every other GPU in service.

        Sessions of the previous daemon whose workers still run (worker/adopt.c) are adopted
        with their leases: their GPUs stay leased, and nobody else gets them. The other open
        records are closed (with the reason the worker left, when it left one) and their GPUs
        are scrubbed before their first lease, like every GPU at start-up."""
        await asyncio.to_thread(self.supervisor.prepare_workers_dir,
                                self.settings.worker_orphan_grace > 0)
        saved = await self.kept_states.load()
        # Read before the open records below are closed: those are scrubbed as "gone".
        unscrubbed = await self.store.unscrubbed_last_leases()
        takeover: list[tuple[LeaseRecord, socket.socket, int]] = []
        gone: list[LeaseRecord] = []
        # Where the store says each open lease is now: idle detach moves leases (_last_gpu).
        placed: dict[int, Slot | None] = {}
        # A lease of several GPUs (issue 37): every one of its GPUs, program order; or why it
        # cannot be taken over (its worker is killed below, its GPUs scrubbed at this start).
        gpus_of: dict[int, list[Slot]] = {}
        several: list[tuple[LeaseRecord, str]] = []
        for rec in await self.store.open_leases():
            placed[rec.id] = self._slot_of(rec, await self._last_gpu(rec))
            if len(rec.gpus) > 1:
                found = await self._gpus_of(rec)
                if isinstance(found, str):
                    several.append((rec, found))
                    continue
                gpus_of[rec.id] = found
            try:
                path = self.supervisor.adoption_socket(rec.id)
                if path is None:
                    raise AdoptError("this gpupoold keeps no workers directory")
                sock, pid = await self.supervisor.connect_adoption(path)
            except AdoptError:
                gone.append(rec)
                continue
            takeover.append((rec, sock, pid))
        # Workers of the previous daemon that hold no session we take over end now.
        await asyncio.to_thread(self.supervisor.kill_orphans, {pid for _, _, pid in takeover})
        # Every one is asked at once. A lease detached when that daemon stopped holds no GPU: its
        # worker idles, parked, so it answers at once and says so (worker/adopt.c); one that has
        # not answered within ADOPT_PEEK is busy in a call, so on its GPU.
        answers = {rec.id: self._spawn(self._adoption(placed[rec.id], sock, pid),
                                       f"adopt-{rec.id}")
                   for rec, sock, pid in takeover}
        if answers:
            await asyncio.wait(answers.values(), timeout=ADOPT_PEEK)
        detached: list[tuple[LeaseRecord, Worker]] = []
        for rec, _, _ in list(takeover):
            answer = answers[rec.id]
            worker = answer.result() if answer.done() and not answer.cancelled() else None
            if isinstance(worker, Worker) and worker.adopted_detached is not None:
                detached.append((rec, worker))
                takeover = [t for t in takeover if t[0] is not rec]
        # GPU index -> the lease taken over on it and its worker's pid: every GPU of a lease of
        # several (its first GPU's worker holds them all), so that nobody else gets any of them.
        adopting: dict[int, tuple[LeaseRecord, int]] = {}
        adopted: dict[int, list[Slot]] = {}  # lease id -> its GPUs, program order
        # GPU index -> the leases of one GPU taken over on it: several are the shares of a
        # shared GPU (issue 32; each logged by pool/takeover.py's _adopt_shares).
        alone: dict[int, list[tuple[LeaseRecord, int]]] = {}
        for rec, _, pid in takeover:
            slot = self._on_now(answers[rec.id], placed[rec.id])
            on = gpus_of.get(rec.id) or ([slot] if slot is not None else [])
            taken = next((s for s in on if s.gpu.index in adopting), None)
            if taken is not None and rec.id not in gpus_of and taken.gpu.index in alone:
                alone[taken.gpu.index].append((rec, pid))
                continue
            if slot is None or taken is not None:
                why = ("its GPU is not served any more" if taken is None
                       else f"GPU {taken.gpu.index} is already taken over by lease "
                            f"{adopting[taken.gpu.index][0].id}")
                self._spawn(self._refuse_previous(rec, answers[rec.id], why), f"retire-{rec.id}")
                continue
            adopted[rec.id] = on
            for s in on:
                adopting[s.gpu.index] = (rec, pid)
            if rec.id not in gpus_of:
                alone[on[0].gpu.index] = [(rec, pid)]
        orphaned = await self._close_unowned(gone, several, unscrubbed, placed, adopting)
        # A GPU being taken over with records of leases nobody takes over (a share whose worker
        # died meanwhile, one whose scrub the previous daemon did not run) or kept closed to new
        # shares (a share's worker died before it stopped): nothing says their memory was
        # zeroed, so it takes no new share until it is scrubbed whole after those taken over.
        unzeroed: dict[int, list[int] | None] = {}
        reopened = False  # a GPU kept closed to new shares that the start-up scrub opens
        for slot in self.slots:
            st = saved.get(slot.gpu.uuid or str(slot.gpu.index), {})
            reopened = reopened or (bool(st.get("share_closed")) and slot.gpu.index not in adopting)
            if slot.gpu.index in adopting:
                self.pool.restore(slot, bool(st.get("draining")), None)
                self.pool.adopt(slot, adopting[slot.gpu.index][0].id)
                if orphaned.get(slot.gpu.index) or st.get("share_closed"):
                    unzeroed[slot.gpu.index] = orphaned.get(slot.gpu.index, [])
                continue
            self.pool.restore(slot, bool(st.get("draining")), st.get("quarantine") or None)
            if slot.state == QUARANTINED:
                assert slot.quarantine is not None
                log.warning("GPU %d stays quarantined (%s): clear it with `gpupoold gpu clear "
                            "%d` once fixed", slot.gpu.index, slot.quarantine.get("reason"),
                            slot.gpu.index)
                continue
            self._own(slot, self._clean(slot, orphaned.get(slot.gpu.index, [])),
                      f"startup-scrub-{slot.gpu.index}")
        # One task takes each lease over, then watches it: the task that moves all its GPUs on.
        for on in adopted.values():
            rec, pid = adopting[on[0].gpu.index]
            if on[0].gpu.index in alone:  # a lease of one GPU, or the shares of one
                self._own(on[0], self._adopt_on(on[0], alone[on[0].gpu.index], answers,
                                                unzeroed.get(on[0].gpu.index)),
                          f"lease-{rec.id}")
                continue
            orphans = [i for s in on for i in unzeroed.get(s.gpu.index) or []]
            task = self._own(on[0], self._adopt(on[0], rec, answers[rec.id], pid, on[1:],
                                                orphans), f"lease-{rec.id}")
            for s in on[1:]:
                s.task = task
        if adopted:
            log.info("taking over %d lease(s) of the previous gpupoold: %s", len(adopted),
                     ", ".join(f"lease {adopting[on[0].gpu.index][0].id} on GPU "
                               + ", ".join(str(s.gpu.index) for s in on)
                               + f" (worker pid {adopting[on[0].gpu.index][1]})"
                               for on in sorted(adopted.values(), key=lambda o: o[0].gpu.index)))
        for rec, worker in detached:
            self._spawn(self._adopt_detached(rec, worker, placed[rec.id], gpus_of.get(rec.id)),
                        f"lease-{rec.id}")
        self.kept_states.follow(self.pool.events, lambda save: self._spawn(save, "save-state"))
        if reopened:
            self._spawn(self.kept_states.save(), "save-state")
        watchdog = Watchdog(self.slots, self._repair, self._quarantine_stuck, self.pool.changed,
                            lambda: self.counters.inc("watchdog_repairs"))
        self._spawn(watchdog.run(), "watchdog")
        self._spawn(self.detacher.run(), "idle-detach")

    async def close(self, grace: float) -> None:
        """Refuse the waiters and stop. Leases whose workers can outlive the daemon continue
        (their workers wait for the next gpupoold, `worker_orphan_grace`); every other worker
        is stopped and its lease's end recorded."""
        self.stop_queue()
        for slot in self.slots:
            if slot.prestart_task is not None:
                slot.prestart_task.cancel()
        # A worker that has reported its end is about to exit: its end is recorded here, not
        # left to the next daemon.
        # A detached lease continues too (its state waits in its worker's host memory), and so
        # does one whose client called again while it waits for a GPU; one being parked,
        # checkpointed or restored does not (its worker ends: the driver's state of its process
        # is not known). A lease of several GPUs back from a detach continues too: its events
        # name every GPU it came back on (schema v15; pool/takeover.py, _gpus_of).
        kept = [lease for lease in self.pool.active()
                if lease.worker.adoptable and not lease.worker.exited.done()
                and not lease.worker.reported_end and (
                    (lease.state == ATTACHED and lease.cycle is None and lease.slot is not None)
                    or (lease.state in (DETACHED, ATTACHING) and lease.slot is None
                        and not self._seated(lease)))]
        self.kept_gpus = frozenset(index for lease in kept if lease.slot is not None
                                   for index in lease.gpu_indexes())
        for lease in kept:
            lease.worker.detach()
            if lease.timer is not None:
                lease.timer.cancel()
        if kept:
            log.warning("%d lease(s) continue without gpupoold: %s. A gpupoold started within "
                        "%g s (worker_orphan_grace) takes them over; after that they end",
                        len(kept), ", ".join(
                            f"lease {lease.id} " + (f"on GPU {lease.gpu_index()}"
                                                    if lease.slot is not None else
                                                    f"detached from GPU {lease.gpu_index()}")
                            + f" (worker pid {lease.worker.pid})" for lease in kept),
                        self.settings.worker_orphan_grace)
        await self.supervisor.stop_all(grace, keep=frozenset(lease.worker for lease in kept))
        # Watchers of stopped workers record the ends; kept leases stay open in the store for the
        # next daemon; cleaning tasks are abandoned (the next start scrubs).
        kept_names = {f"lease-{lease.id}" for lease in kept}
        pending = [t for t in self._tasks
                   if not t.get_name().startswith("lease-") or t.get_name() in kept_names]
        for t in pending:
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace + 5)

    def _seated(self, lease: Lease) -> bool:
        """Whether a GPU is granted to `lease`, called back (being restored there): whole
        (`reserved`), or a share's place (`share_grants`: a returning share is granted there)."""
        return any((s.reserved is not None and s.reserved.returning == lease.id)
                   or any(w.returning == lease.id for w in s.share_grants)
                   for s in self.slots)

    def stop_queue(self) -> None:
        """The daemon is stopping: no new leases, and every waiter is refused (ShuttingDown:
        the handshake tells its client to come back, GP_ESHUTDOWN)."""
        self._closing = True
        for w in self.queue:
            self.queue.leave(w)
            if not w.future.done():
                w.future.set_exception(ShuttingDown())

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _own(self, slot: Slot, coro: Any, name: str) -> asyncio.Task[Any]:
        """Spawn the task that moves `slot` on (a lease's watcher or a scrub)."""
        slot.task = self._spawn(coro, name)
        return slot.task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("internal task %s failed", task.get_name(), exc_info=task.exception())

    def _scrub_soon(self, slot: Slot, lease_ids: list[int], name: str) -> None:
        """Scrub `slot` in a task of its own (the one that moves it on: the watchdog's view)."""
        self._own(slot, self._clean(slot, lease_ids), name)

    def _grant(self, slot: Slot, w: Waiter, others: list[Slot] | None = None) -> None:
        """Give free `slot` to waiter `w` (who leaves the queue; its token's turn ends), and a
        request of several GPUs the free `others` with it, in the same step."""
        self.queue.granted(w)
        w.granted = [slot, *(others or [])]
        for s in w.granted:
            self.pool.grant(s, w)
        w.future.set_result(slot)

    def _claim(self, slot: Slot, w: Waiter, others: list[Slot] | None = None) -> None:
        """Give `slot`, held for a redirected client (pool/fleet.py), to its waiter `w`, and a
        request of several GPUs the held `others` with it, in the same step."""
        self.queue.granted(w)
        w.granted = [slot, *(others or [])]
        for s in w.granted:
            self.pool.claim(s, w)
        w.future.set_result(slot)

    def _seat_returning(self, w: Waiter, home: Slot | None) -> None:
        """A detached lease's waiter `w` joined the queue (pool/detach.py): straight back onto
        `home`, the GPU it left, when free and nobody who may take it is ahead; in a fleet the
        fleet queue decides (the GPU may be promised to another server's client already)."""
        if (self.fleet is None and home is not None and home.state == FREE and in_service(home)
                and self.queue.first(lambda x: x.accepts(home.gpu) and self.may_take(x)) is w):
            self._grant(home, w)
        else:
            self._dispatch()

    # ------------------------------------------------------------------------- handshake side
    def feasible(self, req: Requirements, redirectable: bool = False) -> str | None:
        """None when some GPU here can serve `req` now or later, or in a fleet, for a client
        that may be sent there (`redirectable`), a GPU in service of another live server (the
        info reply counts it: a hello must not be refused for what it offered); else the
        refusal text."""
        why = self._feasible_here(req)
        if why is None or self.fleet is None:
            return why
        never = self._never(req)
        if never is not None:  # nor on another server of the fleet
            return never
        if redirectable and self.fleet.elsewhere(req):
            return None
        if req.gpus > 1:  # all from one server (pool/fleet.py's `match`), and none has them
            return self.fleet.too_many(req, sum(
                1 for s in self.slots if in_service(s) and req.matches(s.gpu)), redirectable)
        return why

    def _never(self, req: Requirements) -> str | None:
        """The refusal of `req` when it asks for more GPUs than a process or its token may ever
        have (no other server of a fleet would serve it either), else None."""
        if req.gpus > MAX_DEVICES:
            return (f"GPUPOOL_GPUS asked for {req.gpus} GPUs at once; a process can have at most "
                    f"{MAX_DEVICES}: ask for fewer")
        limit = self.settings.max_gpus_per_token
        if 0 < limit < req.gpus:
            return (f"GPUPOOL_GPUS asked for {req.gpus} GPUs at once, and this server lends a "
                    f"token at most {limit} (max_gpus_per_token); ask for at most {limit}, or "
                    "ask the operator")
        return None

    def _feasible_here(self, req: Requirements) -> str | None:
        gpus = [s.gpu for s in self.slots]
        candidates = [s for s in self.slots if req.matches(s.gpu)]
        if not candidates:
            return req.refusal(gpus)
        too_many = req.too_many(gpus) or self.share_refusal(req)
        if too_many is not None:
            return too_many
        never = self._never(req)
        if never is not None:
            return never
        in_service_now = [s for s in candidates if in_service(s)]
        if req.gpus > 1 and 0 < len(in_service_now) < req.gpus:
            out = ", ".join(str(s.gpu.index) for s in candidates if not in_service(s))
            return (f"GPUPOOL_GPUS asked for {req.gpus} GPUs at once, and only "
                    f"{len(in_service_now)} of this server's {len(candidates)} that meet the "
                    f"request are in service (GPU {out} drained or quarantined); try again "
                    "later, ask for fewer, or use another server")
        if not any(in_service(s) for s in candidates):
            why = "; ".join(
                f"GPU {s.gpu.index}: " + ("quarantined (" + str((s.quarantine or {}).get(
                    "reason", "")) + ")" if s.state == QUARANTINED else "drained by the operator")
                for s in candidates)
            return (f"every GPU that meets the request ({req.describe()}) is out of service: "
                    f"{why}. Try again later or use another server")
        return None

    def free_now(self, slot: Slot, req: Requirements, token: str) -> bool:
        """Whether a hello from `token` with `req` would be granted `slot` at once: it is free,
        meets `req`, the token is under `max_gpus_per_token`, and nobody in the queue who may
        take it is ahead (the queue is served in order)."""
        return (not self._closing and slot.state == FREE and in_service(slot)
                and req.matches(slot.gpu) and self.token_may_take(token)
                and self.queue.first(lambda w: w.accepts(slot.gpu)
                                     and self.may_take(w)) is None)

    def counts(self, req: Requirements, token: str) -> tuple[int, int, int, int]:
        """(GPUs, those meeting `req` in service, of those the ones a hello from `token` would get
        at once, clients waiting): the counts of an `info` reply."""
        matching = [s for s in self.slots if req.matches(s.gpu) and in_service(s)]
        free = sum(1 for s in matching if self.free_now(s, req, token))
        here = (len(self.slots), len(matching), free, len(self.queue))
        # In a fleet, the fleet's: every live server's GPUs and the one queue (pool/fleet.py).
        return here if self.fleet is None else self.fleet.counts(req, token, here)

    def enqueue(self, req: Requirements, token: str, client: ClientInfo,
                redirectable: bool = False) -> Waiter:
        """Join the queue; the waiter's future resolves with a Slot when a GPU is granted (at
        once if one is free), or in a fleet with a Redirect to another server's GPU (only a
        `redirectable` waiter). Raises QueueFull or ShuttingDown."""
        if self._closing:
            raise ShuttingDown()
        req = req if self.fleet is not None else req.outside_fleet()
        if not (self._free_for(req, token) or req.spread_group):  # (a part claims held GPUs)
            self._admit(token)
        w = self.queue.join(req, token, client, redirectable=redirectable)
        self._dispatch()
        return w

    def _admit(self, token: str) -> None:
        """Raise QueueFull when a new client of `token` may not wait: the queue is at
        `max_queue`, or the token's own clients already wait `max_queue_per_token` times (so
        that one tenant's idle hellos cannot fill the queue everyone shares). Each refusal is
        counted as `admission_refused` (the metric gpupool_admission_refusals, reason `queue`
        or `queue_per_token`). Returning detached leases join without asking (they had a GPU).
        In a fleet both count the clients waiting on every live server (pool/fleet.py's
        `waiting`): the queue is one, so its limits are the fleet's."""
        fleet = self.fleet
        where = "the queue" if fleet is None else "the fleet's queue (all its servers)"
        limit = self.settings.max_queue
        waiting = len(self.queue) if fleet is None else fleet.waiting()
        if waiting >= limit:
            self.counters.inc("admission_refused", reason="queue")
            raise QueueFull(f"every GPU is busy and {where} is full ({waiting} waiting, "
                            f"max_queue = {limit}); try again later")
        per_token = self.settings.max_queue_per_token
        mine = self.queue.waiting(token) if fleet is None else fleet.waiting(token)
        if per_token > 0 and mine >= per_token:
            self.counters.inc("admission_refused", reason="queue_per_token")
            raise QueueFull(
                f"every GPU this client may take is busy and this token already has {mine} "
                f"clients waiting for one{'' if fleet is None else ' in ' + where} "
                f"(max_queue_per_token = {per_token}); try again when one of them has its GPU "
                f"or has left: each waits at most queue_timeout = "
                f"{self.settings.queue_timeout:g} s (`gpupool status` shows the queue)")

    def _free_for(self, req: Requirements, token: str) -> bool:
        free = sum(1 for s in self.slots if s.state == FREE and req.matches(s.gpu))
        return free >= req.gpus and self.token_may_take(token, need=req.gpus)

    def position(self, w: Waiter) -> tuple[int, int]:
        """(place, clients waiting): in the fleet's queue once the waiter is in it."""
        if self.fleet is not None:
            pos, total = self.fleet.position(w)
            if pos:
                return pos, total
        return self.queue.position(w), len(self.queue)

    def abandon(self, w: Waiter) -> None:
        """The waiter's client left (or timed out): leave the queue, or give back its grant."""
        self.queue.leave(w)
        if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
            first: Slot = w.future.result()
            for slot in w.granted or [first]:
                if slot.reserved is w:
                    self._release_unused(slot)
                elif w in slot.share_grants:
                    self._release_share(slot, w)
        elif not w.future.done():
            w.future.cancel()
        self._dispatch()

    def _under_limit(self, token: str, returning: int | None = None, need: int = 1) -> bool:
        """Whether `token` may take `need` more GPUs here: what it holds (its detached leases
        included, pool/state.py's `held`) and them are within `max_gpus_per_token`. A detached
        lease coming back (`returning`) is not counted against itself: it takes its own place
        back."""
        limit = self.settings.max_gpus_per_token
        return limit <= 0 or self.pool.held(token, but=returning) + need <= limit

    def token_may_take(self, token: str, returning: int | None = None, need: int = 1) -> bool:
        """Whether `token`'s max_gpus_per_token lets it take `need` more GPUs now (one, but a
        request of several): on this server, and in a fleet also as the fleet counts (the other
        servers as of the last sync)."""
        if not self._under_limit(token, returning, need):
            return False
        return self.fleet is None or self.fleet.under_limit(token, returning, need)

    def may_take(self, w: Waiter) -> bool:
        """Whether waiter `w`'s token limit lets it take a GPU now. A waiter it holds back is
        skipped by the grants and makes no idle lease detach (pool/detach.py): a GPU given
        back for it would not be its."""
        return self.token_may_take(w.token, w.returning, w.req.gpus)

    def _dispatch(self) -> None:
        """Grant free GPUs to the first waiters that may take them (in a fleet: ask the fleet
        queue to look, pool/fleet.py)."""
        if self._closing:
            return
        if self.fleet is not None:
            self.fleet.kick()
            return
        while self._grant_next():
            pass
        self.dispatch_shares()  # shared GPUs (pool/share_leases.py)

    def _grant_next(self) -> bool:
        """One grant: to the first waiter in turn that may take GPUs and finds as many free as
        it asks for (the first free ones it accepts, in GPU order). All or nothing, head of
        line: a waiter for several GPUs that finds fewer free takes none, and the free ones it
        would take are held back from the waiters behind it (they stay free), so that the GPUs
        freed one by one gather for it rather than go to later, smaller requests: it waits only
        for the leases before it, never forever. A waiter for one GPU that finds none it
        accepts blocks nobody (as before). False when nobody could be served."""
        sharing = self.share_settings()  # whole GPUs: unshared ones first
        free = sorted((s for s in self.slots if s.state == FREE),
                      key=lambda s: (sharing.shared(s.gpu.index), s.gpu.index))
        for w in self.queue.in_turn():
            if not free:
                return False
            if not self.may_take(w) or self.is_share_waiter(w):
                continue
            takes = [s for s in free if w.accepts(s.gpu) and self.whole_may_take(s, w)]
            if len(takes) >= w.req.gpus:
                self._grant(takes[0], w, takes[1:w.req.gpus])
                return True
            if w.req.gpus > 1 and self._could_serve(w):
                free = [s for s in free if s not in takes]  # held back for it
        return False

    def _could_serve(self, w: Waiter) -> bool:
        """Whether enough GPUs `w` accepts are in service for its request, some of them busy
        now: one that cannot be served until an operator acts (GPUs drained or quarantined after
        it joined) holds nothing back from the waiters behind it."""
        return sum(1 for s in self.slots if in_service(s) and w.accepts(s.gpu)) >= w.req.gpus

    def _release_unused(self, slot: Slot) -> None:
        """A granted GPU nobody used (the client left before its lease started)."""
        self.pool.release(slot)
        if slot.state == FREE:
            self._prestart(slot)
        self._dispatch()

    async def begin(self, w: Waiter, slot: Slot, hello_body: bytes, hello_req: int,
                    client_fd: int,
                    before_handover: Callable[[], Awaitable[None]] | None = None) -> Lease:
        """Start the lease of a granted waiter: hand the client to the slot's worker
        (`before_handover` is awaited just before: after it the socket is the worker's). A lease
        of several GPUs (`w.granted`): the first one's worker serves them all (told their
        ordinals, worker_session.devices); the other GPUs' idle workers end, as they hold a
        context there (pre-started again after the lease's scrub)."""
        if w in slot.share_grants:  # a share of a shared GPU
            return await self.begin_share(w, slot, hello_body, hello_req, client_fd,
                                          before_handover, LeaseStartError, START_TIMEOUT,
                                          keep_gpu=_keeps_gpu(hello_body))
        others = [s for s in w.granted if s is not slot]
        for s in (slot, *others):
            if s.reserved is not w:
                self.pool.reserve(s, w)
        for s in others:
            await self._end_idle(s)
        try:
            worker = await self._take_worker(slot)
        except WorkerStartError as exc:
            for s in (slot, *others):
                self._release_unused(s)
            raise LeaseStartError(f"the server could not start a worker for GPU "
                                  f"{slot.gpu.index}: {exc}") from None
        try:
            lease_id = await self._record_start(w, slot)
            if others:  # the history lists every GPU of the lease
                await self.store.lease_gpus(lease_id, [s.gpu.index for s in (slot, *others)])
        except Exception:
            worker.kill()
            for s in (slot, *others):
                self._release_unused(s)
            raise
        keep = _keeps_gpu(hello_body)
        lease = Lease(id=lease_id, slot=slot, token=w.token, client=w.client, req=w.req,
                      worker=worker, queued_s=w.waited(), keep_gpu=keep)
        self.counters.inc("leases_started")
        self.pool.start(slot, lease, others)
        lease.watcher = self._own(slot, self._watch(lease), f"lease-{lease.id}")
        for s in others:  # the same watcher moves them on (the watchdog's view)
            s.task = lease.watcher
        devices = [device_ordinal(slot.gpu, s.gpu) for s in (slot, *others)] if others else []
        await self._hand_over(lease, client_fd, hello_body, hello_req, before_handover,
                              f"GPU {slot.gpu.index}", LeaseStartError, START_TIMEOUT,
                              devices=devices, memory_quota=w.req.quota(slot.gpu))
        return lease

    async def _record_start(self, w: Waiter, slot: Slot) -> int:
        """The history's record of the lease granted to `w` on `slot` (its first GPU); its id."""
        return await self.store.lease_started(NewLease(
            gpu_index=slot.gpu.index, gpu_uuid=slot.gpu.uuid, gpu_name=slot.gpu.name,
            simulated=slot.gpu.simulated, token_name=w.token, client_host=w.client.host,
            client_user=w.client.user, client_pid=w.client.pid, program=w.client.program,
            peer=w.client.peer, request=w.req.describe(), queued_s=w.waited(),
            started=w.started_wall()), spread=(w.req.spread_group, w.req.part, w.req.parts)
            if w.req.spread_group else None)

    async def _hand_over(self, lease: Lease, client_fd: int, hello_body: bytes, hello_req: int,
                         before_handover: Callable[[], Awaitable[None]] | None, what: str,
                         fail: Callable[[str | None], Exception], start_timeout: float,
                         devices: list[int] | None = None, memory_quota: int = 0) -> None:
        """Hand the client's socket to `lease`'s worker (whole GPUs and shares alike: `what`
        names the GPU or share for the error), wait until the worker took the hello, and arm
        the max_lease_seconds timer. `fail` makes the caller's start error (None: the worker
        told the client why); `lease.end_override` says in the history why it never started."""
        worker = lease.worker
        try:
            if before_handover is not None:
                await before_handover()
            await worker.assign(lease.id, client_fd, hello_body, hello_req, devices=devices or [],
                                memory_quota=memory_quota)
        except WorkerStartError as exc:
            lease.end_override = ("worker crashed", f"before the lease started: {exc}")
            worker.kill()
            raise fail(f"the worker for {what} failed: {exc}") from None
        if not await worker.wait_started(start_timeout):
            lease.end_override = lease.end_override or ("not started", "the worker refused "
                                                        "the hello or exited before answering")
            raise fail(None)
        if self.settings.max_lease_seconds > 0:
            lease.timer = asyncio.get_running_loop().call_later(
                self.settings.max_lease_seconds, self._expire, lease)

    async def _take_worker(self, slot: Slot) -> Worker:
        if slot.prestart_task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(slot.prestart_task)
        worker, slot.idle_worker = slot.idle_worker, None
        if worker is not None and not worker.exited.done():
            return worker
        worker = await self.supervisor.spawn(slot.gpu)
        return worker

    def _expire(self, lease: Lease) -> None:
        if self.pool.lease(lease.id) is None:
            return
        limit = self.settings.max_lease_seconds
        lease.end_override = ("max duration", f"the lease reached max_lease_seconds = {limit:g}")
        self._spawn(self._end_worker(lease, f"this GPU lease reached its maximum duration of "
                                            f"{limit:g} s (the server's max_lease_seconds); "
                                            "run the program again to get a new lease"),
                    f"expire-{lease.id}")

    async def _end_worker(self, lease: Lease, text: str) -> None:
        await lease.worker.end(text, gp.GP_EREFUSED)
        try:
            await asyncio.wait_for(asyncio.shield(lease.worker.exited), END_GRACE)
        except TimeoutError:
            log.warning("lease %d: worker pid %d did not end within %g s: SIGKILL", lease.id,
                        lease.worker.pid, END_GRACE)
            lease.worker.kill()

    async def _watch(self, lease: Lease) -> None:
        """Wait for the lease's worker to exit, record the end, then clean the GPU. Whatever fails
        in the bookkeeping, the GPU leaves the lease and is scrubbed (or quarantined)."""
        # Shielded: cancelling a watcher (the daemon stops) must not cancel the worker's exit.
        ex = await asyncio.shield(lease.worker.exited)
        if lease.cycle is not None and not lease.cycle.done():
            # A detach cycle sees the exit too and settles where the lease is (on a GPU or not).
            await asyncio.wait([lease.cycle])
        slot = lease.slot
        share = slot is not None and lease in slot.shares
        last_share = False  # a share whose end left its GPU empty: that one scrubs it
        try:
            reason, detail = self._end_reason(lease, ex)
            self.pool.end(lease, reason, ex.stats)
            last_share = share and slot is not None and slot.ended_at is not None
            if lease.timer is not None:
                lease.timer.cancel()
            await self._record_end(lease, reason, detail, ex)
        except Exception:
            log.exception("lease %d: recording its end failed; its GPU %s is scrubbed anyway",
                          lease.id, lease.gpu_index())
        if self._closing:
            return
        if slot is None:
            # Detached: its last GPU was scrubbed when it left. Its place in its token's
            # max_gpus_per_token is free now: a waiter of that token may take a GPU.
            self._dispatch()
            return
        if share:
            await self.share_ended(lease, slot, ex, last_share)
            return
        if not lease.other_slots:
            await self._clean(slot, [lease.id])
            return
        # A lease of several GPUs: its GPUs scrubbed side by side (one the watchdog quarantined
        # meanwhile stays so), each freed or quarantined alone.
        ended = [s for s in lease.slots() if s.state == LEASED and s.lease is None
                 and s.reserved is None]
        for s in ended:
            s.task = asyncio.current_task()
        if ended:
            await self._clean_together(ended, lease.id)
        else:
            self._dispatch()

    def _end_reason(self, lease: Lease, ex: WorkerExit) -> tuple[str, str]:
        """(reason, detail) of a lease's end: ours when we ended it, else its worker's."""
        reason, detail = lease.end_override or (ex.reason, ex.detail)
        if self._closing and lease.end_override is None and reason in ("shutdown",
                                                                       "worker crashed"):
            reason, detail = "daemon stopped", f"gpupoold stopped ({ex.detail or ex.reason})"
        return reason, detail

    async def _record_end(self, lease: Lease, reason: str, detail: str, ex: WorkerExit) -> None:
        gpu = lease.gpu_index()
        s = ex.stats
        level = logging.INFO if reason in ("client exit", "daemon stopped") else logging.WARNING
        log.log(level, "lease %d ended (%s%s): GPU %d, %s, %.1f s, %d B in, %d B out", lease.id,
                reason, f": {detail}" if detail else "", gpu, lease.client.describe(),
                time.time() - lease.started, s.bytes_h2d, s.bytes_d2h,
                extra=journal_fields(lease.id, gpu, lease.client.describe()))
        self.counters.inc("leases_ended", reason=reason)
        await self.store.lease_ended(lease.id, time.time(), reason, detail, s.bytes_h2d,
                                     s.bytes_d2h, dict(s.calls), module_bytes=s.module_bytes)
        if lease.worker.adoptable:  # recorded: the end record it left in case we had not
            await asyncio.to_thread(self.supervisor.forget_lease, lease.id)

    async def _clean(self, slot: Slot, lease_ids: list[int]) -> None:
        """Scrub and check `slot`'s GPU, record the result, and free or quarantine it. Never
        raises: a failure of the cleaner quarantines the GPU; a failure of the records is
        logged."""
        self.pool.scrub(slot)
        try:
            result = await self.cleaner.clean(slot.gpu)
        except Exception as exc:
            log.exception("GPU %d: the scrub failed", slot.gpu.index)
            result = CleanResult(ok=False, problems=[f"internal error while cleaning: {exc}"])
        for lease_id in lease_ids:
            try:
                await self.store.lease_scrubbed(lease_id, result.ok, result.to_json())
            except Exception:
                log.exception("lease %d: recording its scrub failed", lease_id)
        self._after_clean(slot, result)

    async def _clean_together(self, slots: list[Slot], lease_id: int) -> None:
        """Scrub the GPUs of an ended lease of several GPUs side by side: as `_clean` does for
        one, with the lease's record given the result of the first GPU or of one that failed."""
        for slot in slots:
            self.pool.scrub(slot)

        async def scrub(slot: Slot) -> CleanResult:
            try:
                return await self.cleaner.clean(slot.gpu)
            except Exception as exc:
                log.exception("GPU %d: the scrub failed", slot.gpu.index)
                return CleanResult(ok=False, problems=[f"internal error while cleaning: {exc}"])

        results = await asyncio.gather(*(scrub(s) for s in slots))
        kept = next((r for r in results if not r.ok), results[0])
        try:
            await self.store.lease_scrubbed(lease_id, kept.ok, kept.to_json())
        except Exception:
            log.exception("lease %d: recording its scrub failed", lease_id)
        for slot, result in zip(slots, results, strict=True):
            self._after_clean(slot, result)

    def _after_clean(self, slot: Slot, result: CleanResult) -> None:
        # The GPU's new state first: nothing below (logs, metrics) may leave it scrubbing.
        self.pool.scrubbed(slot, result)
        try:
            self.counters.inc("scrubs", result="ok" if result.ok else "failed")
            if result.reset is not None:
                self.counters.inc("resets", result="ok" if result.reset.get("ok") else "failed")
        except Exception:
            log.exception("GPU %d: counting the scrub failed", slot.gpu.index)
        if result.ok:
            log.info("GPU %d clean: %s", slot.gpu.index, result.summary(),
                     extra=journal_fields(gpu=slot.gpu.index))
            if slot.state == FREE:
                self._prestart(slot)
        else:
            log.error("GPU %d QUARANTINED: %s. Investigate, then `gpupoold gpu clear %d`",
                      slot.gpu.index, result.summary(), slot.gpu.index,
                      extra=journal_fields(gpu=slot.gpu.index))
            self._spawn(self.kept_states.save(), "save-state")
        self._dispatch()

    # ------------------------------------------------------------------------------ watchdog
    def stuck_reason(self, slot: Slot) -> str | None:
        """Why `slot` cannot move on by itself (pool/watchdog.py), None when it can."""
        return stuck_reason(slot)

    def _repair(self, slot: Slot, why: str) -> None:
        lease = slot.lease
        if lease is not None and slot.state == LEASED:
            # The watcher records the end (at once if the worker is gone) and scrubs.
            log.error("watchdog: GPU %d: %s; watching lease %d again", slot.gpu.index, why,
                      lease.id, extra=journal_fields(lease.id, slot.gpu.index))
            lease.watcher = self._own(slot, self._watch(lease), f"lease-{lease.id}")
            for s in lease.slots():  # one watcher for every GPU of a lease of several
                s.task = lease.watcher
            return
        log.error("watchdog: GPU %d: %s; scrubbing it", slot.gpu.index, why,
                  extra=journal_fields(gpu=slot.gpu.index))
        lease, w = self.pool.evict(slot)
        if w is not None:
            self.queue.leave(w)
            if not w.future.done():
                w.future.cancel()
        self._own(slot, self._clean(slot, [lease.id] if lease is not None else []),
                  f"repair-scrub-{slot.gpu.index}")

    def _quarantine_stuck(self, slot: Slot, reason: str) -> None:
        log.error("GPU %d QUARANTINED: %s. Investigate (the log above), then `gpupoold gpu clear "
                  "%d`", slot.gpu.index, reason, slot.gpu.index,
                  extra=journal_fields(gpu=slot.gpu.index))
        if slot.task is not None:
            slot.task.cancel()
        lease = self.pool.quarantine(slot, reason)
        if lease is not None:
            lease.worker.kill()
        self._spawn(self.kept_states.save(), "save-state")
        self._dispatch()

    # ------------------------------------------------------------------------- pre-started workers
    def _prestart(self, slot: Slot) -> None:
        if (not self.settings.prestart_workers or self._closing or self.supervisor.worker is None
                or slot.idle_worker is not None or slot.prestart_task is not None):
            return
        slot.prestart_task = self._spawn(self._prestart_run(slot), f"prestart-{slot.gpu.index}")

    async def _prestart_run(self, slot: Slot) -> None:
        try:
            worker = await self.supervisor.spawn(slot.gpu)
        except WorkerStartError as exc:
            log.warning("GPU %d: could not pre-start a worker (%s); retrying in %g s",
                        slot.gpu.index, exc, PRESTART_RETRY)
            asyncio.get_running_loop().call_later(PRESTART_RETRY, self._prestart_again, slot)
            return
        finally:
            slot.prestart_task = None
        slot.idle_worker = worker
        worker.exited.add_done_callback(lambda _f: self._idle_exited(slot, worker))

    def _prestart_again(self, slot: Slot) -> None:
        if slot.state == FREE:
            self._prestart(slot)

    def _idle_exited(self, slot: Slot, worker: Worker) -> None:
        if slot.idle_worker is worker:  # not taken by a lease: it died while waiting
            slot.idle_worker = None
            ex = worker.exited.result()
            if not self._closing:
                log.warning("GPU %d: pre-started worker pid %d exited (%s); starting another "
                            "in %g s", slot.gpu.index, worker.pid, ex.detail or ex.reason,
                            PRESTART_RETRY)
                asyncio.get_running_loop().call_later(PRESTART_RETRY, self._prestart_again,
                                                      slot)

    # ------------------------------------------------------------------------------- lookups
    def slot(self, index: int) -> Slot:
        """GPU `index`'s slot; LeaseError (404) when there is none."""
        if not 0 <= index < len(self.slots):
            raise LeaseError(f"no GPU {index} on this server (it has {len(self.slots)}: "
                             f"0 to {len(self.slots) - 1})", 404)
        return self.slots[index]

    def active(self) -> list[Lease]:
        """The active leases, in the order they started (the adapters' question)."""
        return self.pool.active()

    def lease(self, lease_id: int) -> Lease | None:
        return self.pool.lease(lease_id)

    # ------------------------------------------------------------------------- operator actions
    async def drain(self, index: int, actor: str) -> Slot:
        slot = self.slot(index)
        if not slot.draining:
            was = slot.state
            self.pool.drain(slot)
            if was == FREE:
                self._stop_idle(slot)
            await self.kept_states.save()
            await self.store.audit(actor, "gpu.drain", f"gpu {index}", slot.state)
            log.info("GPU %d drained by %s (%s)", index, actor, slot.state)
            self._dispatch()  # a request of several GPUs may no longer hold free ones back
        return slot

    async def undrain(self, index: int, actor: str) -> Slot:
        slot = self.slot(index)
        if slot.draining:
            was = slot.state
            self.pool.undrain(slot)
            if was == DRAINED:
                self._prestart(slot)
            await self.kept_states.save()
            await self.store.audit(actor, "gpu.undrain", f"gpu {index}", slot.state)
            log.info("GPU %d back in service (undrained by %s)", index, actor)
            self._dispatch()
        return slot

    async def clear(self, index: int, actor: str) -> Slot:
        slot = self.slot(index)
        if slot.state != QUARANTINED:
            raise LeaseError(f"GPU {index} is not quarantined (it is {slot.state})", 409)
        reason = self.pool.clear(slot)
        self._own(slot, self._clean(slot, []), f"clear-scrub-{index}")
        await self.kept_states.save()
        await self.store.audit(actor, "gpu.clear", f"gpu {index}", f"was: {reason}")
        log.info("GPU %d quarantine cleared by %s: scrubbing and checking it again", index, actor)
        return slot

    async def end_lease(self, lease_id: int, actor: str, reason: str) -> Lease:
        lease = self.pool.lease(lease_id)
        if lease is None:
            raise LeaseError(f"lease {lease_id} is not active", 404)
        reason = reason.strip() or "no reason given"
        lease.end_override = ("revoked", f"ended by {actor}: {reason}")
        await self.store.audit(actor, "lease.end", f"lease {lease_id}", reason)
        log.warning("lease %d ended by %s: %s", lease_id, actor, reason)
        self._spawn(self._end_worker(lease, f"the gpupool operator ended this GPU lease "
                                            f"({reason})"), f"end-{lease_id}")
        return lease

    async def _end_idle(self, slot: Slot) -> None:
        """End `slot`'s pre-started worker (once started, if it is starting): a lease of
        several GPUs uses the GPU from its first GPU's worker, and an idle worker holds a
        context there."""
        if slot.prestart_task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(slot.prestart_task)
        self._stop_idle(slot)

    def _stop_idle(self, slot: Slot) -> None:
        worker, slot.idle_worker = slot.idle_worker, None
        if worker is not None:
            worker.kill()


def _keeps_gpu(hello_body: bytes) -> str | None:
    """Why a lease never detaches, from its client's hello (GP_HELLO_KEEP_GPU), or None."""
    try:
        flags = gp.decode_hello(hello_body, allow_trailing=True).flags
    except Exception:
        return None
    if flags & gp.GP_HELLO_KEEP_GPU:
        return KEEPS_GPU_ASKED
    return None
