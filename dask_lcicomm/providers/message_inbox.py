"""What a message device receives from its peer, in order and within limits.

Each message is received into a buffer of its length, allocated only once
that length passed the limits; a bulk group where the device's owner says
(memory that earlier frames left free, :mod:`.frame_memory`). Stream and
control messages are taken in the order they were sent once complete; bulk
messages are set aside by number until their parcel names them, so later
stream messages are taken while a large one is in flight. A stream
message's tag counts the prompt bulk messages sent before it: it is read on
only once those have arrived. A group the peer announces for reading
(:mod:`.message_rendezvous`) is read into a buffer allocated once its size
passed the limits, and set aside as a bulk message is.

The inbox knows the fabric by two verbs, ``receive`` and ``read``, and
nothing of the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from dask_lcicomm.parcel import Limits, ProtocolError
from dask_lcicomm.providers.message_rendezvous import (
    MAX_ANNOUNCEMENT,
    READ_BYTES,
    Reads,
    parse_read,
    parse_readable,
)
from dask_lcicomm.providers.message_tags import (
    BULK,
    CONTROL,
    END,
    NUMBER_BITS,
    NUMBER_MASK,
    PROMPT,
    READ,
    READABLE,
    STREAM,
    WELCOME,
)
from dask_lcicomm.providers.message_verbs import DONE, Request

_HALF = 1 << (NUMBER_BITS - 1)

#: ``receive(message, buffer)``: the fabric's verb.
Receive = Callable[[Any, np.ndarray], Request]
#: ``read(buffer, address, key)``: the fabric's verb, from the peer; None
#: where the fabric has no RMA.
Read = Callable[[np.ndarray, int, int], Request] | None
#: ``allocate(nbytes)``: a writable uint8 array for a bulk group.
Allocate = Callable[[int], np.ndarray]


def _new_array(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, np.uint8)


def _succeeded(request: Request, what: str, failed: Callable[[str], None]) -> bool:
    """Whether ``request`` succeeded; if not, ``failed`` is told why."""
    try:
        request.check_error()
    except Exception as e:
        failed(f"{what} failed: {type(e).__name__}: {e}")
        return False
    return True


class Inbox:
    """The receive side of one message device (under the fabric's lock)."""

    def __init__(
        self, limits: Limits, receive: Receive, read: Read = None, allocate: Allocate | None = None
    ) -> None:
        self._receive_verb = receive
        self._read_verb = read
        #: Where bulk groups land (by default, and always for stream and
        #: control messages: new memory).
        self._allocate = allocate or _new_array
        self._max_bytes = limits.max_message_bytes
        self._max_count = limits.max_frames
        # Stream and control messages being received, in order, each with
        # the number of prompt bulk messages it waits for.
        self._receiving: deque[tuple[Request, np.ndarray, int, int, int]] = deque()
        self._prompt: deque[Request] = deque()
        self._prompt_seen = 0
        self._prompt_done = 0
        self._bulk: dict[int, tuple[Request, np.ndarray]] = {}
        self._bulk_bytes = 0
        # READABLE and READ messages being received; groups being read.
        self._notices: deque[tuple[Request, np.ndarray, int]] = deque()
        self._reading: list[tuple[int, Reads]] = []
        #: Groups read, to be acknowledged to the peer (READ), by number.
        self.acknowledge: list[int] = []
        #: Lent groups the peer has read, by number.
        self.returned: list[int] = []
        #: Stream messages received in order, not yet decoded.
        self.stream: deque[memoryview] = deque()
        #: Whether the peer's END has been taken.
        self.ended = False

    @property
    def busy(self) -> bool:
        """Whether the fabric is receiving for this inbox."""
        return bool(self._receiving or self._prompt or self._notices or self._reading)

    def arrived(
        self, kind: int, number: int, nbytes: int, message: Any, welcomed: bool, data: Any = None
    ) -> None:
        """Receive ``message``, or take its ``data`` where it came with it;
        or raise ``ProtocolError`` before allocating anything. Before the
        peer is ``welcomed`` the only control message it may send is its
        WELCOME, after it only its END."""
        if kind in (BULK, PROMPT):
            self._bulk_bytes += nbytes
            if self._bulk_bytes > self._max_bytes or len(self._bulk) >= self._max_count:
                raise ProtocolError(f"bulk messages waiting exceed {self._max_bytes} bytes")
            if number in self._bulk:
                raise ProtocolError(f"bulk message {number} arrived twice")
            request, buffer = self._receive(nbytes, message, data, self._allocate)
            self._bulk[number] = (request, buffer)
            if kind == PROMPT:
                self._prompt_seen += 1
                if request is DONE and not self._prompt:
                    self._prompt_done += 1
                else:
                    self._prompt.append(request)
            return
        if kind == CONTROL and number in (READABLE, READ) and welcomed:
            if number == READABLE and self._read_verb is None:
                raise ProtocolError("a group announced for reading over a fabric without RMA")
            if nbytes > (MAX_ANNOUNCEMENT if number == READABLE else READ_BYTES):
                raise ProtocolError(f"a {nbytes}-byte rendezvous message")
            self._notices.append((*self._receive(nbytes, message, data), number))
            return
        if nbytes > self._max_bytes:
            raise ProtocolError(f"a {nbytes}-byte stream message exceeds the limit")
        if kind == STREAM:
            behind = (self._prompt_seen - number) & NUMBER_MASK
            if behind >= _HALF:
                raise ProtocolError(f"a stream message waits for prompt bulk message {number}, "
                                    f"{self._prompt_seen} came")
            required = self._prompt_seen - behind
            if data is not None and not self._receiving and required <= self._prompt_done:
                # Whole and next in order: straight to the stream.
                if nbytes:
                    self.stream.append(memoryview(data))
                return
        elif number == (END if welcomed else WELCOME):
            required = 0
        else:
            raise ProtocolError(f"an unexpected control message {number}")
        self._receiving.append((*self._receive(nbytes, message, data), kind, number, required))

    def _receive(
        self, nbytes: int, message: Any, data: Any, allocate: Allocate = _new_array
    ) -> tuple[Request, np.ndarray]:
        if data is not None:
            return DONE, np.frombuffer(data, np.uint8)
        buffer = allocate(nbytes)
        return self._receive_verb(message, buffer), buffer

    def reap(self, welcome: Callable[[np.ndarray], None], failed: Callable[[str], None]) -> bool:
        """Take the messages complete in order: stream bytes join
        :attr:`stream`, a WELCOME goes to ``welcome``, a receive or read that
        failed to ``failed``; start the reads announced, and list those done
        (:attr:`acknowledge`) and the loans returned (:attr:`returned`).
        True when any was taken."""
        reaped = self._reap_rendezvous(failed)
        prompt = self._prompt
        while prompt and prompt[0].completed:
            prompt.popleft()
            self._prompt_done += 1
        receiving = self._receiving
        while receiving and receiving[0][0].completed and receiving[0][4] <= self._prompt_done:
            request, buffer, kind, number, _ = receiving.popleft()
            reaped = True
            if not _succeeded(request, "receive", failed):
                continue
            if kind == STREAM:
                if buffer.nbytes:
                    self.stream.append(buffer.data)
            elif number == WELCOME:
                welcome(buffer)
            else:
                self.ended = True
        return reaped

    def _reap_rendezvous(self, failed: Callable[[str], None]) -> bool:
        reaped = False
        notices = self._notices
        while notices and notices[0][0].completed:
            request, buffer, number = notices.popleft()
            reaped = True
            if not _succeeded(request, "receive", failed):
                continue
            if number == READ:
                self.returned.append(parse_read(buffer))
            else:
                self._start_reads(buffer)
        if self._reading:
            reading = []
            for number, reads in self._reading:
                if not reads.completed:
                    reading.append((number, reads))
                    continue
                reaped = True
                if _succeeded(reads, "read", failed):
                    self.acknowledge.append(number)
            self._reading = reading
        return reaped

    def _start_reads(self, announcement: np.ndarray) -> None:
        """Read the group ``announcement`` names, into a buffer allocated
        only once its size passed the limits."""
        assert self._read_verb is not None
        number, buffers = parse_readable(announcement)
        total = sum(length for _, _, length in buffers)
        if any(length == 0 for _, _, length in buffers):
            raise ProtocolError(f"bulk message {number} announces an empty buffer")
        if self._bulk_bytes + total > self._max_bytes or len(self._bulk) >= self._max_count:
            raise ProtocolError(f"bulk messages waiting exceed {self._max_bytes} bytes")
        if number in self._bulk:
            raise ProtocolError(f"bulk message {number} arrived twice")
        self._bulk_bytes += total
        buffer = self._allocate(total)
        requests = []
        offset = 0
        for address, key, length in buffers:
            requests.append(self._read_verb(buffer[offset : offset + length], address, key))
            offset += length
        reads = Reads(requests)
        self._bulk[number] = (reads, buffer)
        self._reading.append((number, reads))

    def take_bulk(self, number: int, offset: int, nbytes: int) -> memoryview:
        """The bulk group the peer sent as message ``number``: the frames.
        The peer names it only once it has arrived whole."""
        entry = self._bulk.pop(number, None)
        if entry is None or offset or not entry[0].completed:
            raise ProtocolError(f"bulk message {number} (offset {offset}) has not arrived")
        request, buffer = entry
        request.check_error()
        self._bulk_bytes -= buffer.nbytes
        if buffer.nbytes != nbytes:
            raise ProtocolError(f"bulk message {number} has {buffer.nbytes} bytes, not {nbytes}")
        return buffer.data

    def close(self) -> list[tuple[Request, np.ndarray]]:
        """Empty the inbox; the receives the fabric may still write into."""
        receives = [(entry[0], entry[1]) for entry in self._receiving]
        receives += [(request, buffer) for request, buffer, _ in self._notices]
        receives += self._bulk.values()
        self._receiving.clear()
        self._notices.clear()
        self._reading.clear()
        self.acknowledge.clear()
        self.returned.clear()
        self._prompt.clear()
        self._bulk.clear()
        self.stream.clear()
        return receives
