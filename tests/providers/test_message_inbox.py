"""A message device's receive side without a fabric: lengths checked before
anything is allocated, stream messages read in order and only behind the
prompt bulk messages sent before them, control messages by state, groups
announced for reading read and acknowledged."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from dask_lcicomm.parcel import Limits, ProtocolError
from dask_lcicomm.providers.message_inbox import Inbox
from dask_lcicomm.providers.message_rendezvous import MAX_ANNOUNCEMENT, read_message
from dask_lcicomm.providers.message_tags import BULK, CONTROL, END, PROMPT, READ, READABLE, STREAM, WELCOME


class _Receive:
    """The fabric's receive verb: completes when told, writing ``message``."""

    def __init__(self) -> None:
        self.requests: list[_Request] = []

    def __call__(self, message: bytes, buffer: np.ndarray) -> _Request:
        request = _Request(message, buffer)
        self.requests.append(request)
        return request


class _Request:
    def __init__(self, message: bytes, buffer: np.ndarray) -> None:
        self.message, self.buffer = message, buffer
        self.completed = False
        self.error: Exception | None = None

    def finish(self, error: Exception | None = None) -> None:
        self.buffer[:] = np.frombuffer(self.message[: self.buffer.nbytes], np.uint8)
        self.completed, self.error = True, error

    def check_error(self) -> None:
        if self.error is not None:
            raise self.error


class _Read:
    """The fabric's read verb: completes when told, writing what the peer
    registered (``memory``, by address)."""

    def __init__(self, memory: dict[int, bytes]) -> None:
        self.memory = memory
        self.requests: list[_Request] = []
        self.posted: list[tuple[int, int, int]] = []

    def __call__(self, buffer: np.ndarray, address: int, key: int) -> _Request:
        self.posted.append((address, key, buffer.nbytes))
        request = _Request(self.memory.get(address, b""), buffer)
        self.requests.append(request)
        return request


def _inbox(**limits: int) -> tuple[Inbox, _Receive]:
    receive = _Receive()
    return Inbox(Limits(**limits), receive), receive


def _reading_inbox(memory: dict[int, bytes], **limits: int) -> tuple[Inbox, _Receive, _Read]:
    receive, read = _Receive(), _Read(memory)
    return Inbox(Limits(**limits), receive, read), receive, read


def _readable(number: int, *buffers: tuple[int, int, int]) -> bytes:
    return struct.pack("<II", number, len(buffers)) + b"".join(struct.pack("<QQQ", *b) for b in buffers)


def _announce(inbox: Inbox, receive: _Receive, message: bytes) -> None:
    inbox.arrived(CONTROL, READABLE, len(message), message, welcomed=True)
    receive.requests[-1].finish()


def _reap(inbox: Inbox) -> tuple[list[bytes], list[str]]:
    welcomes: list[bytes] = []
    failures: list[str] = []
    inbox.reap(lambda buffer: welcomes.append(buffer.tobytes()), failures.append)
    return welcomes, failures


def _read(inbox: Inbox) -> bytes:
    """The stream bytes taken, taken out of the inbox."""
    data = b"".join(inbox.stream)
    inbox.stream.clear()
    return data


@pytest.mark.parametrize(
    ("kind", "nbytes", "limits"),
    [
        (STREAM, 101, {"max_message_bytes": 100}),
        (BULK, 101, {"max_message_bytes": 100}),
        (PROMPT, 101, {"max_message_bytes": 100}),
        (BULK, 1, {"max_frames": 0}),
    ],
)
def test_a_message_over_the_limits_allocates_nothing(kind, nbytes, limits):
    inbox, receive = _inbox(**limits)
    with pytest.raises(ProtocolError):
        inbox.arrived(kind, 0, nbytes, b"", welcomed=True)
    assert not receive.requests and not inbox.busy


def test_bulk_messages_waiting_count_together_against_the_limit():
    inbox, receive = _inbox(max_message_bytes=100)
    inbox.arrived(BULK, 0, 60, b"a" * 60, welcomed=True)
    with pytest.raises(ProtocolError, match="exceed"):
        inbox.arrived(BULK, 1, 60, b"b" * 60, welcomed=True)
    assert len(receive.requests) == 1


def test_a_bulk_number_arriving_twice_is_a_violation():
    inbox, _ = _inbox()
    inbox.arrived(BULK, 7, 1, b"x", welcomed=True)
    with pytest.raises(ProtocolError, match="twice"):
        inbox.arrived(BULK, 7, 1, b"x", welcomed=True)


@pytest.mark.parametrize(
    ("number", "welcomed", "allowed"),
    [
        (WELCOME, False, True), (END, False, False), (END, True, True), (WELCOME, True, False),
        (5, True, False), (READABLE, False, False), (READ, False, False),
    ],
)
def test_control_messages_follow_the_state(number, welcomed, allowed):
    inbox, receive = _inbox()
    if allowed:
        inbox.arrived(CONTROL, number, 4, b"\x01\x00\x00\x00", welcomed=welcomed)
        receive.requests[0].finish()
        welcomes, _ = _reap(inbox)
        assert (welcomes == [b"\x01\x00\x00\x00"]) == (number == WELCOME)
        assert inbox.ended == (number == END)
    else:
        with pytest.raises(ProtocolError, match="control"):
            inbox.arrived(CONTROL, number, 4, b"\x01\x00\x00\x00", welcomed=welcomed)


def test_stream_messages_are_read_in_order_and_behind_their_prompt_bulk_messages():
    inbox, receive = _inbox()
    inbox.arrived(STREAM, 0, 3, b"one", welcomed=True)
    inbox.arrived(PROMPT, 0, 4, b"bulk", welcomed=True)
    # Sent after one prompt bulk message: read only once it has arrived.
    inbox.arrived(STREAM, 1, 3, b"two", welcomed=True)
    first, bulk, second = receive.requests
    second.finish()
    _reap(inbox)
    assert _read(inbox) == b""
    first.finish()
    _reap(inbox)
    assert _read(inbox) == b"one"
    assert inbox.busy
    bulk.finish()
    _reap(inbox)
    assert _read(inbox) == b"two"
    assert not inbox.busy
    assert inbox.take_bulk(0, 0, 4).tobytes() == b"bulk"


def test_a_stream_message_waiting_for_prompt_messages_never_sent_is_a_violation():
    inbox, _ = _inbox()
    with pytest.raises(ProtocolError, match="prompt"):
        inbox.arrived(STREAM, 3, 1, b"x", welcomed=True)


@pytest.mark.parametrize(("finish", "offset", "nbytes"), [(False, 0, 4), (True, 1, 4), (True, 0, 5)])
def test_a_bulk_group_named_before_it_arrived_or_with_another_shape_is_a_violation(finish, offset, nbytes):
    inbox, receive = _inbox()
    inbox.arrived(BULK, 2, 4, b"bulk", welcomed=True)
    if finish:
        receive.requests[0].finish()
    with pytest.raises(ProtocolError):
        inbox.take_bulk(2, offset, nbytes)
    with pytest.raises(ProtocolError, match="not arrived"):
        inbox.take_bulk(3, 0, 4)


def test_a_failed_receive_is_reported_and_its_bytes_never_read():
    inbox, receive = _inbox()
    inbox.arrived(STREAM, 0, 3, b"bad", welcomed=True)
    receive.requests[0].finish(OSError("link down"))
    _, failures = _reap(inbox)
    assert failures == ["receive failed: OSError: link down"]
    assert _read(inbox) == b""


def test_closing_hands_back_the_receives_in_flight():
    inbox, receive = _inbox()
    inbox.arrived(STREAM, 0, 3, b"one", welcomed=True)
    inbox.arrived(BULK, 0, 4, b"bulk", welcomed=True)
    receive.requests[0].finish()
    _reap(inbox)
    assert [request for request, _ in inbox.close()] == [receive.requests[1]]
    assert not inbox.busy and _read(inbox) == b""


def test_an_announced_group_is_read_buffer_by_buffer_then_acknowledged_and_taken():
    inbox, receive, read = _reading_inbox({0x10: b"abc", 0x20: b"defgh"})
    _announce(inbox, receive, _readable(9, (0x10, 1, 3), (0x20, 2, 5)))
    assert not _reap(inbox)[1]
    assert read.posted == [(0x10, 1, 3), (0x20, 2, 5)]
    read.requests[0].finish()
    _reap(inbox)
    assert inbox.acknowledge == [] and inbox.busy
    read.requests[1].finish()
    _reap(inbox)
    assert inbox.acknowledge == [9] and not inbox.busy
    assert inbox.take_bulk(9, 0, 8).tobytes() == b"abcdefgh"


@pytest.mark.parametrize(
    ("message", "limits", "error"),
    [
        (_readable(1, (0, 1, 101)), {"max_message_bytes": 100}, "exceed"),
        (_readable(1, (0, 1, 60), (0, 2, 0)), {}, "empty"),
        (_readable(1, (0, 1, 4)), {"max_frames": 0}, "exceed"),
        (b"junk", {}, "announcement"),
    ],
    ids=["over the byte limit", "an empty buffer", "over the count", "malformed"],
)
def test_an_announcement_over_the_limits_or_malformed_reads_and_allocates_nothing(message, limits, error):
    inbox, receive, read = _reading_inbox({}, **limits)
    _announce(inbox, receive, message)
    with pytest.raises(ProtocolError, match=error):
        _reap(inbox)
    assert not read.posted


def test_announced_groups_count_with_bulk_messages_against_the_limit():
    inbox, receive, read = _reading_inbox({}, max_message_bytes=100)
    inbox.arrived(BULK, 0, 60, b"a" * 60, welcomed=True)
    _announce(inbox, receive, _readable(1, (0, 1, 60)))
    with pytest.raises(ProtocolError, match="exceed"):
        _reap(inbox)
    assert not read.posted


def test_an_announced_number_already_waiting_is_a_violation():
    inbox, receive, read = _reading_inbox({})
    inbox.arrived(BULK, 4, 1, b"x", welcomed=True)
    _announce(inbox, receive, _readable(4, (0, 1, 1)))
    with pytest.raises(ProtocolError, match="twice"):
        _reap(inbox)
    assert not read.posted


def test_an_announcement_is_refused_unread_without_rma_or_over_its_length():
    inbox, receive = _inbox()
    with pytest.raises(ProtocolError, match="without RMA"):
        inbox.arrived(CONTROL, READABLE, 32, b"", welcomed=True)
    inbox, receive, _ = _reading_inbox({})
    with pytest.raises(ProtocolError, match="rendezvous"):
        inbox.arrived(CONTROL, READABLE, MAX_ANNOUNCEMENT + 1, b"", welcomed=True)
    with pytest.raises(ProtocolError, match="rendezvous"):
        inbox.arrived(CONTROL, READ, 5, b"", welcomed=True)
    assert not receive.requests


def test_a_failed_read_is_reported_and_never_acknowledged():
    inbox, receive, read = _reading_inbox({0: b"abcd"})
    _announce(inbox, receive, _readable(3, (0, 1, 4)))
    _reap(inbox)
    read.requests[0].finish(PermissionError("no such memory"))
    _, failures = _reap(inbox)
    assert failures == ["read failed: PermissionError: no such memory"]
    assert inbox.acknowledge == []


def test_a_read_message_returns_a_loan():
    inbox, receive = _inbox()
    inbox.arrived(CONTROL, READ, 4, read_message(12), welcomed=True)
    receive.requests[0].finish()
    _reap(inbox)
    assert inbox.returned == [12]


def test_closing_hands_back_the_reads_in_flight():
    inbox, receive, _ = _reading_inbox({})
    _announce(inbox, receive, _readable(3, (0, 1, 4)))
    _reap(inbox)
    (request, buffer), = inbox.close()
    assert buffer.nbytes == 4 and not request.completed
    assert not inbox.busy


def test_bulk_groups_land_where_the_owner_allocates_and_the_stream_in_new_memory():
    given: list[np.ndarray] = []

    def allocate(nbytes: int) -> np.ndarray:
        given.append(np.zeros(nbytes, np.uint8))
        return given[-1]

    receive, read = _Receive(), _Read({0x10: b"read"})
    inbox = Inbox(Limits(), receive, read, allocate)
    inbox.arrived(BULK, 1, 4, b"bulk", welcomed=True)
    inbox.arrived(PROMPT, 2, 6, b"prompt", welcomed=True)
    inbox.arrived(STREAM, 1, 6, b"stream", welcomed=True)
    _announce(inbox, receive, _readable(3, (0x10, 1, 4)))
    for request in receive.requests[:3]:
        request.finish()
    _reap(inbox)  # starts the read
    read.requests[0].finish()
    _reap(inbox)
    assert [a.nbytes for a in given] == [4, 6, 4]
    for number, array in zip((1, 2, 3), given, strict=True):
        frames = inbox.take_bulk(number, 0, array.nbytes)
        assert np.frombuffer(frames, np.uint8).ctypes.data == array.ctypes.data
    assert _read(inbox) == b"stream"
