"""The process's shared-memory budget on its own."""

from __future__ import annotations

import threading

from dask_lcicomm.providers.shm_budget import SharedMemoryBudget, budget


class Flag:
    def __init__(self) -> None:
        self.value = False
        self.asked = 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.value


def test_lends_within_the_limit_and_refuses_beyond_it():
    b = SharedMemoryBudget(100)
    assert b.lend("a", 60, Flag())
    assert not b.lend("b", 41, Flag())
    assert b.lend("b", 40, Flag())
    assert b.held == 100
    b.give("a")
    assert b.held == 40
    assert b.lend("c", 60, Flag())


def test_a_block_the_receiver_freed_counts_as_free_before_its_sender_collects_it():
    b = SharedMemoryBudget(100)
    freed, kept = Flag(), Flag()
    b.lend("freed", 50, freed)
    b.lend("kept", 50, kept)
    assert freed.asked == kept.asked == 0, "flags are read only when a lend does not fit"
    freed.value = True
    assert b.lend("new", 50, Flag())
    assert b.held == 100
    # The sender collects it later: counted back once only.
    b.give("freed")
    assert b.held == 100
    assert not b.lend("more", 1, Flag())


def test_rings_are_charged_whole_never_refused_and_leave_less_room_for_lending():
    b = SharedMemoryBudget(100)
    b.charge("ring1", 60)
    b.charge("ring1", 60)  # idempotent per ring
    b.charge("ring2", 60)
    assert b.held == 120
    assert not b.lend("block", 1, Flag())
    b.give("ring2")
    assert b.held == 60
    assert b.lend("block", 40, Flag())
    assert not b.lend("other", 1, Flag())


def test_giving_back_what_was_never_held_changes_nothing():
    b = SharedMemoryBudget(10)
    b.give("nothing")
    assert b.held == 0


def test_concurrent_lends_never_exceed_the_limit():
    b = SharedMemoryBudget(1000)
    granted = []

    def lend(thread: int) -> None:
        for i in range(200):
            if b.lend((thread, i), 7, Flag()):
                granted.append((thread, i))

    threads = [threading.Thread(target=lend, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(granted) == 1000 // 7 and b.held == 7 * len(granted)


def test_one_budget_per_process_and_limit():
    assert budget(1 << 20) is budget(1 << 20)
    assert budget(1 << 20) is not budget(2 << 20)
