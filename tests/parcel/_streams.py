"""What the tests of :mod:`dask_lcicomm.parcel` share (no tests of its own).

In the spirit of h11's test-suite, the codec is exercised with plain bytes only,
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

plus one explicit test per protocol rule. The tests follow the package's
modules: ``test_wire.py`` (control units, sequence numbers, the protocol's
rules), ``test_grouping.py`` (which frames share a receive buffer),
``test_writer.py`` (:class:`OutgoingParcel`, the sender's side of the limits
and of placed groups) and ``test_reader.py`` (the decoder). This module holds
their helpers: raw wire pieces, ways of feeding a decoder, a simulated sender
with its Hypothesis strategies, and a spy on the reader's allocations.
"""

from __future__ import annotations

import contextlib
import random
import signal
import struct
import threading
from collections import deque
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
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
    reader,
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


# groups: eager {0}; bulk {1, 2} of 14 bytes; frame 3 empty; bulk {4} of 5 bytes
P_GROUPS = raw_parcel(1, 0, [3, BULK | 10, BULK | SHARE | 4, 0, BULK | 5], b"abc")


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
# Helpers: the units of a parcel, and frames as Dask makes them
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


def encode_parcel_with(frames, eager_threshold, fragment_size, vc=1, seq=0, pool=None, groups=None, **kwargs):
    """encode_parcel with the peer's limits as keywords, and bulk groups placed in ``pool``."""
    p = OutgoingParcel(vc, seq, frames, eager_threshold, fragment_size, **kwargs)
    if pool is not None:
        pool.place(p, groups)
    return b"".join(bytes(b) for unit in units_of(p) for b in unit)


def arr(n: int, fill: int = 1) -> memoryview:
    """A frame as Dask makes it of a numpy array: a byte view of the array."""
    return memoryview(np.full(n, fill, dtype="u1"))


def shards(n: int, *cuts: int) -> list[memoryview]:
    """Consecutive views of one array, cut at ``cuts``."""
    view = arr(n)
    bounds = [0, *cuts, n]
    return [view[a:b] for a, b in pairwise(bounds)]


# ---------------------------------------------------------------------------
# Allocations
# ---------------------------------------------------------------------------

class AllocationSpy:
    """Stands in for the ``np`` and ``bytearray`` the reader module uses."""

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
        monkeypatch.setattr(reader, "np", spy)
        monkeypatch.setattr(reader, "bytearray", spy.bytearray, raising=False)
        yield spy
