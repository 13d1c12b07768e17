"""Tests of :mod:`dask_lcicomm.parcel.reader`: round trips under any chunking,
truncation, corruption and garbage, limits checked before anything is allocated,
decoded frames, placed groups and hostile size tables. Helpers: ``_streams``.
"""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest
from _streams import (
    BUFFER_SIZES,
    FRAG_HEAD,
    P_GROUPS,
    SETTINGS,
    SMALL_LIMITS,
    AllocationSpy,
    SharedPool,
    check_buffers,
    check_frame,
    decode_one,
    decode_untrusted,
    encode_parcel_with,
    feed_buffered,
    feed_chunks,
    fixed_stream,
    flat,
    hdr,
    norm,
    raw_fragment,
    raw_parcel,
    raw_placed,
    spying,
    stream_cases,
    table,
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
    MAX_HELLO_BYTES,
    MAX_VC,
    PLACED_EXT,
    SHARE,
    SIZE_MASK,
    VERSION,
    Close,
    Connect,
    Hello,
    Kind,
    Limits,
    Message,
    OutgoingParcel,
    ParcelDecoder,
    ProtocolError,
    encode_close,
    encode_connect,
    encode_hello,
    encode_parcel,
    shares_buffer,
)

# ---------------------------------------------------------------------------
# The simulated sender itself
# ---------------------------------------------------------------------------

def test_fixed_stream_shape():
    s = fixed_stream()
    kinds = [e[0] for _, e in s.events]
    assert kinds.count("msg") == 6 and kinds.count("connect") == 3 and kinds.count("close") == 3
    assert s.fragments, "the fixed stream should contain fragments"
    # units of different vcs really are interleaved
    vcs_in_order = [vc for _, _, vc, _, _ in s.fragments]
    assert vcs_in_order != sorted(vcs_in_order)
    assert max(s.boundaries) == len(s.data)


# ---------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------

def test_empty_stream():
    dec = ParcelDecoder()
    assert dec.idle
    dec.check_eof()
    assert dec.feed(b"") == []
    assert dec.idle


def test_simple_roundtrip():
    data = (
        encode_hello(b"hello")
        + encode_connect(5)
        + encode_parcel(5, 0, [b"abc", b"", b"x" * 100], eager_threshold=10, fragment_size=33)
        + encode_parcel(5, 1, [], eager_threshold=10, fragment_size=33)
        + encode_close(5)
    )
    dec = ParcelDecoder()
    events = dec.feed(data)
    assert events[:2] == [Hello(b"hello"), Connect(5)]
    assert events[-1] == Close(5)
    assert norm(events[2:4]) == [("msg", 5, 0, [b"abc", b"", b"x" * 100]), ("msg", 5, 1, [])]
    assert dec.idle
    dec.check_eof()


@settings(SETTINGS, max_examples=100)
@given(
    case=stream_cases(),
    chunks=st.lists(st.integers(1, 97), min_size=1, max_size=8),
    buffer_size=st.sampled_from(BUFFER_SIZES),
)
def test_roundtrip_any_chunking(case, chunks, buffer_size):
    s, _, _ = case
    expected = s.expected()
    # whole stream at once
    dec = ParcelDecoder(buffer_size=buffer_size, placement=s.placement)
    events = dec.feed(s.data)
    assert norm(events) == expected
    s.check_buffers(events)
    assert dec.idle
    dec.check_eof()
    # arbitrary chunking
    dec = ParcelDecoder(buffer_size=buffer_size, placement=s.placement)
    events = feed_chunks(dec, s.data, chunks)
    assert norm(events) == expected
    s.check_buffers(events)
    assert dec.idle
    dec.check_eof()
    # one byte at a time (small cases)
    if len(s.data) <= 4000:
        dec = ParcelDecoder(buffer_size=buffer_size, placement=s.placement)
        events = feed_chunks(dec, s.data, [1])
        assert norm(events) == expected
        s.check_buffers(events)
        assert dec.idle
        dec.check_eof()


@settings(SETTINGS, max_examples=100)
@given(case=stream_cases(), rng=st.randoms(use_true_random=False), buffer_size=st.sampled_from(BUFFER_SIZES),
       partial=st.booleans())
def test_roundtrip_buffered_protocol(case, rng, buffer_size, partial):
    """get_buffer()/buffer_updated(); bulk payloads go straight to their frames."""
    s, _, _ = case
    payload_at = {}
    for start, end, vc, seq, index in s.fragments:
        for p in range(start, end):
            payload_at[p] = (end, vc, seq, index)
    direct_targets: dict = {}  # (vc, seq, frame index) -> ids of the buffers handed out
    direct_objs: dict = {}  # keeps those buffers alive, so that their ids stay unique
    bound = max(buffer_size, s.max_unit)
    dec = ParcelDecoder(buffer_size=buffer_size, placement=s.placement)

    def on_buffer(pos, buf):
        if pos in payload_at:
            end, vc, seq, index = payload_at[pos]
            # during a fragment payload: exactly the remaining bytes of the fragment,
            # inside the destination frame (not the receive buffer)
            assert buf.nbytes == end - pos
            assert isinstance(buf.obj, np.ndarray)
            direct_targets.setdefault((vc, seq, index), set()).add(id(buf.obj))
            direct_objs[id(buf.obj)] = buf.obj
        else:
            assert isinstance(buf.obj, bytearray)
            # fragments never make the receive buffer grow beyond its size
            assert buf.nbytes <= bound

    events = feed_buffered(dec, s.data, rng if partial else None, on_buffer)
    assert norm(events) == s.expected()
    s.check_buffers(events)
    assert dec.idle
    dec.check_eof()
    # the bytes written into the direct buffers are the very frames delivered
    for ev in events:
        if isinstance(ev, Message):
            for index, frame in enumerate(ev.frames):
                objs = direct_targets.get((ev.vc, ev.seq, index))
                if objs:
                    assert objs == {id(frame.obj)}


def test_bulk_frames_bypass_receive_buffer():
    """A big bulk frame is written in place; the receive buffer never grows."""
    rng = random.Random(7)
    big = rng.randbytes(3 * 1024 * 1024 + 17)
    small = b"small"
    buffer_size = 4096
    data = encode_connect(3) + encode_parcel(3, 0, [small, big, small], 64, 256 * 1024) + encode_close(3)
    dec = ParcelDecoder(buffer_size=buffer_size)
    into_receive_buffer = 0
    into_frames = 0
    pos = 0
    events = []
    while pos < len(data):
        buf = dec.get_buffer()
        n = min(buf.nbytes, len(data) - pos)
        if isinstance(buf.obj, bytearray):
            assert buf.nbytes <= buffer_size
            into_receive_buffer += n
        else:
            into_frames += n
        buf[:n] = data[pos : pos + n]
        pos += n
        events += dec.buffer_updated(n)
    assert norm(events) == [("connect", 3), ("msg", 3, 0, [small, big, small]), ("close", 3)]
    # header-like frames and the big one: one group, as Dask's tcp would read them
    check_buffers(events[1].frames, [False, True, True])
    # all but (at most) one receive-buffer's worth per fragment went straight in place
    nfragments = -(-len(big) // (256 * 1024))
    assert into_frames >= len(big) - nfragments * buffer_size
    assert into_receive_buffer + into_frames == len(data)
    frame = events[1].frames[1]
    check_frame(frame)
    assert isinstance(frame.obj, np.ndarray)


def test_get_buffer_during_fragment_is_the_rest_of_the_fragment():
    frame = bytes(range(256)) * 4
    data = encode_connect(1) + encode_parcel(1, 0, [frame], 16, 300)
    head_end = len(encode_connect(1)) + HEADER.size + 8
    dec = ParcelDecoder(buffer_size=4096)
    # connect + parcel head + the first fragment's header, and 5 payload bytes
    assert dec.feed(data[: head_end + FRAG_HEAD + 5]) == [Connect(1)]
    buf = dec.get_buffer()
    assert buf.nbytes == 300 - 5
    assert isinstance(buf.obj, np.ndarray)
    assert not dec.idle
    # the same view until written to
    assert dec.get_buffer().nbytes == 300 - 5
    buf[:10] = data[head_end + FRAG_HEAD + 5 : head_end + FRAG_HEAD + 15]
    assert dec.buffer_updated(10) == []
    assert dec.get_buffer().nbytes == 300 - 15
    # exactly at a fragment header end: the whole payload is handed out
    rest = dec.feed(data[head_end + FRAG_HEAD + 15 : head_end + 2 * FRAG_HEAD + 300])
    assert rest == []
    assert dec.get_buffer().nbytes == 300
    events = dec.feed(data[head_end + 2 * FRAG_HEAD + 300 :])
    assert norm(events) == [("msg", 1, 0, [frame])]
    assert dec.idle


def test_buffer_updated_zero_is_harmless():
    data = encode_connect(1) + encode_parcel(1, 0, [b"q" * 40], 8, 16)
    dec = ParcelDecoder(buffer_size=64)
    events = []
    for i in range(len(data)):
        buf = dec.get_buffer()
        assert dec.buffer_updated(0) == []
        buf = dec.get_buffer()
        buf[:1] = data[i : i + 1]
        events += dec.buffer_updated(1)
        assert dec.buffer_updated(0) == []
    assert norm(events) == [("connect", 1), ("msg", 1, 0, [b"q" * 40])]
    assert dec.idle


def test_receive_buffer_grows_for_large_eager_parcel_then_shrinks():
    frame = b"e" * 100_000
    dec = ParcelDecoder(buffer_size=1024)
    assert dec.get_buffer().nbytes <= 1024
    events = dec.feed(encode_connect(1) + encode_parcel(1, 0, [frame], 1 << 20, 1 << 20))
    assert norm(events) == [("connect", 1), ("msg", 1, 0, [frame])]
    assert dec.idle
    assert dec.get_buffer().nbytes <= 1024


def test_feed_accepts_any_buffer_type():
    data = encode_connect(2) + encode_parcel(2, 0, [b"abc" * 10], 4, 8)
    expected = [("connect", 2), ("msg", 2, 0, [b"abc" * 10])]
    for wrap in (bytes, bytearray, memoryview, lambda b: np.frombuffer(b, dtype=np.uint8)):
        assert norm(ParcelDecoder().feed(wrap(data))) == expected


def test_feed_keeps_no_view_of_what_it_was_fed():
    """Fed with no bytes waiting, data is parsed where it lies: the frames
    are copies, and a parcel's beginning left at its end is kept as a copy."""
    first = encode_parcel(1, 0, [b"abc", b"defg"], 16, 64)
    second = encode_parcel(1, 1, [b"xyz" * 5], 16, 64)
    chunk = bytearray(first + second[:20])
    dec = ParcelDecoder()
    events = dec.feed(chunk)
    chunk[:] = bytes(len(chunk))
    assert norm(events) == [("msg", 1, 0, [b"abc", b"defg"])]
    assert norm(dec.feed(second[20:])) == [("msg", 1, 1, [b"xyz" * 5])]
    assert dec.idle


# ---------------------------------------------------------------------------
# Truncation
# ---------------------------------------------------------------------------

def test_every_prefix_of_fixed_stream_byte_by_byte():
    s = fixed_stream()
    dec = ParcelDecoder(buffer_size=32)
    events = []
    for pos in range(len(s.data) + 1):
        assert norm(events) == s.expected(pos), pos
        if pos in s.boundaries:
            assert dec.idle, pos
            dec.check_eof()
        else:
            assert not dec.idle, pos
            with pytest.raises(ProtocolError, match="middle of a parcel"):
                dec.check_eof()
        if pos < len(s.data):
            events += dec.feed(s.data[pos : pos + 1])


def test_every_prefix_of_fixed_stream_fresh_decoder():
    s = fixed_stream()
    for k in range(len(s.data) + 1):
        dec = ParcelDecoder(buffer_size=100)
        assert norm(dec.feed(s.data[:k])) == s.expected(k), k
        assert dec.idle == (k in s.boundaries), k
        if k not in s.boundaries:
            with pytest.raises(ProtocolError):
                dec.check_eof()


@settings(SETTINGS, max_examples=100)
@given(case=stream_cases(), data=st.data(), buffer_size=st.sampled_from(BUFFER_SIZES))
def test_truncated_stream(case, data, buffer_size):
    s, _, _ = case
    near = sorted({b + d for b in s.boundaries for d in (-1, 0, 1) if 0 <= b + d <= len(s.data)})
    k = data.draw(st.one_of(st.integers(0, len(s.data)), st.sampled_from(near)), label="prefix")
    rng = data.draw(st.randoms(use_true_random=False), label="chunking")
    dec = ParcelDecoder(buffer_size=buffer_size, placement=s.placement)
    events = feed_buffered(dec, s.data[:k], rng)
    assert norm(events) == s.expected(k)
    if k in s.boundaries:
        assert dec.idle
        dec.check_eof()
    else:
        assert not dec.idle
        with pytest.raises(ProtocolError, match="middle of a parcel"):
            dec.check_eof()
    # a truncation is only a pause: the rest of the stream completes it
    events += feed_buffered(dec, s.data[k:], rng)
    assert norm(events) == s.expected()
    s.check_buffers(events)
    assert dec.idle


def test_check_eof_mid_header_and_mid_hello():
    for partial in (MAGIC, encode_connect(1)[:23], encode_hello(b"abcdef")[:-1]):
        dec = ParcelDecoder()
        assert dec.feed(partial) == []
        assert not dec.idle
        with pytest.raises(ProtocolError, match="middle of a parcel"):
            dec.check_eof()


# ---------------------------------------------------------------------------
# Corruption and garbage
# ---------------------------------------------------------------------------

@settings(SETTINGS, max_examples=200)
@given(
    case=stream_cases(max_vcs=2, max_msgs=2, max_frames=3, max_thr=16, max_frag=20),
    data=st.data(),
)
def test_single_byte_corruption(case, data):
    s, _, _ = case
    in_header = data.draw(st.booleans(), label="in header")
    headers = set(s.header_positions)
    payload = [p for p in range(len(s.data)) if p not in headers]
    if in_header or not payload:
        pos = data.draw(st.sampled_from(s.header_positions), label="pos")
    else:
        pos = data.draw(st.sampled_from(payload), label="pos")
    value = data.draw(st.integers(0, 255).filter(lambda v: v != s.data[pos]), label="value")
    corrupted = bytearray(s.data)
    corrupted[pos] = value
    rng = data.draw(st.none() | st.randoms(use_true_random=False), label="chunking")
    events, error = decode_untrusted(bytes(corrupted), rng, placement=s.placement)
    if pos not in s.header_positions:
        # payload bytes are never interpreted: same events, one byte different
        assert error is None
        expected = s.expected()
        assert [shape(e) for e in events] == [shape(e) for e in expected]
        assert events != expected


def shape(event: tuple) -> tuple:
    """An event without its payload bytes (only their lengths)."""
    if event[0] == "msg":
        return (*event[:3], tuple(len(f) for f in event[3]))
    if event[0] == "hello":
        return ("hello", len(event[1]))
    return event


def test_every_header_byte_corruption_of_fixed_stream():
    s = fixed_stream()
    errors = 0
    for pos in s.header_positions:
        old = s.data[pos]
        for value in {0, 1, 2, 3, 4, 5, 6, 0x7F, 0x80, 0xFF, old ^ 1, old ^ 0x80, (old + 1) % 256}:
            if value == old:
                continue
            corrupted = bytearray(s.data)
            corrupted[pos] = value
            _, error = decode_untrusted(bytes(corrupted), None)
            errors += error is not None
    assert errors > 0


@settings(SETTINGS, max_examples=100)
@given(garbage=st.binary(max_size=600), rng=st.none() | st.randoms(use_true_random=False))
def test_random_garbage(garbage, rng):
    events, error = decode_untrusted(garbage, rng)
    if error is None:
        # almost surely just waiting for more data
        assert events == [] or garbage.startswith(MAGIC)


@st.composite
def plausible_units(draw):
    kind = draw(st.sampled_from([0, 7, 255, *Kind]))
    flags = draw(st.sampled_from([0, 0, 0, 1, 0x8000]))
    vc = draw(st.sampled_from([0, 1, MAX_VC]) | st.integers(0, MAX_VC))
    seq = draw(st.sampled_from([0, 0, 1, 2**64 - 1]) | st.integers(0, 2**64 - 1))
    count = draw(st.sampled_from([0, 1, 2, 3, 255, 256, 257, 2**32 - 1]) | st.integers(0, 2**32 - 1))
    unit = hdr(kind, vc, seq, count, flags=flags)
    if kind == Kind.PARCEL and count <= 8:
        sizes = draw(
            st.lists(
                st.sampled_from([0, 1, 5, BULK, BULK | 1, BULK | 100, 2**60, BULK | 2**60, 2**64 - 1])
                | st.integers(0, 2**64 - 1),
                min_size=count,
                max_size=count,
            )
        )
        unit += table(*sizes)
    elif kind == Kind.PLACED:
        unit += PLACED_EXT.pack(*(draw(st.sampled_from([0, 1, 4096, 2**64 - 1])) for _ in range(3)))
    elif kind == Kind.FRAGMENT:
        unit += FRAGMENT_EXT.pack(
            draw(st.sampled_from([0, 1, 2**64 - 1]) | st.integers(0, 2**64 - 1)),
            draw(st.sampled_from([0, 1, 5, 2**63]) | st.integers(0, 2**64 - 1)),
        )
    return unit + draw(st.binary(max_size=64))


@settings(SETTINGS, max_examples=150)
@given(
    prefix=st.sampled_from([b"", encode_connect(1), encode_connect(1) + raw_parcel(1, 0, [BULK | 10])]),
    units=st.lists(plausible_units(), min_size=1, max_size=4),
    rng=st.none() | st.randoms(use_true_random=False),
)
def test_plausible_headers_with_random_fields(prefix, units, rng):
    """Valid magic and version, every other field arbitrary."""
    decode_untrusted(prefix + b"".join(units), rng)


# ---------------------------------------------------------------------------
# Limits: refuse before allocating
# ---------------------------------------------------------------------------

@pytest.fixture
def alloc_spy():
    with spying() as spy:
        yield spy


def assert_refused_cheaply(data: bytes, match: str, limits: Limits, spy: AllocationSpy,
                           buffer_size: int = 1024):
    """Feeding ``data`` (which ends where the lie becomes visible) raises at once,
    with no large allocation."""
    dec = ParcelDecoder(limits=limits, buffer_size=buffer_size)
    spy.sizes.clear()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with pytest.raises(ProtocolError, match=match):
            dec.feed(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, f"peak traced allocation {peak} bytes"
    assert all(n <= max(buffer_size, len(data), 4096) for n in spy.sizes), spy.sizes
    assert dec._buf is None or len(dec._buf) <= max(buffer_size, len(data))


HUGE_CLAIMS = [
    pytest.param(
        encode_connect(1) + raw_parcel(1, 0, [2**60]), "eager bytes exceed", id="eager-2**60"
    ),
    pytest.param(
        encode_connect(1) + raw_parcel(1, 0, [BULK | 2**60]), "exceeds the limit", id="bulk-2**60"
    ),
    pytest.param(
        encode_connect(1) + raw_parcel(1, 0, [BULK | SIZE_MASK]), "exceeds the limit", id="bulk-max"
    ),
    pytest.param(
        encode_connect(1) + raw_parcel(1, 0, [SIZE_MASK]), "eager bytes exceed", id="eager-max"
    ),
    pytest.param(
        encode_connect(1) + raw_parcel(1, 0, [2**64 - 1]), "shares the buffer of no earlier frame",
        id="u64-max"
    ),
    pytest.param(
        encode_connect(1) + raw_parcel(1, 0, [BULK | 2**61] * 4), "exceeds the limit", id="bulk-sum"
    ),
    pytest.param(
        encode_connect(1) + raw_parcel(1, 0, [BULK | 2**61] + [BULK | SHARE | 2**61] * 3),
        "exceeds the limit",
        id="bulk-group-sum"
    ),
    pytest.param(
        encode_connect(1) + raw_parcel(1, 0, [2**61] * 4 + [BULK | 1]), "eager bytes exceed", id="eager-sum"
    ),
    pytest.param(
        encode_connect(1) + raw_parcel(1, 0, [2**61] + [SHARE | 2**61] * 3), "eager bytes exceed",
        id="eager-group-sum"
    ),
    pytest.param(
        # one eager group whose sizes overflow the low u32 words
        encode_connect(1) + raw_parcel(1, 0, [2**40, SHARE | 2**40]), "eager bytes exceed",
        id="eager-group-u32-overflow"
    ),
    pytest.param(
        encode_connect(1) + hdr(Kind.PARCEL, 1, 0, 2**32 - 1), "frames exceeds the limits",
        id="frames-u32-max",
    ),
    pytest.param(
        encode_connect(1) + hdr(Kind.PARCEL, 1, 0, 2**20 + 1), "frames exceeds the limits",
        id="frames-default+1",
    ),
    pytest.param(hdr(Kind.HELLO, 0, 0, 2**32 - 1), "malformed hello", id="hello-u32-max"),
    pytest.param(hdr(Kind.HELLO, 0, 0, MAX_HELLO_BYTES + 1), "malformed hello", id="hello-max+1"),
    pytest.param(
        encode_connect(1) + raw_parcel(1, 0, [BULK | 10]) + raw_fragment(1, 0, 0, 0, b"", nbytes=2**60),
        "does not continue",
        id="fragment-2**60",
    ),
    pytest.param(
        encode_connect(1)
        + raw_parcel(1, 0, [BULK | 10])
        + raw_fragment(1, 0, 0, 2**63, b"", nbytes=2**63),
        "does not continue",
        id="fragment-offset-2**63",
    ),
]


@pytest.mark.parametrize("data, match", HUGE_CLAIMS)
def test_huge_claims_refused_with_default_limits(data, match, alloc_spy):
    assert_refused_cheaply(data, match, Limits(), alloc_spy)


@pytest.mark.parametrize("data, match", HUGE_CLAIMS)
def test_huge_claims_refused_with_small_limits(data, match, alloc_spy):
    assert_refused_cheaply(data, match, SMALL_LIMITS, alloc_spy)


LIMITS = Limits(max_message_bytes=1000, max_frames=10, max_eager_bytes=200)


def test_max_frames_plus_one_refused_at_the_header(alloc_spy):
    # only the 24-byte header: the (80 + 8)-byte size table never has to arrive
    data = encode_connect(1) + hdr(Kind.PARCEL, 1, 0, LIMITS.max_frames + 1)
    assert_refused_cheaply(data, "11 frames exceeds the limits", LIMITS, alloc_spy)


def test_max_frames_accepted():
    data = encode_connect(1) + encode_parcel(1, 0, [b"x"] * LIMITS.max_frames, 100, 100)
    events = ParcelDecoder(limits=LIMITS).feed(data)
    assert norm(events)[1] == ("msg", 1, 0, [b"x"] * 10)


def test_size_table_counts_towards_eager_limit(alloc_spy):
    limits = Limits(max_message_bytes=10**6, max_frames=10**6, max_eager_bytes=80)
    ok = encode_connect(1) + encode_parcel(1, 0, [b""] * 10, 100, 100)
    assert norm(ParcelDecoder(limits=limits).feed(ok))[1] == ("msg", 1, 0, [b""] * 10)
    # 11 frames need an 88-byte size table: refused from the header alone
    data = encode_connect(1) + hdr(Kind.PARCEL, 1, 0, 11)
    assert_refused_cheaply(data, "exceeds the limits", limits, alloc_spy)


def test_eager_limit_boundary(alloc_spy):
    # the size table and the eager frames together may take max_eager_bytes
    budget = LIMITS.max_eager_bytes - 8 * 2
    frames = [b"a" * (budget - 50), b"b" * 50]
    ok = encode_connect(1) + encode_parcel(1, 0, frames, 1000, 1000)
    assert norm(ParcelDecoder(limits=LIMITS).feed(ok))[1] == ("msg", 1, 0, frames)
    # one byte more is refused as soon as the size table is in, before the body
    data = encode_connect(1) + raw_parcel(1, 0, [budget - 50, 51])
    assert_refused_cheaply(data, f"{budget + 1} eager bytes exceed the limit", LIMITS, alloc_spy)


def test_message_limit_boundary(alloc_spy):
    frames = [b"e" * 100, b"B" * 900]
    ok = encode_connect(1) + encode_parcel(1, 0, frames, 100, 300)
    assert norm(ParcelDecoder(limits=LIMITS).feed(ok))[1] == ("msg", 1, 0, frames)
    data = encode_connect(1) + raw_parcel(1, 0, [100, BULK | 901])
    assert_refused_cheaply(data, "message of 1001 bytes exceeds the limit", LIMITS, alloc_spy)


def test_eager_claim_within_limits_does_not_allocate_before_data(alloc_spy):
    """A legal but big eager claim grows the buffer only as far as the limit allows."""
    limits = Limits(max_message_bytes=1 << 20, max_frames=16, max_eager_bytes=1 << 16)
    dec = ParcelDecoder(limits=limits, buffer_size=1024)
    assert dec.feed(encode_connect(1) + raw_parcel(1, 0, [60_000])) == [Connect(1)]
    assert dec.get_buffer().nbytes == 60_000  # room for exactly the announced eager bytes
    assert max(alloc_spy.sizes) == HEADER.size + 8 + 60_000
    assert not dec.idle


# ---------------------------------------------------------------------------
# Decoded frames: writable, and never aliasing the receive buffer
# ---------------------------------------------------------------------------

def test_frames_are_writable_memoryviews():
    frames_in = [b"", b"abc", b"x" * 7, b"B" * 100, b""]
    dec = ParcelDecoder()
    msg = decode_one(dec, encode_parcel(0, 0, frames_in, 8, 32))
    assert [bytes(f) for f in msg.frames] == frames_in
    for f in msg.frames:
        check_frame(f)
        if f.nbytes:
            f[0] = ord("Z")
            assert f[0] == ord("Z")
            np.frombuffer(f, dtype=np.uint8)[:] = 1  # zero-copy numpy view, writable
    # writing into one frame changed only that frame
    assert [bytes(f) for f in msg.frames] == [b"", b"\x01" * 3, b"\x01" * 7, b"\x01" * 100, b""]


def test_eager_frames_do_not_alias_the_receive_buffer():
    a = [b"first-" + bytes(range(40)), b"", b"second"]
    dec = ParcelDecoder(buffer_size=4096)
    m1 = decode_one(dec, encode_parcel(0, 0, a, 64, 64))
    before = [bytes(f) for f in m1.frames]
    assert before == a
    for f in m1.frames:
        assert f.obj is not dec._buf
    # scribble over everything the decoder will hand out, then decode more
    buf = dec.get_buffer()
    buf[:] = b"\xee" * buf.nbytes
    (m2,) = dec.feed(encode_parcel(0, 1, [b"Q" * 46, b"", b"R" * 6], 64, 64))  # same vc, next seq
    assert [bytes(f) for f in m1.frames] == before
    assert [bytes(f) for f in m2.frames] == [b"Q" * 46, b"", b"R" * 6]
    # and scribbling over the earlier message's frames does not touch the later one
    for f in m1.frames:
        f[:] = b"\x00" * f.nbytes
    assert [bytes(f) for f in m2.frames] == [b"Q" * 46, b"", b"R" * 6]


@settings(SETTINGS, max_examples=30)
@given(case=stream_cases(max_vcs=2), buffer_size=st.sampled_from([0, 64, 4096]))
def test_frames_survive_later_decoding(case, buffer_size):
    """No frame ever aliases memory the decoder reuses afterwards."""
    s, _, _ = case
    dec = ParcelDecoder(buffer_size=buffer_size, placement=s.placement)
    got = []
    for i in range(len(s.data)):
        evs = dec.feed(s.data[i : i + 1])
        got += evs
        # trash whatever buffer the decoder offers next, without reporting it
        buf = dec.get_buffer()
        if isinstance(buf.obj, bytearray):
            buf[:] = b"\xa5" * buf.nbytes
    assert norm(got) == s.expected()
    s.check_buffers(got)


# ---------------------------------------------------------------------------
# Placed groups: bulk data the sender already wrote into shared memory
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("feed", ["whole", "bytewise", "buffered"])
def test_placed_groups_are_views_of_the_shared_memory(feed, alloc_spy):
    shard = memoryview(bytearray(b"0123456789"))
    frames = [b"ab", shard[:4], shard[4:], bytearray(b"xyz"), bytearray(b"bulk-two"), b""]
    assert shares_buffer(frames) == [False, True, True, False, False, False]
    pool = SharedPool()
    p = OutgoingParcel(1, 0, frames, eager_threshold=4, fragment_size=3)
    assert p.bulk_groups == [[b"ab", b"0123", b"456789"], [b"bulk-two"]]
    assert pool.place(p, offset=64) == [100, 101]
    data = encode_connect(1) + b"".join(bytes(b) for unit in units_of(p) for b in unit)
    dec = ParcelDecoder(buffer_size=24, placement=pool.resolve)
    if feed == "whole":
        events = dec.feed(data)
    elif feed == "bytewise":
        events = [e for i in range(len(data)) for e in dec.feed(data[i : i + 1])]
    else:
        events = feed_buffered(dec, data)
    message = events[-1]
    assert isinstance(message, Message)
    assert [bytes(f) for f in message.frames] == [flat(f) for f in frames]
    assert pool.requests == [(100, 64, 12), (101, 64, 8)]
    for index, handle in ((0, 100), (1, 100), (2, 100), (4, 101)):
        assert np.shares_memory(np.frombuffer(message.frames[index], np.uint8), pool.blocks[handle])
    check_buffers(message.frames, shares_buffer(frames, 4))
    # no buffer was allocated for the bulk groups; the eager one was copied out
    assert alloc_spy.arrays == []
    assert alloc_spy.copies == [3]
    assert dec.idle


def test_placed_and_fragmented_groups_mix(alloc_spy):
    frames = [bytearray(b"A" * 20), bytearray(b"B" * 30), b"h", bytearray(b"C" * 40)]
    assert shares_buffer(frames) == [False, False, False, False]
    pool = SharedPool()
    p = OutgoingParcel(1, 0, frames, eager_threshold=4, fragment_size=16)
    assert len(p.bulk_groups) == 3
    assert pool.place(p, groups=[0, 2]) == [100, 101]
    assert unit_kinds(p) == [
        ("parcel", (BULK | 20, BULK | 30, 1, BULK | 40)),
        ("placed", 0, 100, 0, 20),
        ("fragment", 1, 0, 16),
        ("fragment", 1, 16, 14),
        ("placed", 3, 101, 0, 40),
    ]
    pool = SharedPool()
    p = OutgoingParcel(1, 0, frames, eager_threshold=4, fragment_size=16)
    pool.place(p, groups=[0, 2])
    data = encode_connect(1) + b"".join(bytes(b) for unit in units_of(p) for b in unit)
    for chunk in (len(data), 1, 7):
        alloc_spy.arrays.clear()
        dec = ParcelDecoder(placement=pool.resolve)
        events = feed_chunks(dec, data, [chunk])
        assert norm(events) == [("connect", 1), ("msg", 1, 0, [flat(f) for f in frames])]
        frames_out = events[1].frames
        check_buffers(frames_out, [False] * 4)
        assert np.shares_memory(np.frombuffer(frames_out[0], np.uint8), pool.blocks[100])
        assert np.shares_memory(np.frombuffer(frames_out[3], np.uint8), pool.blocks[101])
        assert isinstance(frames_out[1].obj, np.ndarray) and frames_out[1].obj.base is None
        assert alloc_spy.arrays == [30]  # only the fragmented group got a buffer
        assert dec.idle


def test_placement_errors_propagate():
    pool = SharedPool()
    frames = [bytearray(b"x" * 40)]
    data = encode_connect(1) + encode_parcel_with(frames, 4, 3, pool=pool)
    bad = data.replace(PLACED_EXT.pack(100, 0, 40), PLACED_EXT.pack(100, 8, 40))
    assert bad != data
    with pytest.raises(ProtocolError, match="outside the pool"):
        ParcelDecoder(placement=pool.resolve).feed(bad)


@pytest.mark.parametrize(
    "placed, match",
    [
        pytest.param(raw_placed(1, 0, 4, 0, 0, 5),
                     r"placed group 4\+5 is not the next bulk group of parcel 0 on vc 1",
                     id="second-group-first"),
        pytest.param(raw_placed(1, 0, 2, 0, 0, 4), "is not the next", id="starts-at-a-group-member"),
        pytest.param(raw_placed(1, 0, 2, 0, 0, 14), "is not the next", id="starts-at-a-group-member-whole"),
        pytest.param(raw_placed(1, 0, 0, 0, 0, 14), "is not the next", id="starts-at-eager-frame"),
        pytest.param(raw_placed(1, 0, 3, 0, 0, 14), "is not the next", id="starts-at-empty-frame"),
        pytest.param(raw_placed(1, 0, 1, 0, 0, 10), "is not the next", id="first-frame-only"),
        pytest.param(raw_placed(1, 0, 1, 0, 0, 13), "is not the next", id="one-byte-short"),
        pytest.param(raw_placed(1, 0, 1, 0, 0, 15), "is not the next", id="one-byte-long"),
        pytest.param(raw_placed(1, 0, 1, 0, 0, 19), "is not the next", id="both-groups"),
        pytest.param(raw_fragment(1, 0, 1, 0, b"a" * 5) + raw_placed(1, 0, 1, 0, 0, 14), "is not the next",
                     id="after-a-fragment"),
        pytest.param(raw_fragment(1, 0, 1, 0, b"a" * 10) + raw_placed(1, 0, 1, 0, 0, 14), "is not the next",
                     id="after-a-frame"),
        pytest.param(raw_fragment(1, 0, 1, 0, b"a" * 10) + raw_placed(1, 0, 2, 0, 0, 4), "is not the next",
                     id="rest-of-a-group"),
        pytest.param(raw_fragment(1, 0, 1, 0, b"a" * 10) + raw_fragment(1, 0, 2, 0, b"b" * 4)
                     + raw_placed(1, 0, 1, 0, 0, 14), "is not the next", id="group-already-fragmented"),
        pytest.param(raw_placed(1, 0, 1, 0, 0, 14) + raw_placed(1, 0, 1, 0, 0, 14), "is not the next",
                     id="placed-twice"),
        pytest.param(raw_placed(1, 0, 1, 0, 0, 14) + raw_fragment(1, 0, 1, 0, b"a" * 10), "does not continue",
                     id="fragment-after-placed"),
        pytest.param(raw_placed(1, 0, 1, 0, 0, 14) + raw_fragment(1, 0, 2, 0, b"a" * 4), "does not continue",
                     id="fragment-of-placed-group"),
        pytest.param(raw_placed(1, 0, 1, 0, 0, 14) + raw_placed(1, 0, 4, 0, 0, 5)
                     + raw_placed(1, 0, 4, 0, 0, 5), "placed group for unknown parcel 0 on vc 1",
                     id="after-the-last-group"),
    ],
)
def test_placed_must_be_the_next_bulk_group(placed, match, alloc_spy):
    pool = SharedPool()
    pool.write(0, 0, [memoryview(b"\0" * 64)])
    dec = ParcelDecoder(placement=pool.resolve)
    dec.feed(encode_connect(1) + P_GROUPS)
    with pytest.raises(ProtocolError, match=match):
        dec.feed(placed)
    # only the valid records were resolved: an offending one is refused first
    records = placed.count(MAGIC + bytes([VERSION, Kind.PLACED]))
    offending_is_a_record = placed[placed.rindex(MAGIC) + 5] == Kind.PLACED
    assert len(pool.requests) == records - offending_is_a_record
    assert all(request in ((0, 0, 14), (0, 0, 5)) for request in pool.requests)
    # and only fragments made the decoder allocate (their group's buffer)
    if MAGIC + bytes([VERSION, Kind.FRAGMENT]) not in placed:
        assert alloc_spy.arrays == []


def test_placed_group_boundaries():
    """P_GROUPS placed group by group: the frames come out of the two blocks."""
    pool = SharedPool()
    pool.write(7, 0, [memoryview(b"0123456789wxyz")])
    pool.write(8, 3, [memoryview(b"VWXYZ")])
    dec = ParcelDecoder(placement=pool.resolve)
    placed = raw_placed(1, 0, 1, 7, 0, 14) + raw_placed(1, 0, 4, 8, 3, 5)
    events = dec.feed(encode_connect(1) + P_GROUPS + placed)
    assert norm(events) == [("connect", 1), ("msg", 1, 0, [b"abc", b"0123456789", b"wxyz", b"", b"VWXYZ"])]
    check_buffers(events[1].frames, [False, False, True, False, False])
    assert pool.requests == [(7, 0, 14), (8, 3, 5)]
    assert dec.idle


# ---------------------------------------------------------------------------
# Hostile size tables: refused before anything is allocated
# ---------------------------------------------------------------------------

HOSTILE_TABLES = [
    pytest.param([SHARE | 3], "frame 0 shares the buffer of no earlier frame", id="share-first"),
    pytest.param([0, SHARE | 3, 3], "frame 1 shares the buffer of no earlier frame",
                 id="share-first-nonempty"),
    pytest.param([3, SHARE | 3, BULK | SHARE | 3], "frame 2 shares a buffer across", id="eager-then-bulk"),
    pytest.param([BULK | 3, SHARE | 3, 3], "frame 1 shares a buffer across", id="bulk-then-eager"),
    pytest.param([3, SHARE, 3], "empty shared frame 1", id="empty-shared"),
    pytest.param([3, BULK, 3], "empty bulk frame 1", id="empty-bulk"),
    pytest.param([3, SHARE | 3] * 20 + [SHARE | BULK | 1], "frame 40 shares a buffer across", id="long"),
]


@pytest.mark.parametrize("sizes, match", HOSTILE_TABLES)
def test_hostile_tables_refused_without_allocation(sizes, match, alloc_spy):
    eager = b"e" * sum(size & SIZE_MASK for size in sizes if not size & BULK)
    dec = ParcelDecoder(buffer_size=4096)
    dec.feed(encode_connect(1))
    with pytest.raises(ProtocolError, match=match):
        dec.feed(raw_parcel(1, 0, sizes, eager) + raw_fragment(1, 0, 0, 0, b"f" * 3))
    assert alloc_spy.arrays == [] and alloc_spy.copies == []


@st.composite
def size_tables(draw):
    """Size tables of frames of 0 to 3 bytes with any flags: mostly wrong."""
    flags = st.sampled_from([0, 0, SHARE, SHARE, BULK, BULK | SHARE])
    return draw(st.lists(st.tuples(flags, st.integers(0, 3)).map(lambda t: t[0] | t[1]), max_size=40))


def model_groups(sizes):
    """The rule of the wire format, written plainly: groups as lists of frame
    indices with their kind, or the index of the first offending frame."""
    groups: list = []
    for index, size in enumerate(sizes):
        n, bulk, share = size & SIZE_MASK, bool(size & BULK), bool(size & SHARE)
        if not n:
            if bulk or share:
                return index
            continue
        if share:
            if not groups or groups[-1][0] != bulk:
                return index
            groups[-1][1].append(index)
        else:
            groups.append((bulk, [index]))
    return groups


@settings(SETTINGS, max_examples=300)
@given(sizes=size_tables())
def test_any_size_table(sizes):
    """Every table the model calls valid decodes into its groups; every other
    one is refused, naming the first offending frame, with nothing allocated."""
    with spying() as alloc_spy:
        check_size_table(sizes, alloc_spy)


def check_size_table(sizes, alloc_spy):
    model = model_groups(sizes)
    eager = bytes(range(sum(size & SIZE_MASK for size in sizes if not size & BULK)))
    dec = ParcelDecoder()
    dec.feed(encode_connect(1))
    if isinstance(model, int):
        with pytest.raises(ProtocolError, match=rf"frame {model}\b"):
            dec.feed(raw_parcel(1, 0, sizes, eager))
        assert alloc_spy.arrays == [] and alloc_spy.copies == []
        return
    events = dec.feed(raw_parcel(1, 0, sizes, eager))
    group_bytes = [(bulk, sum(sizes[i] & SIZE_MASK for i in members)) for bulk, members in model]
    assert alloc_spy.copies == [nbytes for bulk, nbytes in group_bytes if not bulk]
    rest = b""
    for bulk, members in model:
        if bulk:
            for i in members:
                rest += raw_fragment(1, 0, i, 0, b"B" * (sizes[i] & SIZE_MASK))
    events += dec.feed(rest)
    assert alloc_spy.arrays == [nbytes for bulk, nbytes in group_bytes if bulk]
    (message,) = events
    assert [f.nbytes for f in message.frames] == [size & SIZE_MASK for size in sizes]
    shares = [False] * len(sizes)
    for _, members in model:
        for i in members[1:]:
            shares[i] = True
    check_buffers(message.frames, shares)
    assert dec.idle


def test_size_table_is_read_once_however_its_eager_bytes_arrive(monkeypatch):
    """A parcel of many frames whose eager bytes come in many reads (a
    client's graph): its size table is read when complete, not per read."""
    import dask_lcicomm.parcel.reader as reader

    calls = []
    real = reader.groups_of
    monkeypatch.setattr(reader, "groups_of", lambda t: calls.append(len(t)) or real(t))
    sizes = [0, *[100] * 999]  # an empty frame: the table is read in full
    data = raw_parcel(0, 0, sizes, b"x" * 99_900)
    events = feed_chunks(ParcelDecoder(), data, [4096] * (len(data) // 4096 + 1))
    (message,) = [e for e in events if isinstance(e, Message)]
    assert [len(f) for f in message.frames] == sizes
    assert calls == [1000]
