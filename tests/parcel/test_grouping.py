"""Tests of :mod:`dask_lcicomm.parcel.grouping`: which frames the receiver
keeps in one buffer, against Dask's tcp comm and its own tests, and that the
receiver keeps them so on every path. Helpers: ``_streams``.
"""

from __future__ import annotations

import asyncio
import random
import struct

import numpy as np
import pytest
from _streams import (
    SETTINGS,
    SharedPool,
    arr,
    check_buffers,
    decode_one,
    encode_parcel_with,
    flat,
    shards,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_lcicomm.parcel import (
    ParcelDecoder,
    shares_buffer,
)

# ---------------------------------------------------------------------------
# Receive buffers: the sender's rule
# ---------------------------------------------------------------------------

A, B = arr(16, 1), arr(16, 2)
A1, A2 = shards(16, 10)
X = b"same bytes object"
EMPTY_ARRAY = arr(0)


SHARING_RULES = [
    # (id, frames, shares)
    ("nothing", [], []),
    ("one-frame", [b"a"], [False]),
    ("empty-first", [b"", b"a"], [False, False]),
    ("empty-between", [b"a", b"", b"b"], [False, False, True]),
    ("only-empty", [b"", bytearray(), EMPTY_ARRAY], [False, False, False]),
    ("header-frames", [b"h" * 3000, b"i" * 3000], [False, True]),
    ("memoryview-of-bytes-is-header", [memoryview(b"h" * 30), A], [False, True]),
    ("bytes-subclass-is-header", [type("B", (bytes,), {})(b"h" * 30), A], [False, True]),
    ("header-then-array", [b"h" * 30, b"p" * 200, A], [False, True, True]),
    ("header-2048-then-array", [b"h" * 2048, arr(1)], [False, True]),
    ("header-2049-then-array", [b"h" * 2049, arr(1)], [False, False]),
    ("header-2049-in-pieces", [b"h" * 1000, b"", b"h" * 1049, arr(1)], [False, False, True, False]),
    ("header-5%-then-array", [b"h" * 10_000, arr(200_000)], [False, True]),
    ("header-5%+1-then-array", [b"h" * 10_001, arr(200_000)], [False, False]),
    ("array-first", [A, b"h"], [False, True]),
    ("bytearray-first", [bytearray(b"ba"), b"h"], [False, True]),
    ("numpy-frame", [b"h", np.ones(4, "u1")], [False, True]),
    ("two-arrays", [b"h", A, B], [False, True, False]),
    ("two-arrays-no-header", [A, B], [False, False]),
    ("header-after-array-joins-leading-group", [b"h", A, b"t", B], [False, True, True, False]),
    ("bytes-after-leading-group", [b"h", A, B, b"t"], [False, True, False, False]),
    ("same-bytes-twice-after-leading-group", [A, B, X, X], [False, False, False, True]),
    ("shards-in-leading-group", [b"h", A1, A2, B], [False, True, True, False]),
    ("shards-with-header-between", [b"h", A1, b"t", A2], [False, True, True, True]),
    ("shards-after-leading-group", [b"h", B, A1, A2], [False, True, False, True]),
    ("shards-across-an-empty-frame", [b"h", B, A1, b"", A2], [False, True, False, False, True]),
    ("shards-not-consecutive", [b"h", B, A1, A, A2], [False, True, False, False, False]),
    ("shards-of-a-big-first-object", [b"h" * 3000, A1, A2], [False, False, True]),
    ("empty-array-ends-the-leading-group", [b"h", EMPTY_ARRAY, A], [False, False, False]),
    ("empty-array-in-the-leading-group", [b"h", A1, EMPTY_ARRAY, A2], [False, True, False, True]),
    ("same-array-twice", [b"h", A, A], [False, True, True]),
    ("same-array-twice-after-leading-group", [b"h", B, A, A], [False, True, False, True]),
]


@pytest.mark.parametrize("frames, shares", [pytest.param(*r[1:], id=r[0]) for r in SHARING_RULES])
def test_sharing_rule(frames, shares):
    assert shares_buffer(frames) == shares
    # and the receiver keeps the frames so, eager or bulk, fragmented or placed
    for threshold, pool in ((1 << 20, None), (0, None), (0, SharedPool()), (64, SharedPool())):
        wire = encode_parcel_with(frames, threshold, 7, pool=pool, eager_budget=1 << 20)
        msg = decode_one(ParcelDecoder(placement=None if pool is None else pool.resolve), wire)
        assert [bytes(f) for f in msg.frames] == [flat(f) for f in frames]
        check_buffers(msg.frames, shares_buffer(frames, threshold))


def tcp_leading_bytes(frames) -> int:
    """The bytes Dask's tcp comm reads into its first buffer."""
    from distributed.comm.tcp import _add_frames_header
    from distributed.protocol.utils import pack_frames_prelude

    out, _, _ = _add_frames_header(list(frames))
    return struct.unpack_from("Q", out[0])[0] - len(pack_frames_prelude(frames))


@settings(SETTINGS, max_examples=200)
@given(data=st.data(), empties=st.booleans())
def test_sharing_rule_is_tcp_leading_group(data, empties):
    """Our first group is what tcp reads into its first buffer, exactly when no
    empty frame lies in it; an empty frame of another object ends tcp's group,
    while we keep later shards of the object before it in its buffer."""
    content = random.Random(0)
    frames = []
    for _ in range(data.draw(st.integers(0, 6))):
        kind = data.draw(st.sampled_from(["header", "object", "shards", "repeat"] + ["empty"] * empties))
        n = data.draw(st.sampled_from([0, 1, 100, 1000, 2048, 2049, 5000, 60_000]) if kind != "empty"
                      else st.just(0))
        if kind == "header":
            frames.append(content.randbytes(n))
        elif kind == "object":
            frames.append(memoryview(np.frombuffer(bytearray(content.randbytes(n)), "u1")))
        elif kind == "shards" and n > 1:
            frames += shards(n, n // 2)
        elif kind == "repeat" and frames:
            frames.append(frames[-1])
        elif kind == "empty":
            frames.append(arr(0))
    if not empties:
        frames = [f for f in frames if len(flat(f))]
    shares = shares_buffer(frames)
    sizes = [len(flat(f)) for f in frames]
    first_group = 0
    for n, share in zip(sizes, shares, strict=True):
        if n and first_group and not share:
            break
        first_group += n
    if empties:
        assert tcp_leading_bytes(frames) <= first_group
    else:
        assert tcp_leading_bytes(frames) == first_group
    # after the first group, a frame shares exactly when it is a shard of the previous one
    previous = None
    seen = 0
    for frame, n, share in zip(frames, sizes, shares, strict=True):
        if not n:
            assert not share
            continue
        seen += n
        owner = frame.obj if isinstance(frame, memoryview) else frame
        if seen > first_group:
            assert share == (owner is previous)
        previous = owner


# ---------------------------------------------------------------------------
# Receive buffers: Dask's own cases
# ---------------------------------------------------------------------------

def to_frames(msg, **kwargs) -> list:
    from distributed.comm.utils import to_frames

    return asyncio.run(to_frames(msg, allow_offload=False, **kwargs))


def from_frames(frames):
    from distributed.comm.utils import from_frames

    return asyncio.run(from_frames(frames, allow_offload=False))


#: How a message may travel: (eager threshold, place bulk groups)
PATHS = [
    pytest.param(1 << 20, False, id="eager"),
    pytest.param(0, False, id="fragments"),
    pytest.param(0, True, id="placed"),
    pytest.param(4096, False, id="mixed"),
    pytest.param(4096, True, id="mixed-placed"),
]


def send_and_receive(frames, threshold: int, placed: bool) -> list[memoryview]:
    pool = SharedPool() if placed else None
    wire = encode_parcel_with(frames, threshold, 64 * 1024, pool=pool)
    dec = ParcelDecoder(buffer_size=4096, placement=None if pool is None else pool.resolve)
    msg = decode_one(dec, wire)
    check_buffers(msg.frames, shares_buffer(frames, threshold))
    return msg.frames


class OpaqueList(list):
    """Pickled as a whole: its arrays travel as out-of-band pickle buffers."""


@pytest.mark.parametrize("threshold, placed", PATHS)
@pytest.mark.parametrize("list_cls", [list, OpaqueList])
@pytest.mark.parametrize("size", [2, 100_000])
def test_do_not_share_buffers(size, list_cls, threshold, placed):
    """distributed's test_do_not_share_buffers: two arrays of one message do
    not share a buffer after receipt, so that releasing one frees its memory."""
    from distributed.protocol import to_serialize
    from distributed.protocol.utils_test import get_host_array

    frames = to_frames({"data": to_serialize(list_cls([np.full(size, 1), np.full(size, 2)]))})
    a, b = from_frames(send_and_receive(frames, threshold, placed))["data"]
    assert (a == 1).all() and (b == 2).all()
    assert get_host_array(a) is not get_host_array(b)


@pytest.mark.parametrize("threshold, placed", PATHS)
@pytest.mark.parametrize(
    "nbytes_np, nbytes_other, expect_separate_buffer",
    [
        (1, 0, False),  # <2 kiB (including prologue and msgpack header)
        (1, 1800, False),  # <2 kiB
        (1, 2100, True),  # >2 kiB
        (200_000, 9500, False),  # <5% of numpy array
        (200_000, 10500, True),  # >5% of numpy array
        (350_000, 0, False),  # sharded buffer
    ],
)
def test_share_buffer_with_header(nbytes_np, nbytes_other, expect_separate_buffer, threshold, placed):
    """distributed's test_share_buffer_with_header (shards of 250_000 bytes):
    an array shares its buffer with the header frames exactly where tcp lets it."""
    from distributed.protocol import to_serialize
    from distributed.protocol.utils_test import get_host_array

    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, nbytes_np, dtype="u1")
    other = rng.bytes(nbytes_other)
    frames = to_frames({"np": to_serialize(array), "other": other}, frame_split_size=250_000)
    if nbytes_np == 350_000:
        assert [len(flat(f)) for f in frames][-2:] == [250_000, 100_000]
    assert shares_buffer(frames)[-1] == (not expect_separate_buffer)
    msg = from_frames(send_and_receive(frames, threshold, placed))
    a = msg["np"]
    assert np.array_equal(a, array) and msg["other"] == other
    # (had Dask copied the shards to join them, ``a`` would own a buffer of its own)
    # Unlike tcp, an array whose first frame is above the eager threshold never
    # shares the header's buffer: it gets one (or a pool block) of its own size.
    separate = expect_separate_buffer or min(nbytes_np, 250_000) > threshold
    ha = get_host_array(a)
    assert (memoryview(ha).nbytes == a.nbytes) == separate
