"""Tests of :mod:`dask_lcicomm.parcel.writer`: the units of an
:class:`OutgoingParcel`, eager and bulk groups, buffer types, the peer's limits
(:class:`MessageTooLarge`) and placing bulk groups. Helpers: ``_streams``.
"""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
from _streams import (
    SETTINGS,
    arr,
    check_buffers,
    decode_one,
    encode_parcel_with,
    flat,
    hdr,
    message_frames,
    norm,
    shards,
    unit_kinds,
    units_of,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_lcicomm.parcel import (
    BULK,
    FRAGMENT_EXT,
    HEADER,
    MAGIC,
    SHARE,
    VERSION,
    Kind,
    Limits,
    Message,
    MessageTooLarge,
    OutgoingParcel,
    ParcelDecoder,
    ProtocolError,
    encode_connect,
    encode_parcel,
    shares_buffer,
)

# ---------------------------------------------------------------------------
# The encoder
# ---------------------------------------------------------------------------

def test_outgoing_parcel_units():
    # separate objects: one group each
    frames = [bytearray(b"e" * 4), bytearray(b"B" * 25), b"", bytearray(b"C" * 10)]
    p = OutgoingParcel(9, 3, frames, eager_threshold=4, fragment_size=10)
    assert p.vc == 9 and p.seq == 3 and p.nbytes == 39
    assert not p.done
    units = units_of(p)
    assert p.done
    head = b"".join(bytes(b) for b in units[0])
    magic, version, kind, flags, vc, seq, count = HEADER.unpack_from(head)
    assert (magic, version, kind, flags, vc, seq, count) == (MAGIC, VERSION, Kind.PARCEL, 0, 9, 3, 4)
    assert struct.unpack_from("<4Q", head, HEADER.size) == (4, BULK | 25, 0, BULK | 10)
    assert head[HEADER.size + 32 :] == b"e" * 4
    frags = []
    for unit in units[1:]:
        first = bytes(unit[0])
        _, _, kind, _, vc, seq, index = HEADER.unpack_from(first)
        offset, nbytes = FRAGMENT_EXT.unpack_from(first, HEADER.size)
        payload = b"".join(bytes(b) for b in unit[1:])
        assert (kind, vc, seq) == (Kind.FRAGMENT, 9, 3)
        assert len(payload) == nbytes <= 10
        frags.append((index, offset, nbytes))
    assert frags == [(1, 0, 10), (1, 10, 10), (1, 20, 5), (3, 0, 10)]
    assert encode_parcel(9, 3, frames, 4, 10) == b"".join(bytes(b) for u in units for b in u)


def test_outgoing_parcel_units_of_one_group():
    # header-like frames: one group, bulk as a whole because one frame is over the threshold
    frames = [b"e" * 4, b"B" * 25, b"", b"C" * 10]
    p = OutgoingParcel(9, 3, frames, eager_threshold=4, fragment_size=10)
    assert p.bulk_groups == [[b"e" * 4, b"B" * 25, b"C" * 10]]
    assert all(isinstance(view, memoryview) for view in p.bulk_groups[0])
    assert unit_kinds(p) == [
        ("parcel", (BULK | 4, BULK | SHARE | 25, 0, BULK | SHARE | 10)),
        ("fragment", 0, 0, 4),
        ("fragment", 1, 0, 10),
        ("fragment", 1, 10, 10),
        ("fragment", 1, 20, 5),
        ("fragment", 3, 0, 10),
    ]
    # under the threshold: one eager group
    p = OutgoingParcel(9, 3, frames, eager_threshold=25, fragment_size=10)
    assert p.bulk_groups == []
    assert unit_kinds(p) == [("parcel", (4, SHARE | 25, 0, SHARE | 10))]


@pytest.mark.parametrize("nframes", [1, 2, 31, 32, 33, 100])
def test_one_eager_group_of_any_length(nframes):
    """The compiled fast paths (up to 32 frames) and the general ones agree."""
    frames = [bytes([i % 256]) * (i + 1) for i in range(nframes)]
    p = OutgoingParcel(1, 0, frames, eager_threshold=1000, fragment_size=10)
    sizes = (1, *(SHARE | (i + 1) for i in range(1, nframes)))
    assert unit_kinds(p) == [("parcel", sizes)]
    msg = decode_one(ParcelDecoder(), encode_parcel(1, 0, frames, 1000, 10))
    assert [bytes(f) for f in msg.frames] == frames
    check_buffers(msg.frames, [False] + [True] * (nframes - 1))
    # the same with an empty frame first, which takes the general paths
    msg = decode_one(ParcelDecoder(), encode_parcel(1, 0, [b"", *frames], 1000, 10))
    assert [bytes(f) for f in msg.frames] == [b"", *frames]
    check_buffers(msg.frames, [False, False] + [True] * (nframes - 1))
    # separate objects: a group each; and two groups, the second of shards
    sharded = [bytearray(b"first"), *shards(nframes, *range(1, nframes - 1))][:nframes]
    sharded_shares = [False, False, *[True] * (nframes - 2)][:nframes]
    for objects in ([bytearray(f) for f in frames], sharded):
        shares = [False] * nframes if objects is not sharded else sharded_shares
        assert shares_buffer(objects) == shares
        msg = decode_one(ParcelDecoder(), encode_parcel(1, 0, objects, 1000, 10))
        assert [bytes(f) for f in msg.frames] == [flat(f) for f in objects]
        check_buffers(msg.frames, shares)


def test_outgoing_parcel_is_zero_copy():
    big = bytearray(b"z" * 100)
    p = OutgoingParcel(0, 0, [big], eager_threshold=10, fragment_size=60)
    p.next_unit()
    unit = p.next_unit()
    big[:] = b"y" * 100  # the fragment payload is a view of the caller's buffer
    assert bytes(unit[1]) == b"y" * 60
    assert p.bulk_groups[0][0].obj is big


def test_outgoing_parcel_without_frames():
    p = OutgoingParcel(0, 0, [], 10, 10)
    assert not p.done and p.nbytes == 0
    assert p.bulk_groups == []
    (unit,) = units_of(p)
    assert b"".join(bytes(b) for b in unit) == hdr(Kind.PARCEL, 0, 0, 0)


def test_outgoing_parcel_of_empty_frames():
    p = OutgoingParcel(0, 0, [b"", bytearray(), np.empty(0)], 0, 10)
    assert unit_kinds(p) == [("parcel", (0, 0, 0))]
    msg = decode_one(ParcelDecoder(), encode_parcel(0, 0, [b"", b""], 0, 10))
    assert [bytes(f) for f in msg.frames] == [b"", b""]
    check_buffers(msg.frames, [False, False])
    assert msg.frames[0] is not msg.frames[1]


def test_frame_exactly_at_threshold_is_eager_and_one_above_is_bulk():
    p = OutgoingParcel(0, 0, [bytearray(b"a" * 8), bytearray(b"b" * 9)], eager_threshold=8, fragment_size=100)
    head = b"".join(bytes(b) for b in p.next_unit())
    assert struct.unpack_from("<2Q", head, HEADER.size) == (8, BULK | 9)
    # in one group, the frame over the threshold takes the whole group bulk
    p = OutgoingParcel(0, 0, [b"a" * 8, b"b" * 9], eager_threshold=8, fragment_size=100)
    head = b"".join(bytes(b) for b in p.next_unit())
    assert struct.unpack_from("<2Q", head, HEADER.size) == (BULK | 8, BULK | SHARE | 9)
    p = OutgoingParcel(0, 0, [b"a" * 8, b"b" * 8], eager_threshold=8, fragment_size=100)
    head = b"".join(bytes(b) for b in p.next_unit())
    assert struct.unpack_from("<2Q", head, HEADER.size) == (8, SHARE | 8)


def test_eager_budget_is_spent_group_by_group():
    """Groups go eager in order while the inline part (size table and eager
    groups) fits the budget; a group that does not fit goes bulk as a whole,
    and later, smaller groups may still go eager."""
    a, b, c = bytearray(b"a" * 40), bytearray(b"b" * 30), bytearray(b"c" * 10)
    frames = [b"h" * 5, a, b, b"x" * 3, c]  # groups {h, a}, {b}, {x}, {c}
    assert shares_buffer(frames) == [False, True, False, False, False]
    budget = 8 * 5 + 45 + 10  # the table, the first group, and 10 bytes more
    p = OutgoingParcel(0, 0, frames, eager_threshold=100, fragment_size=100, eager_budget=budget)
    assert unit_kinds(p)[0] == ("parcel", (5, SHARE | 40, BULK | 30, 3, BULK | 10))
    assert p.bulk_groups == [[b], [c]]
    limits = Limits(max_eager_bytes=budget)
    msg = decode_one(ParcelDecoder(limits=limits), encode_parcel_with(frames, 100, 100, eager_budget=budget))
    assert [bytes(f) for f in msg.frames] == [flat(f) for f in frames]
    check_buffers(msg.frames, shares_buffer(frames, 100))
    # a first group one byte too large goes bulk, header frames and all
    p = OutgoingParcel(0, 0, frames, eager_threshold=100, fragment_size=100, eager_budget=8 * 5 + 44)
    assert unit_kinds(p)[0] == ("parcel", (BULK | 5, BULK | SHARE | 40, 30, 3, 10))
    # an object over the threshold does not join the header's group: it goes bulk alone
    p = OutgoingParcel(0, 0, frames, eager_threshold=39, fragment_size=100, eager_budget=budget)
    assert unit_kinds(p)[0] == ("parcel", (5, BULK | 40, 30, 3, 10))


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(b"bytes" * 30, id="bytes"),
        pytest.param(bytearray(b"ba" * 40), id="bytearray"),
        pytest.param(memoryview(b"mv" * 40), id="memoryview"),
        pytest.param(memoryview(b"chars" * 10).cast("c"), id="format-c"),
        pytest.param(memoryview(bytearray(b"signed" * 10)).cast("b"), id="format-b"),
        pytest.param(np.arange(50, dtype=np.float64), id="float64"),
        pytest.param(np.arange(60, dtype=np.int32).reshape(6, 10), id="2d-C"),
        pytest.param(np.arange(100, dtype=np.uint8)[::3], id="strided"),
        pytest.param(np.arange(24, dtype=np.int16).reshape(4, 6)[:, 1:4], id="2d-non-contiguous"),
        pytest.param(np.array(123456789, dtype=np.int64), id="0d"),
        pytest.param(np.empty(0, dtype=np.float64), id="empty-1d"),
    ],
)
def test_buffer_types_roundtrip(frame):
    expected = bytes(memoryview(frame))  # logical (C-order) bytes
    for thr in (0, 1 << 20):  # as bulk and as eager
        data = encode_parcel(0, 0, [frame], thr, 16)
        msg = decode_one(ParcelDecoder(), data)
        assert [bytes(f) for f in msg.frames] == [expected]


@pytest.mark.parametrize(
    "frame",
    [
        # BUG: _as_bytes_view casts any "contiguous" view with memoryview.cast,
        # which only accepts C-contiguous views (and no zeros in the shape).
        pytest.param(np.asfortranarray(np.arange(12, dtype=np.uint8).reshape(3, 4)), id="2d-F"),
        pytest.param(np.zeros((4, 6), dtype=np.float32, order="F")[:, :3], id="2d-F-slice"),
        pytest.param(np.empty((0, 3), dtype=np.float64), id="empty-2d"),
    ],
)
def test_buffer_types_roundtrip_fortran_and_empty_nd(frame):
    """Frames in memory order, like distributed's ensure_memoryview (PickleBuffer.raw())."""
    expected = frame.tobytes(order="A")
    for thr in (0, 1 << 20):
        data = encode_parcel(0, 0, [frame], thr, 16)
        msg = decode_one(ParcelDecoder(), data)
        assert [bytes(f) for f in msg.frames] == [expected]


@pytest.mark.parametrize("grouping", ["one-group", "separate"])
def test_default_encoder_output_is_accepted_by_default_decoder(grouping):
    """With the defaults of lci.yaml (eager-threshold 64KiB, max-eager-bytes
    64MiB) a message of 1024 frames of 64KiB is a perfectly ordinary Dask
    message; the size table counts towards the receiver's limit, so the sender
    must send groups bulk once the parcel's eager budget is spent."""
    chunk = memoryview(b"\x5a" * (64 * 1024))
    frames = [chunk] * 1024 if grouping == "one-group" else [bytearray(chunk) for _ in range(1024)]
    p = OutgoingParcel(1, 0, frames, eager_threshold=64 * 1024, fragment_size=1 << 20)
    # one group: it does not fit; separate groups: all but the last one fit
    assert len(p.bulk_groups) == 1
    dec = ParcelDecoder()  # default Limits
    events = dec.feed(encode_connect(1))
    while not p.done:
        for b in p.next_unit():
            events += dec.feed(b)
    assert isinstance(events[-1], Message)
    assert len(events[-1].frames) == 1024
    assert all(f == chunk for f in events[-1].frames)
    check_buffers(events[-1].frames, shares_buffer(frames, 64 * 1024))
    assert dec.idle


# ---------------------------------------------------------------------------
# The peer's limits: refuse on the sending side what the receiver would refuse
# ---------------------------------------------------------------------------

def test_message_too_large_is_a_value_error():
    assert issubclass(MessageTooLarge, ValueError)
    assert not issubclass(MessageTooLarge, ProtocolError)


@pytest.mark.parametrize(
    "frames, kwargs, match",
    [
        pytest.param([b"x"] * 11, {"max_frames": 10}, "11 frames exceeds the peer's limits", id="frames"),
        pytest.param([b""] * 11, {"eager_budget": 80}, "11 frames exceeds the peer's limits",
                     id="size-table"),
        pytest.param([b"e" * 100, bytearray(901)], {"max_message_bytes": 1000},
                     "1001 bytes exceeds the peer's limit of 1000", id="bytes"),
        pytest.param([np.empty(1001, dtype="u1")], {"max_message_bytes": 1000},
                     "1001 bytes exceeds", id="bytes-bulk"),
    ],
)
def test_message_too_large(frames, kwargs, match):
    with pytest.raises(MessageTooLarge, match=match):
        OutgoingParcel(1, 0, frames, 100, 100, **kwargs)


def test_peer_limits_boundaries_are_accepted():
    limits = Limits(max_message_bytes=1000, max_frames=10, max_eager_bytes=200)
    peer = {"eager_budget": limits.max_eager_bytes, "max_frames": limits.max_frames,
            "max_message_bytes": limits.max_message_bytes}
    for frames in ([b"x"] * 10, [b"e" * 100, bytearray(900)], [b""] * 10, [bytearray(b"y" * 120)] * 8):
        data = encode_connect(1) + encode_parcel_with(frames, 1000, 100, **peer)
        (_, msg) = ParcelDecoder(limits=limits).feed(data)
        assert [bytes(f) for f in msg.frames] == [flat(f) for f in frames]
    # the size table alone may fill the eager budget: every frame then goes bulk
    limits = Limits(max_message_bytes=1000, max_frames=25, max_eager_bytes=200)
    frames = [bytearray(b"z")] * 25
    data = encode_connect(1) + encode_parcel_with(frames, 1000, 100, eager_budget=200, max_frames=25)
    (_, msg) = ParcelDecoder(limits=limits).feed(data)
    assert [bytes(f) for f in msg.frames] == [b"z"] * 25


@settings(SETTINGS, max_examples=100)
@given(
    data=st.data(),
    max_message_bytes=st.integers(0, 300),
    max_frames=st.integers(0, 8),
    max_eager_bytes=st.integers(0, 150),
    eager_threshold=st.integers(0, 60),
)
def test_sender_never_sends_what_the_peer_refuses(data, max_message_bytes, max_frames, max_eager_bytes,
                                                  eager_threshold):
    frames = data.draw(message_frames(random.Random(0), max_objects=6, max_size=80))
    limits = Limits(
        max_message_bytes=max_message_bytes, max_frames=max_frames, max_eager_bytes=max_eager_bytes
    )
    try:
        wire = encode_parcel_with(
            frames, eager_threshold, 16, eager_budget=max_eager_bytes, max_frames=max_frames,
            max_message_bytes=max_message_bytes,
        )
    except MessageTooLarge:
        assert (
            len(frames) > max_frames
            or 8 * len(frames) > max_eager_bytes
            or sum(len(flat(f)) for f in frames) > max_message_bytes
        )
        return
    events = ParcelDecoder(limits=limits).feed(encode_connect(1) + wire)
    assert norm(events) == [("connect", 1), ("msg", 1, 0, [flat(f) for f in frames])]
    check_buffers(events[1].frames, shares_buffer(frames, eager_threshold))


# ---------------------------------------------------------------------------
# Placed groups: the sender's side
# ---------------------------------------------------------------------------

def test_place_api():
    frames = [bytearray(b"a" * 20), bytearray(b"b" * 20), bytearray(b"c" * 20)]
    p = OutgoingParcel(1, 0, frames, eager_threshold=8, fragment_size=4)
    with pytest.raises(ValueError, match="no bulk group 3"):
        p.place(3, 0, 0)
    with pytest.raises(ValueError, match="no bulk group -1"):
        p.place(-1, 0, 0)
    p.place(1, 5, 6)  # a later group, before anything was sent
    with pytest.raises(ValueError, match="only a bulk group whose units are all unsent"):
        p.place(1, 5, 6)  # twice
    p.next_unit()  # the head: every group is still unsent
    p.next_unit()  # a fragment of group 0
    with pytest.raises(ValueError, match="only a bulk group whose units are all unsent can be placed, not 0"):
        p.place(0, 0, 0)
    p.place(2, 7, 8)  # later groups still may be placed
    kinds = [kind for kind, *_ in unit_kinds(p)]
    assert kinds == ["fragment"] * 4 + ["placed", "placed"]
    with pytest.raises(ValueError, match="not 2"):
        p.place(2, 7, 8)
    # a parcel without bulk groups has nothing to place
    with pytest.raises(ValueError, match="no bulk group 0"):
        OutgoingParcel(1, 0, [b"small"], eager_threshold=8, fragment_size=4).place(0, 0, 0)


def test_placed_record_names_the_group():
    frames = [b"h", arr(30), bytearray(10), *shards(40, 15)]
    assert shares_buffer(frames) == [False, True, False, False, True]
    p = OutgoingParcel(3, 9, frames, eager_threshold=0, fragment_size=4)
    # above the threshold, the array does not share the header's buffer
    assert len(p.bulk_groups) == 4
    for group in range(4):
        p.place(group, 10 + group, 8 * group)
    assert unit_kinds(p) == [
        ("parcel", (BULK | 1, BULK | 30, BULK | 10, BULK | 15, BULK | SHARE | 25)),
        ("placed", 0, 10, 0, 1),
        ("placed", 1, 11, 8, 30),
        ("placed", 2, 12, 16, 10),
        ("placed", 3, 13, 24, 40),
    ]
