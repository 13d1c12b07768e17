"""Memory for frames read from a peer: a region is used again only once the
frame's last view is gone, and given back to the OS once free for two looks."""

from __future__ import annotations

import asyncio
import gc
import threading

import numpy as np
from distributed.utils_test import gen_test

from dask_lcicomm.providers.frame_memory import LEAST_BYTES, SIZE_CLASS, FrameMemory, frame_memory
from dask_lcicomm.providers.shm_release import MemoryReleaser

MiB = 1 << 20


class _Releaser:
    """Records watches; the tests look themselves."""

    def __init__(self) -> None:
        self.watched: list[FrameMemory] = []

    def watch(self, device: FrameMemory) -> None:
        self.watched.append(device)


def _memory() -> tuple[FrameMemory, _Releaser]:
    watcher = _Releaser()
    return FrameMemory(watcher), watcher  # type: ignore[arg-type]


def test_a_frame_is_a_writable_buffer_of_its_size_at_its_address():
    memory, _ = _memory()
    lease, address = memory.take(3 * MiB + 5)
    array = np.frombuffer(lease, np.uint8)
    assert array.nbytes == 3 * MiB + 5 and array.ctypes.data == address
    array[:] = 7
    assert memory.held_bytes == 2 * SIZE_CLASS


def test_a_region_is_used_again_only_once_every_view_of_its_frame_is_gone():
    memory, _ = _memory()
    lease, first = memory.take(MiB)
    # What Dask makes of a frame: a memoryview, an array over it, a slice of that.
    part = np.frombuffer(memoryview(lease), np.uint8)[10:20]
    del lease
    assert memory.take(MiB)[1] != first, "a view of the frame still lives"
    del part
    gc.collect()
    _, again = memory.take(MiB - 100)
    assert again == first


def test_an_array_for_a_large_frame_is_a_region_and_for_a_small_one_new_memory():
    memory, _ = _memory()
    small = memory.array(LEAST_BYTES - 1)
    assert small.nbytes == LEAST_BYTES - 1 and memory.held_bytes == 0
    large = memory.array(LEAST_BYTES)
    assert large.nbytes == LEAST_BYTES and large.flags.writeable
    assert memory.held_bytes == SIZE_CLASS
    address = large.ctypes.data
    del large
    gc.collect()
    assert memory.array(LEAST_BYTES + 1).ctypes.data == address


def test_size_classes_keep_their_regions_apart():
    memory, _ = _memory()
    lease, small = memory.take(MiB)
    del lease
    _, large = memory.take(3 * MiB)
    assert large != small
    assert memory.held_bytes == SIZE_CLASS + 2 * SIZE_CLASS


def test_a_free_region_is_unmapped_at_the_second_look():
    memory, watcher = _memory()
    kept, _ = memory.take(MiB)
    lease, _ = memory.take(MiB)
    assert watcher.watched == [memory], "watched once, at the first frame"
    del lease
    assert not memory.release_idle_memory(), "a frame was taken since the last look"
    assert memory.held_bytes == 2 * SIZE_CLASS, "free at one look only"
    assert not memory.release_idle_memory(), "a frame still lives"
    assert memory.held_bytes == SIZE_CLASS
    del kept
    memory.release_idle_memory()
    assert memory.release_idle_memory() and memory.held_bytes == 0


def test_a_region_taken_between_looks_is_not_unmapped():
    memory, _ = _memory()
    lease, first = memory.take(MiB)
    del lease
    memory.release_idle_memory()
    lease, again = memory.take(MiB)
    memory.release_idle_memory()
    assert again == first and memory.held_bytes == SIZE_CLASS
    frame = np.frombuffer(lease, np.uint8)
    frame[-1] = 9
    assert frame[-1] == 9


def test_live_frames_taken_from_many_threads_never_share_a_region():
    memory, _ = _memory()
    live: list[tuple[object, int]] = []
    lock = threading.Lock()

    def work() -> None:
        for i in range(200):
            lease, address = memory.take(MiB)
            if i % 3 == 0:
                with lock:
                    live.append((lease, address))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    addresses = [address for _, address in live]
    assert len(addresses) == 4 * 67 and len(set(addresses)) == len(addresses)


@gen_test(timeout=30)
async def test_the_loops_releaser_gives_everything_back_and_stops():
    period = 0.05
    memory = frame_memory(period)
    assert frame_memory(period) is memory
    frames = [memory.take(MiB)[0] for _ in range(3)]
    del frames
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    releaser: MemoryReleaser = memory._releaser  # type: ignore[assignment]
    while (memory.held_bytes or releaser._timer is not None) and loop.time() < deadline:
        await asyncio.sleep(period)
    assert memory.held_bytes == 0
    assert releaser._timer is None, "no timer runs once nothing is held"


def test_released_memory_keeps_no_region_and_lent_frames_stay_valid():
    memory, _ = _memory()
    lent = memory.array(3 * MiB)
    free = memory.array(LEAST_BYTES)
    del free
    gc.collect()
    memory.release()
    assert memory.held_bytes == 0
    lent[:] = 5  # its lease holds its region
    assert int(lent.sum()) == 5 * 3 * MiB
