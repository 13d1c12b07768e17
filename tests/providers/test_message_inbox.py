"""A message device's receive side without a fabric: lengths checked before
anything is allocated, stream messages read in order and only behind the
prompt bulk messages sent before them, control messages by state."""

from __future__ import annotations

import numpy as np
import pytest

from dask_lcicomm.parcel import Limits, ProtocolError
from dask_lcicomm.providers.message_inbox import Inbox
from dask_lcicomm.providers.message_tags import BULK, CONTROL, END, PROMPT, STREAM, WELCOME


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


def _inbox(**limits: int) -> tuple[Inbox, _Receive]:
    receive = _Receive()
    return Inbox(Limits(**limits), receive), receive


def _reap(inbox: Inbox) -> tuple[list[bytes], list[str]]:
    welcomes: list[bytes] = []
    failures: list[str] = []
    inbox.reap(lambda buffer: welcomes.append(buffer.tobytes()), failures.append)
    return welcomes, failures


def _read(inbox: Inbox, size: int = 100) -> bytes:
    buffer = bytearray(size)
    return bytes(buffer[: inbox.read_into(memoryview(buffer))])


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
        (5, True, False),
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
    assert _read(inbox, 2) == b"tw" and _read(inbox) == b"o"
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
