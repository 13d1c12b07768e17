"""The C helper: atomic words, bounded copies, and leases that return memory."""

from __future__ import annotations

import gc
import mmap
import os
import time

import numpy as np
import pytest

from dask_lcicomm.providers._atomics import Region, fence, map_shared

PAGE = mmap.PAGESIZE


@pytest.fixture
def region():
    return Region(mmap.mmap(-1, 1 << 16))


def test_words_load_store_exchange(region):
    assert region.load(0) == 0
    region.store(8, 2**64 - 1)
    assert region.load(8) == 2**64 - 1
    assert region.exchange(8, 3) == 2**64 - 1
    assert region.load(8) == 3
    fence()


@pytest.mark.parametrize("offset", [-8, 1 << 16, 1 << 20])
def test_words_outside_the_region_are_refused(region, offset):
    with pytest.raises(IndexError):
        region.load(offset)


def test_unaligned_words_are_refused(region):
    with pytest.raises(ValueError, match="aligned"):
        region.store(12, 1)


def test_copies_are_bounds_checked(region):
    region.write(100, b"abc")
    out = bytearray(3)
    region.read_into(100, out)
    assert out == b"abc"
    big = np.arange(1 << 17, dtype=np.uint8)
    with pytest.raises(IndexError):
        region.write(0, big)
    with pytest.raises(IndexError):
        region.read_into((1 << 16) - 2, out)
    with pytest.raises(TypeError):
        region.read_into(0, b"readonly")


def test_large_copies_run_without_the_gil(region):
    data = np.random.default_rng(0).integers(0, 255, 1 << 16, dtype=np.uint8)
    region.write(0, data)
    back = np.empty_like(data)
    region.read_into(0, back)
    assert np.array_equal(back, data)


def test_a_lease_returns_its_memory_when_the_last_user_is_gone(region):
    lease = region.lease(4096, 1000, 0)
    array = np.frombuffer(memoryview(lease), dtype=np.uint8)
    array[:] = 7
    view = memoryview(lease)[10:20]
    del lease
    gc.collect()
    assert region.load(0) == 0, "objects still use the memory"
    del array
    assert region.load(0) == 0, "a slice still uses the memory"
    del view
    assert region.load(0) == 1
    out = bytearray(1000)
    region.read_into(4096, out)
    assert out == bytes([7]) * 1000


def test_a_lease_is_writable_and_sized(region):
    lease = region.lease(0, 64, 128)
    assert len(lease) == 64
    view = memoryview(lease)
    assert not view.readonly and view.nbytes == 64


@pytest.mark.parametrize("args", [(65000, 1000, 0), (0, 100, 64), (0, 10, 3), (-1, 10, 64)])
def test_bad_leases_are_refused(region, args):
    with pytest.raises((IndexError, ValueError)):
        region.lease(*args)


def test_a_region_outlives_its_leases_holder():
    memory = mmap.mmap(-1, 1 << 14)
    lease = Region(memory).lease(0, 100, 4096)
    view = memoryview(lease)
    del lease
    view[:3] = b"xyz"
    assert memory[:3] == b"xyz"


def _mappings_of(fd: int) -> int:
    """How many of this process's mappings are of the file behind ``fd``."""
    inode = str(os.fstat(fd).st_ino)
    with open("/proc/self/maps") as maps:
        return sum(line.split()[4] == inode for line in maps)


def test_a_shared_mapping_holds_no_descriptor_and_goes_with_its_last_lease():
    fd = os.memfd_create("test-map-shared")
    os.ftruncate(fd, 1 << 14)
    mapped = map_shared(fd, 1 << 14)
    try:
        descriptors = len(os.listdir("/proc/self/fd"))
        region = map_shared(fd, 1 << 14)
        assert len(os.listdir("/proc/self/fd")) == descriptors
        assert _mappings_of(fd) == 2
        region.write(100, b"abc")
        view = memoryview(region.lease(100, 3, 0))
        del region
        gc.collect()
        assert bytes(view) == b"abc"
        assert _mappings_of(fd) == 2
        del view
        gc.collect()
        assert _mappings_of(fd) == 1
        assert mapped.load(0) == 1  # the lease's flag word, seen through the other mapping
    finally:
        os.close(fd)


@pytest.mark.parametrize("nbytes", [0, -1])
def test_map_shared_refuses_empty_sizes(nbytes):
    fd = os.memfd_create("test-map-shared")
    try:
        with pytest.raises(ValueError):
            map_shared(fd, nbytes)
    finally:
        os.close(fd)


def test_map_shared_reports_a_descriptor_it_cannot_map():
    read, write = os.pipe()
    try:
        with pytest.raises(OSError):
            map_shared(read, 4096)
    finally:
        os.close(read)
        os.close(write)


def test_published_bytes_are_seen_whole_by_another_process():
    """A child publishes records with a release store; the parent checks each
    record it acquires is complete (on weakly ordered CPUs a plain store
    could be seen before the data)."""
    memory = mmap.mmap(-1, 1 << 16)
    region = Region(memory)
    rounds, size = 2000, 4096
    pid = os.fork()
    if pid == 0:
        try:
            child = Region(memory)
            for i in range(1, rounds + 1):
                while child.load(8) != i - 1:
                    pass
                child.write(64, bytes([i % 251]) * size)
                child.store(0, i)
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 60
        for i in range(1, rounds + 1):
            while region.load(0) != i:
                assert time.monotonic() < deadline, f"child stalled at record {i}"
            out = bytearray(size)
            region.read_into(64, out)
            assert out == bytes([i % 251]) * size, f"record {i} seen incomplete"
            region.store(8, i)
    finally:
        os.waitpid(pid, 0)


@pytest.fixture
def shared():
    """Four pages of a memory file, mapped as segments are."""
    fd = os.memfd_create("test")
    try:
        os.ftruncate(fd, 4 * PAGE)
        return map_shared(fd, 4 * PAGE)
    finally:
        os.close(fd)


def test_discarded_pages_read_as_zeros_and_take_writes_again(shared):
    shared.write(0, b"\1" * (4 * PAGE))
    shared.discard(PAGE, 2 * PAGE)
    out = bytearray(4 * PAGE)
    shared.read_into(0, out)
    assert out == b"\1" * PAGE + bytes(2 * PAGE) + b"\1" * PAGE
    shared.write(PAGE, b"\2")
    assert shared.load(PAGE) & 0xFF == 2


@pytest.mark.parametrize("offset, nbytes, error", [
    (1, PAGE, ValueError), (0, PAGE + 1, ValueError), (0, 5 * PAGE, IndexError),
])
def test_discards_are_whole_pages_inside_the_region(shared, offset, nbytes, error):
    with pytest.raises(error):
        shared.discard(offset, nbytes)
