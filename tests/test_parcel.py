"""Tests for :mod:`dask_lcicomm.parcel`, the sans-I/O wire codec of ``lci://``.

In the spirit of h11's test-suite: the codec is exercised with plain bytes only,
through both entry points of the decoder (``feed`` and the BufferedProtocol
pair ``get_buffer``/``buffer_updated``), with property-based tests for

* round trips of arbitrary messages (frames of every buffer type, shards of
  one object, bulk groups fragmented or placed in shared memory) on
  interleaved virtual connections, under arbitrary chunkings of the byte
  stream;
* truncation (every prefix yields exactly the complete events, and
  ``check_eof`` accepts exactly the message boundaries);
* corruption and garbage (only :class:`ProtocolError`, never another
  exception, never a hang, never an unbounded allocation);
* limits (a hostile length is refused *before* anything is allocated);
* receive buffers (each group of frames in one buffer of its own, back to
  back; empty frames in none), checked on every decoded message, and the
  sender's grouping rule against Dask's tcp comm and its own tests
  (``test_share_buffer_with_header``, ``test_do_not_share_buffers``);

plus one explicit test per protocol rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import struct
import threading
import tracemalloc
from collections import deque
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dask_lcicomm import parcel
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
    MessageTooLarge,
    OutgoingParcel,
    ParcelDecoder,
    ProtocolError,
    encode_close,
    encode_connect,
    encode_hello,
    encode_parcel,
    shares_buffer,
)

FRAG_HEAD = HEADER.size + FRAGMENT_EXT.size  # 40 bytes before a fragment's payload

# Limits small enough that nothing a fuzzed stream may legally claim is costly.
SMALL_LIMITS = Limits(max_message_bytes=1 << 20, max_frames=256, max_eager_bytes=1 << 16)

BUFFER_SIZES = [0, 1, 23, 24, 40, 64, 100, 4096, 256 * 1024]

SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---------------------------------------------------------------------------
# Helpers: raw wire pieces
# ---------------------------------------------------------------------------


def hdr(kind, vc=0, seq=0, count=0, *, flags=0, magic=MAGIC, version=VERSION) -> bytes:
    return HEADER.pack(magic, version, kind, flags, vc, seq, count)


def table(*sizes: int) -> bytes:
    return struct.pack(f"<{len(sizes)}Q", *sizes)


def raw_parcel(vc: int, seq: int, sizes: list[int], eager: bytes = b"") -> bytes:
    return hdr(Kind.PARCEL, vc, seq, len(sizes)) + table(*sizes) + eager


def raw_fragment(vc: int, seq: int, index: int, offset: int, data: bytes, nbytes=None) -> bytes:
    n = len(data) if nbytes is None else nbytes
    return hdr(Kind.FRAGMENT, vc, seq, index) + FRAGMENT_EXT.pack(offset, n) + data


def raw_placed(vc: int, seq: int, index: int, handle: int, offset: int, nbytes: int) -> bytes:
    return hdr(Kind.PLACED, vc, seq, index) + PLACED_EXT.pack(handle, offset, nbytes)


def address(frame: memoryview) -> int:
    return np.frombuffer(frame, dtype=np.uint8).__array_interface__["data"][0]


def check_buffers(frames: list[memoryview], shares: list[bool]) -> None:
    """Decoded ``frames`` lie as the sender's ``shares`` say: each group (a
    non-empty frame and the frames sharing its buffer) back to back in one
    buffer, no two groups in the same buffer, empty frames in none."""
    assert len(frames) == len(shares)
    owners: list = []  # the buffer of each group
    previous = None
    for frame, share in zip(frames, shares, strict=True):
        if not frame.nbytes:
            assert not share
            continue
        if share:
            assert previous is not None
            assert frame.obj is previous.obj, "a frame left the buffer of its group"
            assert address(frame) == address(previous) + previous.nbytes, "a gap within a group"
        else:
            owners.append(frame.obj)
        previous = frame
    assert len({id(owner) for owner in owners}) == len(owners), "two groups share a buffer"
    for frame in frames:
        if not frame.nbytes:
            assert all(frame.obj is not owner for owner in owners), "an empty frame holds a group's buffer"


def check_frame(frame) -> None:
    assert isinstance(frame, memoryview)
    assert not frame.readonly
    assert frame.ndim == 1
    assert frame.format == "B"
    assert frame.itemsize == 1
    assert frame.c_contiguous


def norm(events) -> list[tuple]:
    """Events as plain comparable tuples, checking they are well-formed."""
    out = []
    for ev in events:
        if isinstance(ev, Message):
            assert isinstance(ev.vc, int) and 0 <= ev.vc <= MAX_VC
            assert isinstance(ev.seq, int) and 0 <= ev.seq < 1 << 64
            assert isinstance(ev.frames, list)
            for f in ev.frames:
                check_frame(f)
            out.append(("msg", ev.vc, ev.seq, [bytes(f) for f in ev.frames]))
        elif isinstance(ev, Hello):
            assert isinstance(ev.payload, bytes) and len(ev.payload) <= MAX_HELLO_BYTES
            out.append(("hello", ev.payload))
        elif isinstance(ev, Connect):
            assert isinstance(ev.vc, int) and 0 <= ev.vc <= MAX_VC
            out.append(("connect", ev.vc))
        elif isinstance(ev, Close):
            assert isinstance(ev.vc, int) and 0 <= ev.vc <= MAX_VC
            out.append(("close", ev.vc))
        else:  # pragma: no cover
            raise AssertionError(f"unexpected event {ev!r}")
    return out


# ---------------------------------------------------------------------------
# Helpers: feeding a decoder
# ---------------------------------------------------------------------------


def decode_one(dec: ParcelDecoder, parcel_bytes: bytes) -> Message:
    """Open the parcel's vc (if new) and decode the single message in ``parcel_bytes``."""
    vc = HEADER.unpack_from(parcel_bytes)[4]
    seq = HEADER.unpack_from(parcel_bytes)[5]
    events = dec.feed((encode_connect(vc) if seq == 0 else b"") + parcel_bytes)
    assert isinstance(events[-1], Message)
    assert events[:-1] == ([Connect(vc)] if seq == 0 else [])
    return events[-1]


def feed_chunks(dec: ParcelDecoder, data: bytes, chunk_sizes: list[int]) -> list:
    """feed() ``data`` cut into pieces of the (cycled) ``chunk_sizes``."""
    events = []
    pos = i = 0
    while pos < len(data):
        n = chunk_sizes[i % len(chunk_sizes)]
        events += dec.feed(data[pos : pos + n])
        pos += n
        i += 1
    return events


def feed_buffered(
    dec: ParcelDecoder, data: bytes, rng: random.Random | None = None, on_buffer=None, events=None
):
    """The asyncio.BufferedProtocol loop: receive into get_buffer(), report the count.

    With ``rng``, each "recv" fills a random part of the buffer; otherwise as
    much as fits. ``on_buffer(pos, buf)`` sees every buffer handed out.
    Decoded events are appended to ``events`` as they come, so that those
    decoded before an error survive it.
    Each iteration writes at least one byte, so this cannot loop forever.
    """
    events = [] if events is None else events
    pos = 0
    while pos < len(data):
        buf = dec.get_buffer()
        assert isinstance(buf, memoryview)
        assert not buf.readonly and buf.format == "B" and buf.ndim == 1
        assert buf.nbytes > 0, "get_buffer() returned an empty buffer: the reader would spin"
        if on_buffer is not None:
            on_buffer(pos, buf)
        n = min(buf.nbytes, len(data) - pos)
        if rng is not None:
            n = rng.randint(1, n)
        buf[:n] = data[pos : pos + n]
        pos += n
        events += dec.buffer_updated(n)
    return events


@contextlib.contextmanager
def no_hang(seconds: float = 20.0):
    """Fail (rather than hang the suite) if the body takes far too long."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:  # pragma: no cover
        yield
        return

    def alarm(signum, frame):
        raise TimeoutError("the decoder appears to hang")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def decode_untrusted(data: bytes, rng: random.Random | None, limits: Limits = SMALL_LIMITS,
                     buffer_size: int = 1024, placement=None):
    """Decode hostile bytes. Returns (events, error); any non-ProtocolError propagates.

    Also checks that the receive buffer stays bounded by what the limits allow.
    """
    dec = ParcelDecoder(limits=limits, buffer_size=buffer_size, placement=placement)
    bound = max(buffer_size, HEADER.size + max(limits.max_eager_bytes, MAX_HELLO_BYTES), FRAG_HEAD)

    def on_buffer(pos, buf):
        if isinstance(buf.obj, bytearray):  # the decoder's own receive buffer
            assert buf.nbytes <= bound
        else:  # a bulk destination
            assert buf.nbytes <= limits.max_message_bytes

    events: list = []
    with no_hang():
        try:
            # Events decoded before an error are kept (buffer_updated raising
            # loses only its own batch).
            feed_buffered(dec, data, rng, on_buffer, events)
        except ProtocolError as exc:
            assert str(exc)
            return norm(events), exc
    return norm(events), None


# ---------------------------------------------------------------------------
# A simulated sender: several virtual connections, units interleaved
# ---------------------------------------------------------------------------


class SharedPool:
    """A stand-in for memory shared between sender and receiver: one block per
    handle, made by the first write into it, just large enough for it."""

    def __init__(self) -> None:
        self.blocks: dict[int, np.ndarray] = {}
        self.requests: list[tuple[int, int, int]] = []

    def write(self, handle: int, offset: int, frames: list[memoryview]) -> None:
        nbytes = sum(frame.nbytes for frame in frames)
        memory = self.blocks.setdefault(handle, np.zeros(offset + nbytes, dtype=np.uint8))
        for frame in frames:
            memory[offset : offset + frame.nbytes] = np.frombuffer(frame, dtype=np.uint8)
            offset += frame.nbytes

    def place(self, p: OutgoingParcel, groups=None, offset: int = 0) -> list[int]:
        """Write bulk groups of ``p`` (all, or those listed), each at ``offset``
        of a new block, and place them there; their handles."""
        handles = []
        for group, views in enumerate(p.bulk_groups):
            if groups is None or group in groups:
                handle = 100 + len(self.blocks)
                self.write(handle, offset, views)
                p.place(group, handle, offset)
                handles.append(handle)
        return handles

    def resolve(self, handle: int, offset: int, nbytes: int) -> memoryview:
        self.requests.append((handle, offset, nbytes))
        block = self.blocks.get(handle)
        if block is None or offset + nbytes > block.nbytes:
            raise ProtocolError(f"placed group in block {handle} at {offset}+{nbytes} lies outside the pool")
        return memoryview(block[offset : offset + nbytes])


@dataclass
class Stream:
    data: bytes = b""
    events: list = field(default_factory=list)  # (offset where complete, normalized event)
    boundaries: set = field(default_factory=lambda: {0})  # clean places to end the stream
    header_positions: list = field(default_factory=list)  # header/size-table/extension bytes
    fragments: list = field(default_factory=list)  # (payload start, end, vc, seq, frame index)
    max_unit: int = FRAG_HEAD  # the largest unit that is not a fragment
    shares: dict = field(default_factory=dict)  # (vc, seq) -> shares_buffer(frames)
    pool: SharedPool | None = None  # where placed groups lie
    placed: int = 0  # how many groups were placed

    @property
    def placement(self):
        return None if self.pool is None else self.pool.resolve

    def expected(self, upto: int | None = None) -> list:
        return [e for end, e in self.events if upto is None or end <= upto]

    def check_buffers(self, events) -> None:
        for event in events:
            if isinstance(event, Message):
                check_buffers(event.frames, self.shares[event.vc, event.seq])


def flat(frame) -> bytes:
    return frame if isinstance(frame, bytes) else memoryview(frame).cast("B").tobytes()


def build_stream(plan, eager_threshold, fragment_size, rng=None, hello=None, place=None) -> Stream:
    """Send ``plan`` = [(vc, [frames, ...]), ...]: CONNECT, parcels, CLOSE per vc.

    The sender takes one unit at a time from one vc, round-robin (or at random
    with ``rng``); within a vc, parcels are FIFO and each parcel's units go out
    in order before the next parcel starts. With ``place`` (a Random), each
    bulk group is placed in a shared pool or not, at random.
    """
    s = Stream(pool=None if place is None else SharedPool())
    out = bytearray()

    def unit_done(start):
        s.max_unit = max(s.max_unit, len(out) - start) if out[start + 5] != Kind.FRAGMENT else s.max_unit
        if not current:
            s.boundaries.add(len(out))

    current: dict = {}
    if hello is not None:
        start = len(out)
        out += encode_hello(hello)
        s.header_positions += range(start, start + HEADER.size)
        s.events.append((len(out), ("hello", bytes(hello))))
        unit_done(start)

    jobs = {vc: deque([("connect",), *(("parcel", m) for m in msgs), ("close",)]) for vc, msgs in plan}
    seqs = dict.fromkeys(jobs, 0)
    turn = 0
    while jobs:
        active = list(jobs)
        vc = rng.choice(active) if rng is not None else active[turn % len(active)]
        turn += 1
        start = len(out)
        if vc not in current:
            job = jobs[vc].popleft()
            if job[0] != "parcel":
                out += encode_connect(vc) if job[0] == "connect" else encode_close(vc)
                s.header_positions += range(start, start + HEADER.size)
                s.events.append((len(out), (job[0], vc)))
                unit_done(start)
                if not jobs[vc]:
                    del jobs[vc]
                continue
            frames = job[1]
            p = OutgoingParcel(vc, seqs[vc], frames, eager_threshold, fragment_size)
            if s.pool is not None:
                chosen = [g for g in range(len(p.bulk_groups)) if place.random() < 0.5]
                s.placed += len(s.pool.place(p, chosen))
            current[vc] = (p, seqs[vc], [flat(f) for f in frames])
            s.shares[vc, seqs[vc]] = shares_buffer(frames, eager_threshold)
            seqs[vc] += 1
        p, seq, frames = current[vc]
        assert not p.done
        unit = p.next_unit()
        assert unit, "next_unit() returned nothing before the parcel was done"
        for b in unit:
            out += b
        kind = out[start + 5]
        if kind == Kind.PARCEL:
            s.header_positions += range(start, start + HEADER.size + 8 * len(frames))
        elif kind == Kind.PLACED:
            s.header_positions += range(start, start + HEADER.size + PLACED_EXT.size)
        else:
            assert kind == Kind.FRAGMENT
            index = struct.unpack_from("<I", out, start + 20)[0]
            s.header_positions += range(start, start + FRAG_HEAD)
            s.fragments.append((start + FRAG_HEAD, len(out), vc, seq, index))
        if p.done:
            del current[vc]
            s.events.append((len(out), ("msg", vc, seq, frames)))
        unit_done(start)
    s.data = bytes(out)
    return s


WRAPPERS = {
    "bytes": lambda b: b,
    "bytearray": bytearray,
    "memoryview": memoryview,
    "memoryview-of-bytearray": lambda b: memoryview(bytearray(b)),
    "numpy": lambda b: np.frombuffer(bytearray(b), dtype=np.uint8),
}


@st.composite
def message_frames(draw, content: random.Random, max_objects: int, max_size: int):
    """The frames of one message, as Dask makes them: objects of various
    buffer types, some split into shards (consecutive views of one object,
    possibly empty)."""
    frames: list = []
    for _ in range(draw(st.integers(0, max_objects))):
        wrap = draw(st.sampled_from(sorted(WRAPPERS)))
        obj = WRAPPERS[wrap](content.randbytes(draw(st.integers(0, max_size))))
        nshards = draw(st.integers(1, 3))
        if nshards == 1:
            frames.append(obj)
            continue
        view = memoryview(obj).cast("B")
        cuts = sorted(draw(st.lists(st.integers(0, view.nbytes), min_size=nshards - 1, max_size=nshards - 1)))
        bounds = [0, *cuts, view.nbytes]
        frames += [view[a:b] for a, b in pairwise(bounds)]
    return frames


@st.composite
def stream_cases(draw, max_vcs=3, max_msgs=3, max_frames=4, max_thr=40, max_frag=50, placed=None):
    """(Stream, eager_threshold, fragment_size) with random contents and
    interleaving; with ``placed`` (or if drawn so) some bulk groups placed."""
    thr = draw(st.integers(0, max_thr))
    frag = draw(st.integers(1, max_frag))
    vcs = draw(
        st.lists(
            st.one_of(st.sampled_from([0, 1, 2, MAX_VC]), st.integers(0, MAX_VC)),
            min_size=1,
            max_size=max_vcs,
            unique=True,
        )
    )
    seed = draw(st.integers(0, 2**32 - 1))
    content = random.Random(seed)
    plan = []
    for vc in vcs:
        msgs = [
            draw(message_frames(content, max_objects=max_frames, max_size=3 * thr + 4))
            for _ in range(draw(st.integers(0, max_msgs)))
        ]
        plan.append((vc, msgs))
    hello = draw(st.none() | st.binary(max_size=40))
    interleave = draw(st.none() | st.randoms(use_true_random=False))
    if placed is None:
        placed = draw(st.booleans())
    place = draw(st.randoms(use_true_random=False)) if placed else None
    return build_stream(plan, thr, frag, rng=interleave, hello=hello, place=place), thr, frag


def fixed_stream() -> Stream:
    """A small stream with every kind of unit but PLACED, two vcs interleaved."""
    rng = random.Random(1234)
    sharded = memoryview(bytearray(rng.randbytes(25)))
    plan = [
        (1, [
            [b"", bytearray(rng.randbytes(3)), bytearray(rng.randbytes(20))],  # eager, bulk
            [],
            [rng.randbytes(9), sharded[:12], sharded[12:], b""],  # one bulk group
        ]),
        (7, [[bytearray(rng.randbytes(30))], [bytearray(rng.randbytes(1)), bytearray(rng.randbytes(2))]]),
        (MAX_VC, [[b"xyz"]]),
    ]
    return build_stream(plan, eager_threshold=8, fragment_size=10, rng=None, hello=b"hi there")


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


@pytest.mark.parametrize("payload", [b"", b"\x00", bytes(range(256)), b"p" * MAX_HELLO_BYTES])
def test_hello_roundtrip(payload):
    dec = ParcelDecoder(buffer_size=64)
    assert dec.feed(encode_hello(payload)) == [Hello(payload)]
    assert dec.idle


def test_encode_hello_too_large():
    with pytest.raises(ValueError, match="too large"):
        encode_hello(b"p" * (MAX_HELLO_BYTES + 1))


@pytest.mark.parametrize("vc", [0, 1, 12345, MAX_VC])
def test_extreme_vcs_roundtrip(vc):
    data = encode_connect(vc) + encode_parcel(vc, 0, [b"a" * 50], 4, 7) + encode_close(vc)
    assert norm(ParcelDecoder().feed(data)) == [("connect", vc), ("msg", vc, 0, [b"a" * 50]), ("close", vc)]


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


# ---------------------------------------------------------------------------
# Sequence numbers and connection lifecycle
# ---------------------------------------------------------------------------


def test_seq_numbers_per_vc_and_reset_on_reconnect():
    data = (
        encode_connect(1)
        + encode_connect(2)
        + encode_parcel(1, 0, [b"a"], 8, 8)
        + encode_parcel(2, 0, [b"b"], 8, 8)
        + encode_parcel(1, 1, [b"c"], 8, 8)
        + encode_close(1)
        + encode_connect(1)
        + encode_parcel(1, 0, [b"d"], 8, 8)
    )
    events = norm(ParcelDecoder().feed(data))
    msgs = [e for e in events if e[0] == "msg"]
    assert msgs == [
        ("msg", 1, 0, [b"a"]),
        ("msg", 2, 0, [b"b"]),
        ("msg", 1, 1, [b"c"]),
        ("msg", 1, 0, [b"d"]),
    ]


def test_small_message_overtakes_large_one_on_other_vc():
    big = b"B" * 1000
    p1 = OutgoingParcel(1, 0, [big], 16, 100)
    out = encode_connect(1) + encode_connect(2)
    out += b"".join(bytes(b) for b in p1.next_unit())  # head of the big one
    out += b"".join(bytes(b) for b in p1.next_unit())  # one fragment
    out += encode_parcel(2, 0, [b"tiny"], 16, 100)
    dec = ParcelDecoder()
    assert norm(dec.feed(out)) == [("connect", 1), ("connect", 2), ("msg", 2, 0, [b"tiny"])]
    assert not dec.idle
    with pytest.raises(ProtocolError):
        dec.check_eof()
    rest = bytearray()
    while not p1.done:
        for b in p1.next_unit():
            rest += b
    assert norm(dec.feed(rest)) == [("msg", 1, 0, [big])]
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


class AllocationSpy:
    """Stands in for the ``np`` and ``bytearray`` the parcel module uses."""

    def __init__(self):
        self.sizes: list[int] = []  # every allocation by size
        self.arrays: list[int] = []  # bulk buffers
        self.copies: list[int] = []  # eager group buffers (copies out of the receive buffer)

    def empty(self, n, dtype=None):
        self.sizes.append(int(n))
        self.arrays.append(int(n))
        return np.empty(n, dtype=dtype)

    def bytearray(self, *args):
        if args and isinstance(args[0], int):
            self.sizes.append(args[0])
        elif args:
            self.copies.append(memoryview(args[0]).nbytes)
        return bytearray(*args)

    def __getattr__(self, name):
        return getattr(np, name)


@contextlib.contextmanager
def spying():
    spy = AllocationSpy()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(parcel, "np", spy)
        monkeypatch.setattr(parcel, "bytearray", spy.bytearray, raising=False)
        yield spy


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
    assert len(dec._buf) <= max(buffer_size, len(data))


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
# Protocol rules, one by one
# ---------------------------------------------------------------------------

C1 = encode_connect(1)
P_BULK2 = raw_parcel(1, 0, [3, BULK | 10, BULK | 4], b"abc")  # frames 1 and 2 are bulk, in two groups
# groups: eager {0}; bulk {1, 2} of 14 bytes; frame 3 empty; bulk {4} of 5 bytes
P_GROUPS = raw_parcel(1, 0, [3, BULK | 10, BULK | SHARE | 4, 0, BULK | 5], b"abc")

RULES = [
    # (id, valid prefix, offending bytes, error message pattern)
    ("parcel-seq-skipped", C1, raw_parcel(1, 1, [1], b"x"), r"parcel 1 on vc 1 out of order \(expected 0\)"),
    ("parcel-seq-repeated", C1 + raw_parcel(1, 0, [1], b"x"), raw_parcel(1, 0, [1], b"x"),
     r"parcel 0 on vc 1 out of order \(expected 1\)"),
    ("parcel-while-incomplete", C1 + P_BULK2, raw_parcel(1, 1, [1], b"x"), r"out of order"),
    ("fragment-unknown-vc", C1, raw_fragment(1, 0, 0, 0, b"abc"), r"fragment for unknown parcel 0 on vc 1"),
    ("fragment-after-complete", C1 + raw_parcel(1, 0, [1], b"x"), raw_fragment(1, 0, 0, 0, b"abc"),
     r"fragment for unknown parcel"),
    ("fragment-wrong-seq", C1 + P_BULK2, raw_fragment(1, 1, 1, 0, b"a" * 10),
     r"fragment for unknown parcel 1"),
    ("fragment-wrong-vc", C1 + encode_connect(2) + P_BULK2, raw_fragment(2, 0, 1, 0, b"a" * 10),
     r"unknown parcel 0 on vc 2"),
    ("fragment-eager-index", C1 + P_BULK2, raw_fragment(1, 0, 0, 0, b"a" * 3),
     r"fragment 0@0\+3 does not continue"),
    ("fragment-index-ahead", C1 + P_BULK2, raw_fragment(1, 0, 2, 0, b"a" * 4),
     r"does not continue parcel 0 on vc 1"),
    ("fragment-index-out-of-range", C1 + P_BULK2, raw_fragment(1, 0, 99, 0, b"a"), r"does not continue"),
    ("fragment-offset-ahead", C1 + P_BULK2, raw_fragment(1, 0, 1, 5, b"a" * 5),
     r"fragment 1@5\+5 does not continue"),
    ("fragment-offset-repeated", C1 + P_BULK2 + raw_fragment(1, 0, 1, 0, b"a" * 5),
     raw_fragment(1, 0, 1, 0, b"a" * 5), r"does not continue"),
    ("fragment-offset-behind", C1 + P_BULK2 + raw_fragment(1, 0, 1, 0, b"a" * 5),
     raw_fragment(1, 0, 1, 4, b"a" * 6), r"does not continue"),
    ("fragment-empty", C1 + P_BULK2, raw_fragment(1, 0, 1, 0, b""), r"fragment 1@0\+0 does not continue"),
    ("fragment-overruns-frame", C1 + P_BULK2, raw_fragment(1, 0, 1, 0, b"a" * 11), r"does not continue"),
    ("fragment-next-frame-early", C1 + P_BULK2 + raw_fragment(1, 0, 1, 0, b"a" * 5),
     raw_fragment(1, 0, 2, 0, b"a" * 4), r"does not continue"),
    ("connect-twice", C1, encode_connect(1), r"CONNECT for open vc 1"),
    ("connect-while-incomplete", C1 + P_BULK2, encode_connect(1),
     r"CONNECT on vc 1 while a parcel is incomplete"),
    ("close-while-incomplete", C1 + P_BULK2, encode_close(1), r"CLOSE on vc 1 while a parcel is incomplete"),
    ("close-while-incomplete-midway", C1 + P_BULK2 + raw_fragment(1, 0, 1, 0, b"a" * 10), encode_close(1),
     r"CLOSE on vc 1 while a parcel is incomplete"),
    ("flags-connect", b"", hdr(Kind.CONNECT, 1, flags=1), r"reserved flags set: 0x1"),
    ("flags-hello", b"", hdr(Kind.HELLO, flags=0x8000), r"reserved flags set: 0x8000"),
    ("flags-parcel", C1, hdr(Kind.PARCEL, 1, 0, 1, flags=2) + table(1) + b"x", r"reserved flags"),
    ("flags-fragment", C1 + P_BULK2, hdr(Kind.FRAGMENT, 1, 0, 1, flags=4), r"reserved flags"),
    ("flags-close", C1, hdr(Kind.CLOSE, 1, flags=0xFFFF), r"reserved flags"),
    ("bad-magic", b"", hdr(Kind.CONNECT, 1, magic=b"HTTP"), r"bad magic b'HTTP'"),
    ("bad-magic-later", C1, hdr(Kind.CONNECT, 2, magic=b"LCIQ"), r"bad magic"),
    ("bad-magic-http", b"", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", r"bad magic b'GET '"),
    ("version-0", b"", hdr(Kind.CONNECT, 1, version=0), r"unsupported protocol version 0"),
    ("version-1", b"", hdr(Kind.CONNECT, 1, version=1), r"unsupported protocol version 1"),
    ("version-3", b"", hdr(Kind.CONNECT, 1, version=3), r"unsupported protocol version 3"),
    ("version-255", C1, hdr(Kind.CONNECT, 1, version=255), r"unsupported protocol version 255"),
    ("kind-0", b"", hdr(0, 1), r"unknown parcel kind 0"),
    ("kind-7", b"", hdr(7, 1), r"unknown parcel kind 7"),
    ("placed-without-shared-memory", C1 + P_BULK2, raw_placed(1, 0, 1, 0, 0, 10),
     r"placed group on a connection without shared memory"),
    ("placed-unknown-parcel", C1, raw_placed(1, 0, 1, 0, 0, 10),
     r"placed group for unknown parcel 0 on vc 1"),
    ("placed-wrong-seq", C1 + P_BULK2, raw_placed(1, 3, 1, 0, 0, 10), r"placed group for unknown parcel 3"),
    ("flags-placed", C1 + P_BULK2, hdr(Kind.PLACED, 1, 0, 1, flags=1), r"reserved flags"),
    ("kind-255", C1, hdr(255, 1), r"unknown parcel kind 255"),
    ("hello-too-large", b"", hdr(Kind.HELLO, 0, 0, MAX_HELLO_BYTES + 1), r"malformed hello of 65537 bytes"),
    ("hello-with-vc", b"", hdr(Kind.HELLO, 1, 0, 0), r"malformed hello"),
    ("hello-with-seq", b"", hdr(Kind.HELLO, 0, 1, 0), r"malformed hello"),
    ("connect-with-count", b"", hdr(Kind.CONNECT, 1, 0, 1), r"malformed CONNECT for vc 1"),
    ("connect-with-seq", b"", hdr(Kind.CONNECT, 1, 1, 0), r"malformed CONNECT"),
    ("close-with-count", C1, hdr(Kind.CLOSE, 1, 0, 4), r"malformed CLOSE for vc 1"),
    ("close-with-seq", C1, hdr(Kind.CLOSE, 1, 9, 0), r"malformed CLOSE"),
    ("empty-bulk-frame", C1, raw_parcel(1, 0, [5, BULK | 0], b"abcde"), r"empty bulk frame 1"),
    ("empty-bulk-frame-only", C1, raw_parcel(1, 0, [BULK]), r"empty bulk frame 0"),
    # receive buffers: a group starts with a frame without SHARE, and is all eager or all bulk
    ("empty-shared-frame", C1, raw_parcel(1, 0, [3, SHARE], b"abc"), r"empty shared frame 1"),
    ("empty-shared-frame-only", C1, raw_parcel(1, 0, [SHARE]), r"empty shared frame 0"),
    ("empty-bulk-shared-frame", C1, raw_parcel(1, 0, [3, BULK | SHARE], b"abc"), r"empty bulk frame 1"),
    ("share-on-first-frame", C1, raw_parcel(1, 0, [SHARE | 3], b"abc"),
     r"frame 0 shares the buffer of no earlier frame"),
    ("share-on-first-frames", C1, raw_parcel(1, 0, [SHARE | 3, SHARE | 1], b"abcd"),
     r"frame 0 shares the buffer of no earlier frame"),
    ("share-on-first-bulk-frame", C1, raw_parcel(1, 0, [BULK | SHARE | 3]),
     r"frame 0 shares the buffer of no earlier frame"),
    ("share-on-first-nonempty-frame", C1, raw_parcel(1, 0, [0, 0, SHARE | 3], b"abc"),
     r"frame 2 shares the buffer of no earlier frame"),
    ("share-bulk-with-eager", C1, raw_parcel(1, 0, [3, BULK | SHARE | 4], b"abc"),
     r"frame 1 shares a buffer across eager and bulk frames"),
    ("share-eager-with-bulk", C1, raw_parcel(1, 0, [BULK | 4, SHARE | 3], b"abc"),
     r"frame 1 shares a buffer across eager and bulk frames"),
    ("share-across-empty-frame", C1, raw_parcel(1, 0, [3, 0, BULK | SHARE | 4], b"abc"),
     r"frame 2 shares a buffer across eager and bulk frames"),
    ("share-mixed-in-later-group", C1, raw_parcel(1, 0, [BULK | 4, 2, SHARE | 1, BULK | SHARE | 3], b"abc"),
     r"frame 3 shares a buffer across eager and bulk frames"),
    ("share-mixed-in-long-group", C1, raw_parcel(1, 0, [1, *[SHARE | 1] * 40, BULK | SHARE | 1], b"a" * 41),
     r"frame 41 shares a buffer across eager and bulk frames"),
    # fragments follow the bulk groups frame by frame, skipping empty frames
    ("fragment-group-member-first", C1 + P_GROUPS, raw_fragment(1, 0, 2, 0, b"a" * 4), r"does not continue"),
    ("fragment-next-group-early", C1 + P_GROUPS + raw_fragment(1, 0, 1, 0, b"a" * 10),
     raw_fragment(1, 0, 4, 0, b"a" * 5), r"fragment 4@0\+5 does not continue"),
    ("fragment-empty-frame", C1 + P_GROUPS + raw_fragment(1, 0, 1, 0, b"a" * 10)
     + raw_fragment(1, 0, 2, 0, b"b" * 4), raw_fragment(1, 0, 3, 0, b"a"),
     r"fragment 3@0\+1 does not continue"),
    ("fragment-empty-frame-empty", C1 + P_GROUPS + raw_fragment(1, 0, 1, 0, b"a" * 10)
     + raw_fragment(1, 0, 2, 0, b"b" * 4), raw_fragment(1, 0, 3, 0, b""), r"does not continue"),
    ("fragment-group-overrun", C1 + P_GROUPS, raw_fragment(1, 0, 1, 0, b"a" * 14), r"does not continue"),
    ("fragment-after-last-group", C1 + P_BULK2 + raw_fragment(1, 0, 1, 0, b"a" * 10)
     + raw_fragment(1, 0, 2, 0, b"b" * 3), raw_fragment(1, 0, 3, 0, b"c"), r"does not continue"),
]


@pytest.mark.parametrize("prefix, bad, match", [pytest.param(*r[1:], id=r[0]) for r in RULES])
def test_protocol_rule(prefix, bad, match):
    # the valid prefix decodes fine, whole or byte by byte
    ParcelDecoder().feed(prefix)
    # the violation raises, whole ...
    dec = ParcelDecoder()
    with pytest.raises(ProtocolError, match=match):
        dec.feed(prefix + bad)
    # ... and byte by byte, no later than the end of the offending unit
    dec = ParcelDecoder(buffer_size=16)
    dec.feed(prefix)
    with pytest.raises(ProtocolError, match=match):
        for i in range(len(bad)):
            dec.feed(bad[i : i + 1])
    # and through the BufferedProtocol interface with a small buffer
    dec = ParcelDecoder(buffer_size=24)
    with pytest.raises(ProtocolError, match=match):
        feed_buffered(dec, prefix + bad)


def test_protocol_error_is_a_value_error():
    assert issubclass(ProtocolError, ValueError)


def test_close_of_unknown_vc_then_connect():
    # CLOSE of a vc that is not open is tolerated (idempotent close)
    events = ParcelDecoder().feed(encode_close(4) + encode_connect(4) + encode_close(4))
    assert events == [Close(4), Connect(4), Close(4)]


def test_check_eof_mid_header_and_mid_hello():
    for partial in (MAGIC, encode_connect(1)[:23], encode_hello(b"abcdef")[:-1]):
        dec = ParcelDecoder()
        assert dec.feed(partial) == []
        assert not dec.idle
        with pytest.raises(ProtocolError, match="middle of a parcel"):
            dec.check_eof()


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
# The encoder
# ---------------------------------------------------------------------------


def units_of(p: OutgoingParcel) -> list[list]:
    units = []
    while not p.done:
        unit = p.next_unit()
        assert unit
        units.append(unit)
    return units


def unit_kinds(p: OutgoingParcel) -> list[tuple]:
    """The units of ``p``: ("parcel", sizes), ("fragment", index, offset, nbytes)
    or ("placed", index, handle, offset, nbytes)."""
    out = []
    for unit in units_of(p):
        first = b"".join(bytes(b) for b in unit)
        _, _, kind, _, vc, seq, count = HEADER.unpack_from(first)
        assert (vc, seq) == (p.vc, p.seq)
        if kind == Kind.PARCEL:
            out.append(("parcel", struct.unpack_from(f"<{count}Q", first, HEADER.size)))
        elif kind == Kind.FRAGMENT:
            offset, nbytes = FRAGMENT_EXT.unpack_from(first, HEADER.size)
            assert len(first) == FRAG_HEAD + nbytes
            out.append(("fragment", count, offset, nbytes))
        else:
            assert kind == Kind.PLACED and len(first) == HEADER.size + PLACED_EXT.size
            out.append(("placed", count, *PLACED_EXT.unpack_from(first, HEADER.size)))
    return out


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


def encode_parcel_with(frames, eager_threshold, fragment_size, vc=1, seq=0, pool=None, groups=None, **kwargs):
    """encode_parcel with the peer's limits as keywords, and bulk groups placed in ``pool``."""
    p = OutgoingParcel(vc, seq, frames, eager_threshold, fragment_size, **kwargs)
    if pool is not None:
        pool.place(p, groups)
    return b"".join(bytes(b) for unit in units_of(p) for b in unit)


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
# Receive buffers: the sender's rule
# ---------------------------------------------------------------------------


def arr(n: int, fill: int = 1) -> memoryview:
    """A frame as Dask makes it of a numpy array: a byte view of the array."""
    return memoryview(np.full(n, fill, dtype="u1"))


def shards(n: int, *cuts: int) -> list[memoryview]:
    """Consecutive views of one array, cut at ``cuts``."""
    view = arr(n)
    bounds = [0, *cuts, n]
    return [view[a:b] for a, b in pairwise(bounds)]


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
