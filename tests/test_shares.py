"""The placement policy of shared GPUs (gpupoold/pool/shares.py, issue 32 item 2): first fit,
first come first served per size class, no starvation of big shares or of whole-GPU requests."""

from __future__ import annotations

from gpupoold.pool.shares import (
    GpuRoom,
    Placement,
    Request,
    ShareSettings,
    end_share,
    never_fits,
    place_wanted,
    plan,
)

GIB = 2**30
FOUR = ShareSettings.of(4, [])


def gpus(n: int, gib: int = 32) -> list[GpuRoom]:
    return [GpuRoom(index=i, memory_total=gib * GIB, free=True) for i in range(n)]


def test_settings_say_which_gpus_are_shared() -> None:
    assert not ShareSettings().shared(0)
    assert FOUR.shared(0) and FOUR.shared(7)
    some = ShareSettings.of(4, [1, 2])
    assert [i for i in range(4) if some.shared(i)] == [1, 2]
    assert not ShareSettings.of(1, [1]).shared(1)


def test_four_shares_fill_one_gpu_and_a_fifth_waits() -> None:
    room = gpus(1)
    queue = [Request(i, 8 * GIB) for i in range(1, 6)]
    out = plan(queue, room, FOUR)
    assert out.placements == [Placement(i, 0, share=True) for i in range(1, 5)]
    assert room[0].used() == 32 * GIB and not room[0].free
    # the fifth gets the place of the first share that ends, its memory zeroed by its worker
    assert end_share(room[0], 2, worker_died=False).scrub_whole is False
    assert plan(queue[4:], room, FOUR).placements == [Placement(5, 0, share=True)]


def test_count_limit_holds_even_with_memory_left() -> None:
    room = gpus(1, gib=80)
    out = plan([Request(i, 1 * GIB) for i in range(6)], room, ShareSettings.of(4, []))
    assert len(out.placements) == 4 and len(room[0].shares) == 4


def test_first_fit_in_index_order() -> None:
    room = gpus(3, gib=16)
    room[0].shares, room[0].free = {90: 12 * GIB}, False
    out = plan([Request(1, 8 * GIB), Request(2, 4 * GIB)], room, FOUR)
    # 8 GiB does not fit in GPU 0's 4 GiB left: GPU 1; 4 GiB fits GPU 0 (first fit)
    assert out.placements == [Placement(1, 1, share=True), Placement(2, 0, share=True)]


def test_a_big_share_is_not_starved_by_smaller_ones_behind_it() -> None:
    room = gpus(1, gib=32)
    room[0].shares, room[0].free = {90: 24 * GIB}, False
    queue = [Request(1, 16 * GIB), Request(2, 4 * GIB)]
    assert plan(queue, room, FOUR).placements == []  # 2 would fit, but waits behind 1
    end_share(room[0], 90, worker_died=False)
    # GPU 0 has no share now; the caller scrubs it whole and marks it free (scrub_whole)
    room[0].free = True
    out = plan(queue, room, FOUR)
    assert out.placements == [Placement(1, 0, share=True), Placement(2, 0, share=True)]


def test_a_share_that_can_never_fit_is_refused_and_holds_nobody() -> None:
    room = gpus(2, gib=16)
    big, small = Request(1, 20 * GIB), Request(2, 4 * GIB)
    reason = never_fits(big, FOUR, room)
    assert reason is not None and "20.00 GiB" in reason and "16.00 GiB" in reason
    out = plan([big, small], room, FOUR)
    assert out.refused == [1] and out.placements == [Placement(2, 0, share=True)]


def test_whole_requests_prefer_unshared_gpus_and_skip_shared_ones_with_shares() -> None:
    settings = ShareSettings.of(4, [0])
    room = gpus(2)
    out = plan([Request(1, 0), Request(2, 8 * GIB)], room, settings)
    assert out.placements == [Placement(1, 1, share=False), Placement(2, 0, share=True)]


def test_memory_without_a_shared_gpu_takes_a_whole_gpu() -> None:
    room = gpus(2)
    out = plan([Request(1, 8 * GIB)], room, ShareSettings())
    assert out.placements == [Placement(1, 0, share=False)]


def test_a_whole_request_claims_a_shared_gpu_and_is_not_starved() -> None:
    room = gpus(1)
    first = plan([Request(i, 8 * GIB) for i in (1, 2)], room, FOUR)
    assert len(first.placements) == 2
    # a whole-GPU request arrives, then a stream of shares: none lands while it waits
    queue = [Request(10, 0), Request(11, 8 * GIB), Request(12, 8 * GIB)]
    out = plan(queue, room, FOUR)
    assert out.placements == [] and out.claims == {0: 10}
    end_share(room[0], 1, worker_died=False)
    assert plan(queue, room, FOUR).placements == []  # still one share on it
    assert end_share(room[0], 2, worker_died=False).scrub_whole
    assert plan(queue, room, FOUR).placements == []  # being scrubbed whole: not free yet
    room[0].free = True  # the scrub went well
    out = plan(queue, room, FOUR)
    assert out.placements == [Placement(10, 0, share=False)] and out.claims == {}
    assert room[0].claimed_by is None


def test_one_claim_at_a_time_leaves_other_shared_gpus_to_shares() -> None:
    room = gpus(2)
    plan([Request(1, 8 * GIB), Request(2, 32 * GIB)], room, FOUR)  # one share on each GPU
    queue = [Request(10, 0), Request(11, 0), Request(12, 8 * GIB)]
    out = plan(queue, room, FOUR)
    # 10 claims GPU 0 (fewest shares, then lowest index: both have one); 11 claims nothing
    assert out.claims == {0: 10}
    assert out.placements == []  # 12 does not fit on GPU 1 (full) and may not use GPU 0


def test_a_claim_of_a_request_that_left_is_dropped() -> None:
    room = gpus(1)
    plan([Request(1, 8 * GIB)], room, FOUR)
    assert plan([Request(10, 0)], room, FOUR).claims == {0: 10}
    out = plan([Request(12, 8 * GIB)], room, FOUR)  # 10 left the queue
    assert out.claims == {} and out.placements == [Placement(12, 0, share=True)]


def test_a_whole_request_served_elsewhere_gives_up_its_claim() -> None:
    settings = ShareSettings.of(4, [0])
    room = gpus(2)
    room[1].free = False  # GPU 1 (unshared) is leased
    plan([Request(1, 8 * GIB)], room, settings)
    assert plan([Request(10, 0)], room, settings).claims == {0: 10}
    room[1].free = True  # GPU 1's lease ended and it was scrubbed
    out = plan([Request(10, 0), Request(12, 8 * GIB)], room, settings)
    assert out.placements == [Placement(10, 1, share=False), Placement(12, 0, share=True)]
    assert out.claims == {}


def test_a_dead_share_worker_drains_the_gpu_until_its_whole_scrub() -> None:
    room = gpus(1)
    plan([Request(i, 8 * GIB) for i in (1, 2)], room, FOUR)
    end = end_share(room[0], 1, worker_died=True)
    assert end.closed and not end.scrub_whole
    assert plan([Request(3, 8 * GIB)], room, FOUR).placements == []  # nothing new lands
    assert end_share(room[0], 2, worker_died=False).scrub_whole


def test_requirements_limit_the_gpus_a_request_takes() -> None:
    room = gpus(2)
    out = plan([Request(1, 8 * GIB, accepts=frozenset({1})), Request(2, 0, accepts=frozenset({0}))],
               room, FOUR)
    assert sorted(out.placements, key=lambda p: p.request) == [
        Placement(1, 1, share=True), Placement(2, 0, share=False)]


def test_a_returning_share_passes_waiting_shares_only_where_none_of_them_fits() -> None:
    """Issue 32, item 5 (review finding): a returning share whose GPU has room for it is not held
    behind a head of the shares that cannot use that room; new shares still are, and a returning
    share never takes room that a waiting share ahead of it would fit."""
    room = gpus(1, gib=16)
    room[0].shares, room[0].free = {90: 10 * GIB}, False  # 6 GiB left
    head, back, new = Request(1, 8 * GIB), Request(2, 4 * GIB, home=0), Request(3, 2 * GIB)
    out = plan([head, back, new], room, FOUR)
    # the 8 GiB head fits nowhere; the returning 4 GiB passes it; the new 2 GiB still waits
    assert out.placements == [Placement(2, 0, share=True)]
    assert room[0].shares == {90: 10 * GIB, 2: 4 * GIB}

    room = gpus(1, gib=16)
    room[0].shares, room[0].free = {90: 12 * GIB}, False  # 4 GiB left
    held = Request(4, 4 * GIB)  # would fit, but waits behind the head: ahead of the returning one
    assert plan([head, held, back], room, FOUR).placements == []
    assert room[0].shares == {90: 12 * GIB}


def test_a_share_place_is_wanted_only_by_a_waiter_that_fits_in_it() -> None:
    room = gpus(1, gib=16)
    room[0].shares, room[0].free = {1: 4 * GIB, 2: 12 * GIB}, False
    two = ShareSettings.of(2, [])
    assert not place_wanted([Request(3, 8 * GIB)], room, two, gpu=0, share=1)  # 12 + 8 > 16
    assert place_wanted([Request(3, 4 * GIB)], room, two, gpu=0, share=1)
    assert room[0].shares == {1: 4 * GIB, 2: 12 * GIB}  # the rooms are not changed
    # nor does a waiter whose requirements exclude this GPU
    assert not place_wanted([Request(3, 4 * GIB, accepts=frozenset({1}))], room, two, gpu=0,
                            share=1)
    # the last share leaving: its GPU is free again after the whole scrub
    alone = gpus(1, gib=16)
    alone[0].shares, alone[0].free = {1: 4 * GIB}, False
    assert place_wanted([Request(3, 14 * GIB)], alone, two, gpu=0, share=1)
