"""The shared ring: bytes in order across wrap-around, credits, sleep and wake."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_lcicomm.parcel import ProtocolError
from dask_lcicomm.providers.shm_ring import RingReader, RingWriter
from dask_lcicomm.providers.shm_segment import ASLEEP, HEAD, PAGE, TAIL, WAITING, Layout, attach, create

LAYOUT = Layout(ring_bytes=PAGE, pool_bytes=0, blocks=1)


@pytest.fixture
def ring():
    """A writer and a reader on two mappings of one segment, as in two processes."""
    fd, receiver = create(LAYOUT)
    try:
        receiver.store(ASLEEP, 1)
        sender = attach(fd, LAYOUT)
    finally:
        os.close(fd)
    return RingWriter(sender, LAYOUT), RingReader(receiver, LAYOUT), sender


def drain(reader, limit=1 << 20):
    out = bytearray()
    buffer = memoryview(bytearray(997))
    while n := reader.read_into(buffer):
        out += buffer[:n]
        assert len(out) <= limit
    return bytes(out)


@settings(max_examples=80, deadline=None)
@given(chunks=st.lists(st.binary(min_size=0, max_size=3 * PAGE), min_size=1, max_size=30),
       take=st.integers(1, PAGE))
def test_bytes_arrive_in_order_across_wraparound(chunks, take):
    fd, region = create(LAYOUT)
    try:
        writer = RingWriter(attach(fd, LAYOUT), LAYOUT)
        reader = RingReader(region, LAYOUT)
    finally:
        os.close(fd)
    want = b"".join(chunks)
    got = bytearray()
    sent = 0
    buffer = memoryview(bytearray(take))
    for _ in range(10 * len(want) + 10):
        if sent < len(want):
            sent += writer.write(chunks, skip=sent)
        n = reader.read_into(buffer)
        got += buffer[:n]
        if len(got) == len(want):
            break
    assert bytes(got) == want


def test_a_full_ring_stops_the_writer_until_credits_return(ring):
    writer, reader, _ = ring
    data = bytes(range(256)) * (2 * PAGE // 256)
    assert writer.write([data]) == PAGE
    assert writer.full
    assert not writer.wait_for_space(), "no credit came back"
    assert writer.write([data], skip=PAGE) == 0
    assert len(drain(reader)) == PAGE
    assert reader.sender_waiting(), "the receiver must ring the waiting sender"
    assert not reader.sender_waiting(), "one doorbell per wait"
    assert writer.write([data], skip=PAGE) == PAGE


def test_space_that_came_back_while_arming_is_used_at_once(ring):
    writer, reader, sender = ring
    writer.write([bytes(PAGE)])
    drain(reader)
    assert writer.wait_for_space()
    assert sender.load(WAITING) == 0, "a writer that found space does not wait"


def test_doorbell_only_for_a_sleeping_receiver(ring):
    writer, reader, _ = ring
    writer.write([b"first"])
    assert writer.wake_receiver(), "the receiver starts asleep"
    reader.woken()
    writer.write([b"second"])
    assert not writer.wake_receiver(), "an awake receiver needs no doorbell"
    assert drain(reader) == b"firstsecond"
    assert reader.sleep()
    writer.write([b"third"])
    assert writer.wake_receiver()


def test_sleeping_finds_bytes_that_arrived_meanwhile(ring):
    writer, reader, _ = ring
    reader.woken()
    writer.write([b"late"])
    assert not reader.sleep(), "bytes were published before the flag was read"
    assert drain(reader) == b"late"


def test_a_sleeper_that_finds_bytes_is_awake_again(ring):
    """Asleep, then bytes published as it looks again: it clears its flag,
    so no doorbell comes, and it must say it is awake (or nobody reads on)."""
    writer, reader, _ = ring
    assert reader.sleep() and reader.asleep
    writer.write([b"raced"])  # published; the writer has not looked at the flag yet
    assert not reader.sleep()
    assert not writer.wake_receiver()
    assert not reader.asleep


@pytest.mark.parametrize("tail", [PAGE + 1, 2**64 - 1])
def test_a_tail_beyond_the_ring_is_a_protocol_error(ring, tail):
    _, reader, sender = ring
    sender.store(TAIL, tail)
    with pytest.raises(ProtocolError, match="overran the ring"):
        reader.read_into(memoryview(bytearray(10)))


@pytest.mark.parametrize("head", [PAGE + 5, 2**63])
def test_credits_never_handed_out_are_a_protocol_error(ring, head):
    writer, reader, sender = ring
    writer.write([bytes(PAGE)])
    drain(reader)
    sender.store(HEAD, head)
    with pytest.raises(ProtocolError, match="credits it never had"):
        writer.write([bytes(PAGE)])


def test_free_pages_are_whole_pages_the_reader_will_not_read():
    layout = Layout(ring_bytes=4 * PAGE, pool_bytes=0, blocks=1)
    fd, receiver = create(layout)
    try:
        writer = RingWriter(attach(fd, layout), layout)
    finally:
        os.close(fd)
    reader = RingReader(receiver, layout)
    start = layout.ring_offset
    assert writer.free_pages() == [(start, 4 * PAGE)]
    assert writer.free_pages() == []  # nothing written or read since
    writer.write([b"x" * (PAGE + 10)])
    # the page holding the tail has unread bytes before it
    assert writer.free_pages() == [(start + 2 * PAGE, 2 * PAGE)]
    assert len(drain(reader)) == PAGE + 10
    # read space comes free, wrapped around behind the tail
    assert writer.free_pages() == [(start + 2 * PAGE, 2 * PAGE), (start, PAGE)]
    writer.write([b"y" * (3 * PAGE - 10)])  # the tail at the end of the ring
    assert writer.free_pages() == [(start, PAGE)]
    writer.write([b"z" * (2 * PAGE)])
    assert writer.full and writer.free_pages() == []
