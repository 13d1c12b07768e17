"""Shared segments: sealed memory files that leave nothing behind."""

from __future__ import annotations

import fcntl
import os

import pytest

from dask_lcicomm.providers.shm_segment import PAGE, Layout, SegmentError, attach, create


def test_layout_places_ring_and_pool_on_pages():
    layout = Layout(ring_bytes=4 * PAGE, pool_bytes=8 * PAGE, blocks=1024)
    assert layout.ring_offset % PAGE == 0 and layout.ring_offset >= layout.flag(1023) + 8
    assert layout.pool_offset == layout.ring_offset + 4 * PAGE
    assert layout.nbytes == layout.pool_offset + 8 * PAGE
    assert Layout.from_description(layout.describe()) == layout


@pytest.mark.parametrize(
    "description",
    [
        None,
        [],
        {"ring": PAGE, "pool": 0},
        {"ring": "4096", "pool": 0, "blocks": 1},
        {"ring": 100, "pool": 0, "blocks": 1},
        {"ring": 0, "pool": 0, "blocks": 1},
        {"ring": 2 << 30, "pool": 0, "blocks": 1},
        {"ring": PAGE, "pool": PAGE + 1, "blocks": 1},
        {"ring": PAGE, "pool": -PAGE, "blocks": 1},
        {"ring": PAGE, "pool": 128 << 30, "blocks": 1},
        {"ring": PAGE, "pool": 0, "blocks": 0},
        {"ring": PAGE, "pool": 0, "blocks": 1 << 20},
        {"ring": PAGE, "pool": 0, "blocks": True},
    ],
)
def test_malformed_descriptions_are_refused(description):
    with pytest.raises(SegmentError):
        Layout.from_description(description)


def test_a_created_segment_is_sealed_and_shared():
    layout = Layout(PAGE, PAGE, 4)
    fd, region = create(layout)
    try:
        other = attach(fd, layout)
        region.write(layout.pool_offset, b"hello")
        seen = bytearray(5)
        other.read_into(layout.pool_offset, seen)
        assert seen == b"hello"
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)
        with pytest.raises(OSError):
            os.ftruncate(fd, layout.nbytes * 2)
        # nothing in the file system names it
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    finally:
        os.close(fd)


def test_attach_refuses_unsealed_memory():
    layout = Layout(PAGE, 0, 1)
    fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, layout.nbytes)
        with pytest.raises(SegmentError, match="not sealed"):
            attach(fd, layout)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        assert attach(fd, layout).nbytes == layout.nbytes
    finally:
        os.close(fd)


def test_attach_refuses_a_size_other_than_announced():
    fd, _ = create(Layout(PAGE, PAGE, 1))
    try:
        with pytest.raises(SegmentError, match=r"has .* bytes, its layout says"):
            attach(fd, Layout(PAGE, 2 * PAGE, 1))
    finally:
        os.close(fd)


def test_attach_refuses_other_files(tmp_path):
    path = tmp_path / "plain"
    path.write_bytes(bytes(Layout(PAGE, 0, 1).nbytes))
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(SegmentError):
            attach(fd, Layout(PAGE, 0, 1))
    finally:
        os.close(fd)
