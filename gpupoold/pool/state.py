"""The pool's state and its one owner: the state of each GPU (`Slot`), the lease or grant that holds
it, the state of each lease (`Lease`) and which leases are active. Only this module changes them,
through the named transitions of `PoolState`. The policies decide when: pool/leases.py (grants,
lease starts and ends, scrubs, operator actions, the watchdog's repairs), pool/detach.py (idle
detach) and pool/fleet.py (GPUs held for another server's clients). Each transition checks its
edge against the diagrams below, refuses any other with `TransitionError` (a policy's bug, never a
client's or an operator's mistake: nothing is changed then) and publishes what changed
(pool/events.py). tests/test_layout.py fails when another module assigns these fields;
tests/test_pool_state.py walks every edge, and every refused one.

A GPU (`Slot.state`); `draining` is a flag beside it (drain, undrain), a drained GPU is one that
was free or finished its scrub while draining:

    free ──grant (a waiter), hold (another server's client)──► leased ◄─┐ reserve, claim, start,
     ▲ ▲                                                         │  │   │ adopted, attach, detach
     │ └──────────────── release (its grant went unused) ────────┘  └───┘ (in and out of leases)
     │                                                           │
     │                       scrub (its lease ended or left) ────┘
     │                                   ▼
     ├◄───── scrubbed ok ──────── scrubbing ◄──clear── quarantined ◄── scrubbed failed (scrubbing)
     │  (drained instead                ▲                   ▲
     │   while draining)                │                   └── quarantine (the watchdog; from
    drained ◄──drain (free)             │                       leased, scrubbing, free, drained)
     └──undrain──► free                 └── scrub (the watchdog: free or drained, yet held)

    at start-up every GPU is scrubbing (its first scrub), until: adopt ──► leased (a previous
    daemon's lease being taken over, each GPU of a lease of several; adopted once its worker
    answers, all of them in one step; the shares of a shared GPU: adopted_shares once all their
    workers answered, all in one step) or restore ──► quarantined (it was when that daemon
    stopped)

    evict (the watchdog, before it scrubs a stuck GPU: leased, scrubbing, free or drained) takes
    its lease and grant off and leaves its state; end (a lease's worker exited) leaves the GPU
    leased, with no lease, until its scrub

    a shared GPU (issue 32, `share` > 1) takes several leases at once: grant_share (from free,
    or from leased while it holds shares only), start_share and release_share (leased); its
    last share's end (or its last grant released) leaves it leased, with no lease, until its
    scrub, as end does; a share detaches and attaches as a lease does below, leaving its GPU's
    shares (its last one leaving: leased, no lease, until the scrub) and coming back as a share
    granted to it (grant_share of its returning waiter)

    a lease of several GPUs (issue 37) takes every edge above on each of its GPUs: all of them
    granted in one step (grant, once per GPU, never some while it waits for the rest), started
    together (start, all or none), left together at its end (end: each leased, no lease, until
    its own scrub); one quarantined by the watchdog leaves the lease alone, whose worker ends

A lease (`Lease.state`), while its worker lives (end removes it from the active leases, in any
state; the idle detach cycle is pool/detach.py):

    attached ──park (its worker idles, parked)──► detaching ──detach (checkpointed)──► detached
      ▲  ▲                                            │                                  │
      │  └────────── unpark (not now, or failed) ◄────┘                                  │
      └──────── attach (restored on a GPU) ◄── attaching ◄── recall (its client called) ─┘

    at start-up a previous daemon's lease that was detached when it stopped is taken over
    straight into detached (adopted detached), on no GPU, once its worker has answered
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from gpupoold.gpu.cleaner import CleanResult
from gpupoold.gpu.inventory import Gpu
from gpupoold.pool.events import (
    EventBus,
    GpuChanged,
    GpuCleaned,
    LeaseAttached,
    LeaseDetached,
    LeaseEnded,
    LeaseGranted,
)
from gpupoold.pool.slots import (
    ATTACHED,
    ATTACHING,
    DETACHED,
    DETACHING,
    DRAINED,
    FREE,
    LEASED,
    QUARANTINED,
    SCRUBBING,
    Lease,
    Slot,
)
from gpupoold.pool.waitqueue import Waiter
from gpupoold.workers.supervisor import WorkerStats

# The diagrams above as data: transition -> the states it may leave. Where a transition has more
# than one target, the target follows from the slot (its draining flag, the scrub's result).
SLOT_EDGES: dict[str, frozenset[str]] = {
    "adopt": frozenset({SCRUBBING}),
    "restore": frozenset({SCRUBBING}),
    "adopted": frozenset({LEASED}),
    "adopted_shares": frozenset({LEASED}),
    "grant": frozenset({FREE}),
    "hold": frozenset({FREE}),
    "claim": frozenset({LEASED}),
    "reserve": frozenset({LEASED}),
    "release": frozenset({LEASED}),
    "start": frozenset({LEASED}),
    "scrub": frozenset({LEASED, SCRUBBING, FREE, DRAINED}),
    "scrubbed": frozenset({SCRUBBING}),
    "evict": frozenset({LEASED, SCRUBBING, FREE, DRAINED}),
    "quarantine": frozenset({LEASED, SCRUBBING, FREE, DRAINED}),
    "clear": frozenset({QUARANTINED}),
    "drain": frozenset({FREE, LEASED, SCRUBBING, QUARANTINED, DRAINED}),
    "undrain": frozenset({FREE, LEASED, SCRUBBING, QUARANTINED, DRAINED}),
    # a shared GPU (issue 32): a share granted on it (free, or leased to its other shares), a
    # share's lease starting, a share grant nobody used (free again when it was the only one)
    "grant_share": frozenset({FREE, LEASED}),
    "start_share": frozenset({LEASED}),
    "release_share": frozenset({LEASED}),
}
LEASE_EDGES: dict[str, tuple[str, str]] = {  # transition -> (from, to)
    "park": (ATTACHED, DETACHING),
    "unpark": (DETACHING, ATTACHED),
    "detach": (DETACHING, DETACHED),
    "recall": (DETACHED, ATTACHING),
    "attach": (ATTACHING, ATTACHED),
}


class TransitionError(RuntimeError):
    """A policy asked for a transition that is not on the diagram from where the slot or lease
    is (a bug): nothing was changed."""


def in_service(slot: Slot) -> bool:
    """Not drained, draining or quarantined: the GPU may serve another lease."""
    return not (slot.state in (QUARANTINED, DRAINED) or slot.draining)


class PoolState:
    """The GPUs' slots and the active leases of one server; the only writer of their states."""

    def __init__(self, gpus: Iterable[Gpu], events: EventBus) -> None:
        self.events = events
        self.slots = [Slot(gpu) for gpu in gpus]
        self._leases: dict[int, Lease] = {}

    # ------------------------------------------------------------------------------- reading
    def active(self) -> list[Lease]:
        """The active leases, in the order they started."""
        return list(self._leases.values())

    def lease(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def away(self) -> list[Lease]:
        """The active leases off a GPU: detached, or called back and not granted one yet (a
        granted one is counted on the GPU it was granted, as that GPU's holder)."""
        seated = {s.reserved.returning for s in self.slots
                  if s.reserved is not None and s.reserved.returning is not None}
        seated |= {w.returning for s in self.slots for w in s.share_grants  # a share's
                   if w.returning is not None}
        return [le for le in self._leases.values() if le.slot is None and le.id not in seated]

    def held(self, token: str, but: int | None = None) -> int:
        """The GPUs `token` holds, as `max_gpus_per_token` counts them: the GPUs leased or
        granted to it, and its leases off a GPU (a detached lease keeps its claim: it takes a GPU
        again on its client's next call). `but`: leaving out that lease (its own place, for a
        detached lease coming back)."""
        def its_own(slot: Slot) -> bool:
            return but is not None and (
                (slot.lease is not None and slot.lease.id == but)
                or (slot.reserved is not None and slot.reserved.returning == but))

        def shares_of_token(slot: Slot) -> bool:  # but `but`'s own share or share grant
            return any(x.token == token and x.id != but for x in slot.shares) or any(
                w.token == token and (but is None or w.returning != but)
                for w in slot.share_grants)

        on_gpus = sum(1 for s in self.slots if shares_of_token(s) or (
            (s.lease is not None or s.reserved is not None) and s.holder() == token
            and not its_own(s)))
        return on_gpus + sum(max(1, len(le.homes)) for le in self.away()  # all of its GPUs
                             if le.token == token and le.id != but)

    # ---------------------------------------------------------------------------- the checks
    def _check(self, name: str, slot: Slot) -> None:
        if slot.state not in SLOT_EDGES[name]:
            raise TransitionError(f"GPU {slot.gpu.index}: no {name} from {slot.state} (from "
                                  f"{', '.join(sorted(SLOT_EDGES[name]))} only)")

    def _require(self, name: str, slot: Slot, ok: bool, what: str) -> None:
        if not ok:
            raise TransitionError(f"GPU {slot.gpu.index}: no {name}: {what}")

    def _check_lease(self, name: str, lease: Lease) -> None:
        source, _ = LEASE_EDGES[name]
        if lease.state != source:
            raise TransitionError(f"lease {lease.id}: no {name} from {lease.state} (from "
                                  f"{source} only)")

    def _move(self, slot: Slot, state: str) -> None:
        if state != slot.state:
            slot.state = state
            slot.since = time.time()

    def _move_lease(self, lease: Lease, state: str) -> None:
        if state != lease.state:
            lease.state = state
            lease.state_since = time.time()

    def changed(self, slot: Slot | None) -> None:
        """Tell the GPU views' listeners that `slot` changed; every transition does, and so do
        the policies when what they keep beside the state changes (the watchdog's stuck mark,
        why a lease keeps its GPU). A detached lease has no GPU (None): the lease views show it,
        and they are pushed with the first GPU's change."""
        target = slot if slot is not None else (self.slots[0] if self.slots else None)
        if target is not None:
            self.events.publish(GpuChanged(target.gpu.index))

    # ------------------------------------------------------------------------------ start-up
    def restore(self, slot: Slot, draining: bool, quarantine: dict[str, object] | None) -> None:
        """What the store kept of the GPU: drained, quarantined (else it stays scrubbing)."""
        self._check("restore", slot)
        slot.draining = draining
        if quarantine:
            slot.quarantine = quarantine
            self._move(slot, QUARANTINED)
        self.changed(slot)

    def adopt(self, slot: Slot, lease_id: int) -> None:
        """The previous daemon's lease `lease_id` is being taken over on `slot`."""
        self._check("adopt", slot)
        slot.adopting = lease_id
        self._move(slot, LEASED)
        self.changed(slot)

    def adopted(self, slot: Slot, lease: Lease, others: Sequence[Slot] = ()) -> None:
        """The previous daemon's lease is taken over: active again, on `slot` (and, a lease of
        several GPUs, on `others` too, each being taken over for it). All or none, as start."""
        for s in (slot, *others):
            self._check("adopted", s)
            self._require("adopted", s, s.adopting == lease.id and s.lease is None,
                          f"it is not taking over lease {lease.id}")
        for s in (slot, *others):
            s.adopting = None
            s.lease = lease
        lease.slot = slot
        lease.other_slots = list(others)
        self._leases[lease.id] = lease
        for s in (slot, *others):
            self.changed(s)

    def adopted_shares(self, slot: Slot, leases: Sequence[Lease], closed: bool) -> bool:
        """The previous daemon's shares of `slot` are taken over, in one step once every one's
        worker has answered (none lands on the GPU before the others' quotas are known): active
        again as the GPU's shares, their quotas counted by pool/shares.py. `closed`: a share of
        it could not be taken over (its worker was ended or is gone: nothing says its memory was
        zeroed), so no new share lands until the GPU is scrubbed whole, after these end. Returns
        True when none was taken over: the GPU stays leased, with no lease, until the caller's
        whole scrub (as after the last share's `end`)."""
        self._check("adopted_shares", slot)
        self._require("adopted_shares", slot, slot.adopting is not None and slot.lease is None
                      and slot.reserved is None and not slot.shares and not slot.share_grants,
                      "it is not taking over shares")
        for lease in leases:
            if not lease.share or lease.id in self._leases:
                raise TransitionError(f"lease {lease.id}: no adopted_shares: it is not a share, "
                                      f"or active already")
        slot.adopting = None
        slot.shares.extend(leases)
        for lease in leases:
            lease.slot = slot
            self._leases[lease.id] = lease
        slot.share_closed = slot.share_closed or closed
        slot.ended_at = None if leases else time.monotonic()
        self.changed(slot)
        return not leases

    def adopted_detached(self, lease: Lease, home: Gpu, saved_bytes: int,
                         since: float | None = None, homes: Sequence[Gpu] = ()) -> None:
        """The previous daemon's lease is taken over detached (its worker answered so): active
        again on no GPU, its `saved_bytes` of device memory in its worker's host memory since it
        left `home` (at `since`, as recorded; else from now), a lease of several GPUs all of
        `homes` (program order, `home` first); its client's next call brings it back as after
        any detach."""
        if lease.id in self._leases or lease.slot is not None or lease.state != ATTACHED:
            raise TransitionError(f"lease {lease.id}: no adopted_detached: it is active, on a "
                                  f"GPU or not new")
        if homes and homes[0] is not home:
            raise TransitionError(f"lease {lease.id}: no adopted_detached: its first GPU is "
                                  f"not the one it left")
        lease.home = home
        lease.homes = list(homes)
        lease.saved_bytes = saved_bytes
        self._move_lease(lease, DETACHED)
        if since is not None and since <= lease.state_since:
            lease.state_since = since
        self._leases[lease.id] = lease
        self.changed(None)

    # ------------------------------------------------------------------------------- grants
    def grant(self, slot: Slot, w: Waiter) -> None:
        """Free `slot` is `w`'s; its lease starts (`start`) or the grant goes unused (`release`)."""
        self._check("grant", slot)
        slot.reserved = w
        slot.reserved_at = time.monotonic()
        self._move(slot, LEASED)
        self.changed(slot)

    def hold(self, slot: Slot, stand_in: Waiter) -> None:
        """Free `slot` waits for another server's client (pool/fleet.py); `stand_in` holds it."""
        self._check("hold", slot)
        slot.reserved = stand_in
        slot.reserved_at = time.monotonic()
        self._move(slot, LEASED)
        self.changed(slot)

    def claim(self, slot: Slot, w: Waiter) -> None:
        """The client a held `slot` waited for arrived: granted to its waiter `w`."""
        self._check("claim", slot)
        self._require("claim", slot, slot.lease is None and slot.reserved is not None,
                      "it is not held")
        slot.reserved = w
        slot.reserved_at = time.monotonic()
        slot.since = time.time()  # a new grant
        self.changed(slot)

    def reserve(self, slot: Slot, w: Waiter) -> None:
        """`w`'s lease is starting on granted `slot`."""
        self._check("reserve", slot)
        self._require("reserve", slot, slot.lease is None, f"lease {getattr(slot.lease, 'id', 0)}"
                      " holds it")
        slot.reserved = w
        self.changed(slot)

    def release(self, slot: Slot) -> None:
        """A grant (or hold) nobody used: the GPU is free again (drained while draining)."""
        self._check("release", slot)
        self._require("release", slot, slot.lease is None, "a lease holds it")
        slot.reserved = None
        self._move(slot, DRAINED if slot.draining else FREE)
        self.changed(slot)

    # ------------------------------------------------------------------------------- leases
    def start(self, slot: Slot, lease: Lease, others: Sequence[Slot] = ()) -> None:
        """The granted waiter's lease begins on `slot` (and, a lease of several GPUs, on
        `others` too, granted to it with `slot`): active from now. All or none: a refused edge
        on any of them changes nothing."""
        for s in (slot, *others):
            self._check("start", s)
            self._require("start", s, s.lease is None, "a lease holds it already")
        for s in (slot, *others):
            s.reserved = None
            s.ended_at = None
            s.lease = lease
        lease.slot = slot
        lease.other_slots = list(others)
        self._leases[lease.id] = lease
        self.events.publish(LeaseGranted(lease.id, slot.gpu.index, lease.token, lease.queued_s))
        for s in (slot, *others):
            self.changed(s)

    def end(self, lease: Lease, reason: str, stats: WorkerStats) -> None:
        """`lease`'s worker exited: no longer active, and its GPU (if it has one) no longer its
        (the GPU stays leased until its scrub). In the same event-loop step as the end is
        published, so a metrics scrape sees the lease live or ended, once."""
        self._leases.pop(lease.id, None)
        slot = lease.slot
        for s in lease.slots():  # every GPU of a lease of several (one quarantined is not its)
            if s.lease is lease:
                s.lease = None
                s.ended_at = time.monotonic()
            if lease in s.shares:  # a share: the GPU ends with its last share
                s.shares.remove(lease)
                if not s.shares and not s.share_grants:
                    s.ended_at = time.monotonic()
        self.events.publish(LeaseEnded(lease.id, lease.gpu_index(), lease.token, reason,
                                       time.time() - lease.started, stats,
                                       tuple(lease.gpu_indexes()) if lease.other_slots else ()))
        for s in lease.other_slots:
            self.changed(s)
        self.changed(slot)

    # ------------------------------------------------------------------------- shared GPUs
    def grant_share(self, slot: Slot, w: Waiter) -> None:
        """`w` gets a share of `slot` (pool/shares.py chose it): leased from now, with its other
        shares."""
        self._check("grant_share", slot)
        self._require("grant_share", slot, slot.lease is None and slot.reserved is None
                      and (slot.state == FREE or bool(slot.shares or slot.share_grants)),
                      "it is leased whole")
        slot.share_grants.append(w)
        slot.ended_at = None
        self._move(slot, LEASED)
        self.changed(slot)

    def start_share(self, slot: Slot, w: Waiter, lease: Lease) -> None:
        """The share granted to `w` begins as `lease`, in a worker of its own."""
        self._check("start_share", slot)
        self._require("start_share", slot, w in slot.share_grants, "no share granted to it")
        slot.share_grants.remove(w)
        slot.shares.append(lease)
        lease.slot = slot
        self._leases[lease.id] = lease
        self.events.publish(LeaseGranted(lease.id, slot.gpu.index, lease.token, lease.queued_s))
        self.changed(slot)

    def release_share(self, slot: Slot, w: Waiter) -> bool:
        """A share grant nobody used: gone. True when nothing is on the GPU any more: it stays
        leased, with no lease, until the caller's whole scrub (as after a lease's `end`)."""
        self._check("release_share", slot)
        self._require("release_share", slot, w in slot.share_grants, "no share granted to it")
        slot.share_grants.remove(w)
        last = not slot.shares and not slot.share_grants
        if last:
            slot.ended_at = time.monotonic()
        self.changed(slot)
        return last

    def close_shares(self, slot: Slot) -> None:
        """A share's worker died: nothing says its memory was zeroed, so no new share lands on
        the GPU until it is scrubbed whole, after its other shares end."""
        slot.share_closed = True
        self.changed(slot)

    def keep_for(self, slot: Slot, ticket: int | None) -> None:
        """Keep shared `slot` for the whole-GPU waiter `ticket` (None: for nobody): no new share
        lands on it meanwhile (pool/shares.py)."""
        if slot.kept_for != ticket:
            slot.kept_for = ticket
            self.changed(slot)

    # ------------------------------------------------------------------------------- scrubs
    def scrub(self, slot: Slot) -> None:
        """`slot`'s GPU is being scrubbed and checked (no lease may hold it any more)."""
        self._check("scrub", slot)
        self._require("scrub", slot, slot.lease is None,
                      f"lease {getattr(slot.lease, 'id', 0)} holds it")
        slot.reserved = None
        slot.adopting = None
        slot.ended_at = None
        self._move(slot, SCRUBBING)
        self.changed(slot)

    def scrubbed(self, slot: Slot, result: CleanResult) -> None:
        """The scrub's result: free (drained while draining), or quarantined when it failed."""
        self._check("scrubbed", slot)
        slot.share_closed = False  # scrubbed whole: whatever a dead share's worker left is gone
        if result.ok:
            self._move(slot, DRAINED if slot.draining else FREE)
        else:
            slot.quarantine = {"reason": result.summary(), "since": time.time(),
                               "problems": result.problems}
            self._move(slot, QUARANTINED)
        slot.last_scrub = {"ok": result.ok, "at": time.time(), "summary": result.summary(),
                           "bytes": result.scrub.get("bytes", 0),
                           "duration_s": round(result.duration_s, 3)}
        self.events.publish(GpuCleaned(slot.gpu.index, result.ok, result.duration_s,
                                       result.reset))
        self.changed(slot)

    # ------------------------------------------------------------------------ the watchdog
    def evict(self, slot: Slot) -> tuple[Lease | None, Waiter | None]:
        """Take the lease and the grant off a stuck `slot` (the watchdog scrubs it next): the
        lease is no longer active. Returns them, for the caller to end."""
        self._check("evict", slot)
        lease, w = slot.lease, slot.reserved
        if lease is not None:
            self._leases.pop(lease.id, None)
        slot.lease = None
        slot.reserved = None
        self.changed(slot)
        return lease, w

    def quarantine(self, slot: Slot, reason: str) -> Lease | None:
        """Out of service until an operator clears it; its lease (returned: the caller ends its
        worker) is no longer active and its grant is void."""
        self._check("quarantine", slot)
        lease = slot.lease
        if lease is not None:
            self._leases.pop(lease.id, None)
        slot.lease = None
        slot.reserved = None
        slot.quarantine = {"reason": reason, "since": time.time(), "problems": [reason]}
        self._move(slot, QUARANTINED)
        self.changed(slot)
        return lease

    # ----------------------------------------------------------------------- the operator
    def clear(self, slot: Slot) -> str:
        """The operator cleared the quarantine: scrubbed and checked again. Returns its reason."""
        self._check("clear", slot)
        reason = str((slot.quarantine or {}).get("reason", ""))
        slot.quarantine = None
        self._move(slot, SCRUBBING)
        self.changed(slot)
        return reason

    def drain(self, slot: Slot) -> None:
        """No new lease on the GPU: drained now when free, else once its lease and scrub end."""
        self._check("drain", slot)
        slot.draining = True
        if slot.state == FREE:
            self._move(slot, DRAINED)
        self.changed(slot)

    def undrain(self, slot: Slot) -> None:
        self._check("undrain", slot)
        slot.draining = False
        if slot.state == DRAINED:
            self._move(slot, FREE)
        self.changed(slot)

    # ---------------------------------------------------------------------------- idle detach
    def park(self, lease: Lease, saved_bytes: int) -> None:
        """Its worker idles and is parked: its `saved_bytes` of device memory are being
        checkpointed."""
        self._check_lease("park", lease)
        self._move_lease(lease, DETACHING)
        lease.saved_bytes = saved_bytes
        self.changed(lease.slot)

    def unpark(self, lease: Lease) -> None:
        """The detach did not happen (not now, or the checkpoint failed): on its GPU as before."""
        self._check_lease("unpark", lease)
        lease.saved_bytes = 0
        self._move_lease(lease, ATTACHED)
        self.changed(lease.slot)

    def detach(self, lease: Lease, seconds: float) -> list[Slot]:
        """Checkpointed in `seconds`: the lease leaves its GPUs (returned, program order; scrubbed
        next), all of them at once for a lease of several, and keeps its memory in host memory."""
        self._check_lease("detach", lease)
        slots = lease.slots()
        if not slots or any((lease not in s.shares if lease.share else s.lease is not lease)
                            or s.state != LEASED for s in slots):
            raise TransitionError(f"lease {lease.id}: no detach: it is not on leased GPUs")
        lease.home = slots[0].gpu
        lease.homes = [s.gpu for s in slots]
        self._move_lease(lease, DETACHED)
        lease.detaches += 1
        lease.not_now = ""
        for s in slots:
            if lease.share:  # its place (count and quota) is free for other shares; the GPU
                s.shares.remove(lease)  # ends with its last share, as at a share's end
                if not s.shares and not s.share_grants:
                    s.ended_at = time.monotonic()
            else:
                s.lease = None
        lease.slot = None
        lease.other_slots = []
        self.events.publish(LeaseDetached(lease.id, slots[0].gpu.index, lease.saved_bytes, seconds))
        for s in slots:
            self.changed(s)
        return slots

    def recall(self, lease: Lease) -> float:
        """Its client called again: it waits for a GPU. Returns how long it was detached."""
        self._check_lease("recall", lease)
        detached_for = time.time() - lease.state_since
        self._move_lease(lease, ATTACHING)
        self.changed(None)
        return detached_for

    def attach(self, lease: Lease, slot: Slot, detached_for: float, latency_s: float,
               others: Sequence[Slot] = ()) -> int:
        """Restored on granted `slot` (and, a lease of several GPUs, `others`, program order),
        `latency_s` after its client called, after `detached_for` seconds detached: on its GPUs
        again. Returns the bytes it had saved."""
        self._check_lease("attach", lease)
        grant = next((w for w in slot.share_grants if w.returning == lease.id), None)
        if lease.share:  # back as a share granted to it (pool/shares.py placed it)
            self._require("attach", slot, slot.state == LEASED and grant is not None
                          and not others, f"it is {slot.state}, no share granted to lease "
                          f"{lease.id}")
        for s in () if lease.share else (slot, *others):
            self._require("attach", s, s.state == LEASED and s.lease is None
                          and s.reserved is not None and s.reserved.returning == lease.id,
                          f"it is {s.state}, not granted to lease {lease.id}")
        moved = lease.home is not None and slot.gpu.uuid != lease.home.uuid
        if lease.share and grant is not None:
            slot.share_grants.remove(grant)
            slot.shares.append(lease)
        for s in () if lease.share else (slot, *others):
            s.reserved = None
            s.lease = lease
            s.task = lease.watcher
        lease.slot = slot
        lease.other_slots = list(others)
        lease.detached_s += detached_for
        saved, lease.saved_bytes = lease.saved_bytes, 0
        self._move_lease(lease, ATTACHED)
        self.events.publish(LeaseAttached(lease.id, slot.gpu.index, moved, latency_s, saved))
        for s in (slot, *others):
            self.changed(s)
        return saved
