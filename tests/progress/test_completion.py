"""Completion queue and synchronizer: batching and wake-ups."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dask_lcicomm.progress.completion import CompletionQueue, Synchronizer, make_completion


def test_queue_delivers_a_batch_per_flush():
    batches = []
    cq = CompletionQueue(asyncio.new_event_loop(), batches.append, threadsafe=False)
    for i in range(5):
        cq.push(i)
    assert batches == []
    cq.flush()
    assert batches == [[0, 1, 2, 3, 4]]
    cq.flush()
    assert batches == [[0, 1, 2, 3, 4]]


def test_queue_drains_completions_made_while_draining():
    seen = []

    def handler(batch):
        seen.extend(batch)
        if 0 in batch:
            cq.push("lost")

    cq = CompletionQueue(asyncio.new_event_loop(), handler, threadsafe=False)
    cq.push(0)
    cq.flush()
    assert seen == [0, "lost"]


def test_synchronizer_signals_each_completion():
    batches = []
    sync = Synchronizer(asyncio.new_event_loop(), batches.append, threadsafe=False)
    for i in range(3):
        sync.push(i)
    sync.flush()
    assert batches == [[0], [1], [2]]
    assert sync.wakeups == 3


@pytest.mark.parametrize("kind", ["queue", "sync"])
def test_threadsafe_delivery_from_progress_thread(kind):
    loop = asyncio.new_event_loop()
    seen: list[int] = []
    completion = make_completion(kind, loop, seen.extend, threadsafe=True)
    batches, per_batch = 20, 50

    def progress():
        for b in range(batches):
            for i in range(per_batch):
                completion.push(b * per_batch + i)
            completion.flush()

    async def main():
        thread = threading.Thread(target=progress)
        thread.start()
        thread.join(timeout=30)
        for _ in range(1000):
            if len(seen) == batches * per_batch:
                break
            await asyncio.sleep(0.001)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert seen == list(range(batches * per_batch))
    if kind == "queue":
        assert completion.wakeups <= batches
    else:
        assert completion.wakeups == batches * per_batch
