"""The sender's pool allocator: alignment, exhaustion, blocks coming back."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dask_lcicomm.providers.shm_budget import SharedMemoryBudget
from dask_lcicomm.providers.shm_pool import ALIGN, PoolAllocator


class Receiver:
    """Stands in for the receiver's flag words."""

    def __init__(self):
        self.flags: dict[int, int] = {}

    def returned(self, block):
        return self.flags.get(block) == 1

    def claim(self, block):
        assert self.flags.get(block, 0) in (0, 1), "claimed a block twice"
        self.flags[block] = 0

    def free(self, block):
        self.flags[block] = 1


def pool(nbytes, blocks=16):
    receiver = Receiver()
    return PoolAllocator(nbytes, blocks, receiver.returned, receiver.claim), receiver


def test_blocks_are_page_aligned_and_disjoint():
    allocator, _ = pool(64 * ALIGN)
    spots = [allocator.allocate(n) for n in (1, ALIGN, ALIGN + 1, 3 * ALIGN)]
    offsets = [offset for _, offset in spots]
    assert offsets == [0, ALIGN, 2 * ALIGN, 4 * ALIGN]
    assert len({block for block, _ in spots}) == 4
    assert allocator.in_use == 4


def test_exhausted_pool_says_so_until_a_block_comes_back():
    allocator, receiver = pool(4 * ALIGN)
    first = allocator.allocate(2 * ALIGN)
    second = allocator.allocate(2 * ALIGN)
    assert allocator.allocate(1) is None
    receiver.free(first[0])
    again = allocator.allocate(2 * ALIGN)
    assert again is not None and again[1] == first[1]
    receiver.free(second[0])
    receiver.free(again[0])
    whole = allocator.allocate(4 * ALIGN)
    assert whole is not None and whole[1] == 0
    assert allocator.in_use == 1


def test_freed_neighbours_coalesce():
    allocator, receiver = pool(8 * ALIGN)
    spots = [allocator.allocate(ALIGN) for _ in range(8)]
    for block, _ in spots[::2] + spots[1::2]:
        receiver.free(block)
    spot = allocator.allocate(8 * ALIGN)
    assert spot is not None and spot[1] == 0


def test_too_large_and_empty_requests_are_refused():
    allocator, _ = pool(4 * ALIGN)
    assert allocator.allocate(4 * ALIGN + 1) is None
    assert allocator.allocate(0) is None
    assert pool(0)[0].allocate(1) is None


def test_running_out_of_block_handles_refuses_too():
    allocator, receiver = pool(64 * ALIGN, blocks=2)
    a = allocator.allocate(1)
    assert allocator.allocate(1) is not None
    assert allocator.allocate(1) is None
    receiver.free(a[0])
    assert allocator.allocate(1) is not None


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_traffic_never_hands_out_overlapping_memory(seed):
    """Nor names memory in use as free to give back."""
    rng = random.Random(seed)
    allocator, receiver = pool(256 * ALIGN, blocks=32)
    live: dict[int, tuple[int, int]] = {}
    for _ in range(300):
        if rng.random() < 0.1:
            named = allocator.idle_free()
            assert named == sorted(named)
            for offset, nbytes in named:
                for start, size in live.values():
                    assert offset + nbytes <= start or start + size <= offset
        if live and rng.random() < 0.45:
            block = rng.choice(list(live))
            receiver.free(block)
            del live[block]
            continue
        n = rng.randint(1, 40 * ALIGN)
        spot = allocator.allocate(n)
        if spot is None:
            continue
        block, offset = spot
        assert block not in live
        assert offset % ALIGN == 0 and offset + n <= allocator.nbytes
        for other, (start, size) in live.items():
            assert offset + n <= start or start + size <= offset, (spot, other)
        live[block] = (offset, n)
    for block in live:
        receiver.free(block)
    assert allocator.allocate(256 * ALIGN) is not None


def test_every_page_of_the_pool_can_be_handed_out():
    allocator, _ = pool(8 * ALIGN, blocks=16)
    offsets = []
    while (spot := allocator.allocate(1)) is not None:
        offsets.append(spot[1])
    assert offsets == [i * ALIGN for i in range(8)]


def test_returned_memory_is_reused_before_untouched_memory():
    """Pages already touched are mapped on both sides; fresh ones cost faults."""
    allocator, receiver = pool(64 * ALIGN)
    for _ in range(10):
        block, offset = allocator.allocate(4 * ALIGN)
        assert offset == 0
        receiver.free(block)


def test_idle_free_names_what_stayed_free_for_a_period():
    allocator, receiver = pool(64 * ALIGN)
    first, second = allocator.allocate(4 * ALIGN), allocator.allocate(2 * ALIGN)
    assert allocator.idle_free() == []  # both still in use
    receiver.free(first[0])
    assert allocator.idle_free() == []  # free just now: may be reused at once
    assert not allocator.settled
    assert allocator.idle_free() == [(0, 4 * ALIGN)]
    assert allocator.idle_free() == []  # named once
    receiver.free(second[0])
    allocator.idle_free()
    # only what was written, not the untouched rest of the pool
    assert allocator.idle_free() == [(4 * ALIGN, 2 * ALIGN)]
    assert allocator.settled


def test_idle_free_keeps_what_is_reused():
    allocator, receiver = pool(64 * ALIGN)
    block, _ = allocator.allocate(4 * ALIGN)
    receiver.free(block)
    allocator.idle_free()
    again = allocator.allocate(2 * ALIGN)  # reuses the first half
    receiver.free(again[0])
    assert again[1] == 0
    # the half handed out within the period stays, the other half goes
    assert allocator.idle_free() == [(2 * ALIGN, 2 * ALIGN)]
    assert allocator.idle_free() == [(0, 2 * ALIGN)]  # then idle for a whole one


def test_what_the_budget_refuses_is_not_allocated_and_what_comes_back_returns_to_it():
    budget = SharedMemoryBudget(3 * ALIGN)
    receiver = Receiver()
    allocator = PoolAllocator(16 * ALIGN, 16, receiver.returned, receiver.claim, budget)
    first = allocator.allocate(2 * ALIGN)
    assert first is not None and budget.held == 2 * ALIGN
    assert allocator.allocate(2 * ALIGN) is None
    assert allocator.in_use == 1
    second = allocator.allocate(ALIGN)
    assert second is not None and second[1] == 2 * ALIGN
    receiver.free(first[0])
    third = allocator.allocate(2 * ALIGN)
    assert third is not None and third[1] == 0 and budget.held == 3 * ALIGN
    allocator.close()
    assert budget.held == 0


def test_pools_of_one_process_share_the_budget():
    budget = SharedMemoryBudget(4 * ALIGN)
    receivers = [Receiver() for _ in range(3)]
    pools = [PoolAllocator(8 * ALIGN, 8, r.returned, r.claim, budget) for r in receivers]
    assert pools[0].allocate(3 * ALIGN) is not None
    assert pools[1].allocate(2 * ALIGN) is None
    assert pools[2].allocate(ALIGN) is not None
    assert budget.held == 4 * ALIGN
