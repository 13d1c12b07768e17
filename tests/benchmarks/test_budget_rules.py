"""The classification of sampled stacks, on stacks written by hand."""

from __future__ import annotations

from benchmarks.budget import TORN, Frame, classify

ROOT = Frame("<module>", "/site/benchmarks/__main__.py", 1)


def test_a_garbled_path_from_a_torn_read_is_passed_over():
    garbled = Frame("send", "/site/dask_lc\0\x7f", 12)
    assert garbled.source == ""
    assert classify((garbled,)) == TORN


def test_the_leaf_frame_nearest_the_sample_decides():
    loop = Frame("BaseEventLoop._run_once", "/py/lib/asyncio/base_events.py", 1900)
    codec = Frame("ParcelReader.feed", "/site/dask_lcicomm/parcel/reader.py", 40)
    assert classify((ROOT, loop, codec)) == "codec"
    assert classify((ROOT, loop)) == "event loop"
    assert classify((ROOT,)) == "other"
