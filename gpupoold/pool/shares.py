"""Where the requests of the queue go when GPUs are shared (issue 32, `share = N`): the placement
policy, apart from the pool's state so that it can be tested alone (tests/test_shares.py).

A request with an amount of memory (hello.memory, `GPUPOOL_MEMORY`) is a share; one without is a
whole-GPU request. The policy, first come first served per size class (docs/configuration.md,
"Shared GPUs"):

- Shares, in their order of arrival: each goes to the first shared GPU, in index order, that
  has fewer than N shares, room for it (its shares' quotas and this one at most the GPU's
  memory), no claim of a whole-GPU request and no drain. The first share that fits nowhere now
  stops the round for the shares behind it: smaller shares that would keep filling the room a big
  one waits for cannot starve it. A share larger than every shared GPU it accepts never fits and
  is refused (`never_fits`). A detached share coming back (idle detach, pool/detach.py) is a
  share like the others, in its place in the queue, that tries the GPU it left first (`home`):
  restored there its memory does not move.
- A returning share is not held behind the head of the shares where none of the shares ahead of
  it that wait would fit: it goes to a shared GPU that has room for it and on which no waiting
  share ahead of it (the head, or one held behind the head) fits now. It had its place before
  and gave it up only to wait in line again; letting it back into room that nobody ahead can
  use takes nothing from them now. The price, chosen: a big share at the head that waits for
  the shares of that GPU to end may then wait for this one too (as it would have, had it not
  detached). New shares never pass the head (no small-share stream starves a big one), nor does
  a returning share pass a waiting share that would fit where it goes. pool/detach.py detaches
  a share for the queue only when this policy would place a waiter in its place
  (`place_wanted`), so a share does not leave for a waiter that cannot use its place.
- Whole-GPU requests, in their order of arrival: each takes a free GPU, an unshared one first
  (so that shared GPUs stay for shares), then a shared GPU with no share. When none is free, the
  head of this line claims the shared GPU it accepts with the fewest shares (then the lowest
  index): no new share lands there, and when its shares have ended (the GPU scrubbed whole and
  free again) it is this request's. One claim at a time, so a line of whole-GPU requests does not
  close every shared GPU to shares at once.
- Neither line waits behind the other's head.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class ShareSettings:
    """`share` and `share_gpus` (gpupoold/config/settings.py)."""

    share: int = 1
    share_gpus: frozenset[int] = frozenset()  # empty: every GPU (when share > 1)

    @classmethod
    def of(cls, share: int, share_gpus: Iterable[int]) -> ShareSettings:
        return cls(share=share, share_gpus=frozenset(share_gpus))

    def shared(self, index: int) -> bool:
        return self.share > 1 and (not self.share_gpus or index in self.share_gpus)


@dataclass
class GpuRoom:
    """What the policy needs to know of one GPU now."""

    index: int
    memory_total: int  # bytes
    free: bool  # no lease, no share, not scrubbing, drained or quarantined: a whole GPU to lend
    shares: dict[int, int] = field(default_factory=dict)  # request (lease) id -> its quota
    closed: bool = False  # drained by an operator, or a share's worker died: nothing new lands
    claimed_by: int | None = None  # the whole-GPU request it is kept for

    def used(self) -> int:
        return sum(self.shares.values())


@dataclass(frozen=True)
class Request:
    """A waiter: `memory` bytes (0: a whole GPU), `accepts` the GPUs its requirements allow
    (None: any), `home` the GPU a returning share left (tried first)."""

    id: int
    memory: int = 0
    accepts: frozenset[int] | None = None
    home: int | None = None

    def takes(self, index: int) -> bool:
        return self.accepts is None or index in self.accepts


@dataclass(frozen=True)
class Placement:
    request: int
    gpu: int
    share: bool  # True: a share with quota `memory` of the request; False: the whole GPU


@dataclass
class Plan:
    placements: list[Placement] = field(default_factory=list)
    # GPU index -> the whole-GPU request it is kept for (the caller stores it until that request
    # is placed or leaves the queue).
    claims: dict[int, int] = field(default_factory=dict)
    refused: list[int] = field(default_factory=list)  # shares that can never fit (never_fits)


def is_share(req: Request, settings: ShareSettings, gpus: Sequence[GpuRoom]) -> bool:
    """A request with an amount of memory is a share when a GPU it accepts is shared; otherwise
    it takes a whole GPU, its worker capped at the amount (as without `share`)."""
    return req.memory > 0 and any(settings.shared(g.index) and req.takes(g.index) for g in gpus)


def never_fits(req: Request, settings: ShareSettings, gpus: Sequence[GpuRoom]) -> str | None:
    """Why a share can never be placed (larger than every shared GPU it accepts), or None."""
    sizes = [g.memory_total for g in gpus if settings.shared(g.index) and req.takes(g.index)]
    if sizes and all(0 < size < req.memory for size in sizes):
        gib = max(sizes) / 2**30
        return (f"it asks for {req.memory / 2**30:.2f} GiB and the largest shared GPU it may take "
                f"has {gib:.2f} GiB: ask for less (GPUPOOL_MEMORY), or for no amount to get a whole GPU")
    return None


def _room(g: GpuRoom, memory: int, settings: ShareSettings) -> bool:
    if len(g.shares) >= settings.share or g.closed or g.claimed_by is not None:
        return False
    if not g.shares and not g.free:  # leased whole, scrubbing, quarantined
        return False
    return g.memory_total <= 0 or g.used() + memory <= g.memory_total


def _fits(req: Request, g: GpuRoom, settings: ShareSettings) -> bool:
    return settings.shared(g.index) and req.takes(g.index) and _room(g, req.memory, settings)


def plan(queue: Sequence[Request], gpus: Sequence[GpuRoom], settings: ShareSettings) -> Plan:
    """One round of placement over `queue` (in order of arrival). `gpus` is changed as the
    placements and claims are made (a copy is the caller's to make if it wants one)."""
    out = Plan()
    waiting = {r.id for r in queue}
    for g in gpus:  # a claim of a request that left the queue is no claim
        if g.claimed_by is not None and g.claimed_by not in waiting:
            g.claimed_by = None
    shares = [r for r in queue if is_share(r, settings, gpus)]
    wholes = [r for r in queue if not is_share(r, settings, gpus)]

    claimed = {g.claimed_by for g in gpus if g.claimed_by is not None}
    for req in wholes:
        kept = [g for g in gpus if g.claimed_by == req.id]
        ready = [g for g in kept if g.free and not g.shares]
        if not ready:
            order = sorted(gpus, key=lambda g: (settings.shared(g.index), g.index))
            ready = [g for g in order if g.free and not g.shares and not g.closed
                     and g.claimed_by is None and req.takes(g.index)]
        if ready:
            g = ready[0]
            g.free = False
            for k in kept:  # served: its claim (on this GPU or another) ends
                k.claimed_by = None
            claimed.discard(req.id)
            out.placements.append(Placement(req.id, g.index, share=False))
            continue
        if not claimed:  # the first whole-GPU request that waits claims, one claim at a time
            candidates = [g for g in gpus if settings.shared(g.index) and g.shares
                          and not g.closed and g.claimed_by is None and req.takes(g.index)]
            if candidates:
                g = min(candidates, key=lambda g: (len(g.shares), g.index))
                g.claimed_by = req.id
                claimed.add(req.id)
    out.claims = {g.index: g.claimed_by for g in gpus if g.claimed_by is not None}

    waiting: list[Request] = []  # the head of the shares that found no room, those behind it
    for req in shares:
        if never_fits(req, settings, gpus) is not None:
            out.refused.append(req.id)
            continue
        fit = [g for g in gpus if _fits(req, g, settings)]
        if waiting and req.home is not None:  # a returning share passes only who fits nowhere
            fit = [g for g in fit if not any(_fits(w, g, settings) for w in waiting)]
        elif waiting:
            fit = []  # the head of the shares waits, and the new shares behind it with it
        if not fit:
            waiting.append(req)
            continue
        g = next((g for g in fit if g.index == req.home), fit[0])
        g.free = False
        g.shares[req.id] = req.memory
        out.placements.append(Placement(req.id, g.index, share=True))
    return out


def place_wanted(queue: Sequence[Request], gpus: Sequence[GpuRoom], settings: ShareSettings,
                 gpu: int, share: int) -> bool:
    """Whether the place that `share` holds on GPU `gpu` would go to a waiter of `queue` now:
    a round of `plan` on the rooms as they would be without it (copies; a GPU it leaves empty is
    free again, after its whole scrub) places some waiter on that GPU. `gpus` is not changed."""
    rooms = [replace(g, shares=dict(g.shares)) for g in gpus]
    for g in rooms:
        if g.index == gpu and g.shares.pop(share, None) is not None and not g.shares:
            g.free = not g.closed
    return any(p.gpu == gpu for p in plan(queue, rooms, settings).placements)


@dataclass
class ShareEnd:
    """What the end of one share means for its GPU."""

    scrub_whole: bool  # the last share ended: the GPU is scrubbed whole before anything else
    closed: bool  # the GPU takes no new share until then


def end_share(g: GpuRoom, lease: int, worker_died: bool) -> ShareEnd:
    """A share's lease ended. Its worker zeroed its memory before it exited (docs/architecture.md,
    "Memory quotas and zeroing"), so the GPU goes on with its other shares, unless that worker
    died: then nothing says its memory was zeroed, so the GPU takes no new share and is scrubbed
    whole once its other shares have ended."""
    g.shares.pop(lease, None)
    if worker_died:
        g.closed = True
    return ShareEnd(scrub_whole=not g.shares, closed=g.closed)
