"""What a message device receives from its peer, in order and within limits.

Each message is received into a buffer of its length, allocated only once
that length passed the limits. Stream and control messages are taken in the
order they were sent once complete; bulk messages are set aside by number
until their parcel names them, so later stream messages are taken while a
large one is in flight. A stream message's tag counts the prompt bulk
messages sent before it: it is read on only once those have arrived.

The inbox knows the fabric by one verb, ``receive``, and nothing of the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from dask_lcicomm.parcel import Limits, ProtocolError
from dask_lcicomm.providers.message_fabric import Request
from dask_lcicomm.providers.message_tags import BULK, END, NUMBER_BITS, NUMBER_MASK, PROMPT, STREAM, WELCOME

_HALF = 1 << (NUMBER_BITS - 1)

#: ``receive(message, buffer)``: the fabric's verb.
Receive = Callable[[Any, np.ndarray], Request]


class Inbox:
    """The receive side of one message device (under the fabric's lock)."""

    def __init__(self, limits: Limits, receive: Receive) -> None:
        self._receive_verb = receive
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
        #: Stream bytes received, not yet read.
        self.stream: deque[memoryview] = deque()
        #: Whether the peer's END has been taken.
        self.ended = False

    @property
    def busy(self) -> bool:
        """Whether the fabric is receiving for this inbox."""
        return bool(self._receiving or self._prompt)

    def arrived(self, kind: int, number: int, nbytes: int, message: Any, welcomed: bool) -> None:
        """Receive ``message``, or raise ``ProtocolError`` before allocating
        anything. Before the peer is ``welcomed`` the only control message
        it may send is its WELCOME, after it only its END."""
        if kind in (BULK, PROMPT):
            self._bulk_bytes += nbytes
            if self._bulk_bytes > self._max_bytes or len(self._bulk) >= self._max_count:
                raise ProtocolError(f"bulk messages waiting exceed {self._max_bytes} bytes")
            if number in self._bulk:
                raise ProtocolError(f"bulk message {number} arrived twice")
            request, buffer = self._receive(nbytes, message)
            self._bulk[number] = (request, buffer)
            if kind == PROMPT:
                self._prompt.append(request)
                self._prompt_seen += 1
            return
        if nbytes > self._max_bytes:
            raise ProtocolError(f"a {nbytes}-byte stream message exceeds the limit")
        if kind == STREAM:
            behind = (self._prompt_seen - number) & NUMBER_MASK
            if behind >= _HALF:
                raise ProtocolError(f"a stream message waits for prompt bulk message {number}, "
                                    f"{self._prompt_seen} came")
            required = self._prompt_seen - behind
        elif number == (END if welcomed else WELCOME):
            required = 0
        else:
            raise ProtocolError(f"an unexpected control message {number}")
        self._receiving.append((*self._receive(nbytes, message), kind, number, required))

    def _receive(self, nbytes: int, message: Any) -> tuple[Request, np.ndarray]:
        buffer = np.empty(nbytes, np.uint8)
        return self._receive_verb(message, buffer), buffer

    def reap(self, welcome: Callable[[np.ndarray], None], failed: Callable[[str], None]) -> bool:
        """Take the messages complete in order: stream bytes join
        :attr:`stream`, a WELCOME goes to ``welcome``, a receive that failed
        to ``failed``. True when any was taken."""
        prompt = self._prompt
        while prompt and prompt[0].completed:
            prompt.popleft()
            self._prompt_done += 1
        receiving = self._receiving
        reaped = False
        while receiving and receiving[0][0].completed and receiving[0][4] <= self._prompt_done:
            request, buffer, kind, number, _ = receiving.popleft()
            reaped = True
            try:
                request.check_error()
            except Exception as e:
                failed(f"receive failed: {type(e).__name__}: {e}")
                continue
            if kind == STREAM:
                if buffer.nbytes:
                    self.stream.append(buffer.data)
            elif number == WELCOME:
                welcome(buffer)
            else:
                self.ended = True
        return reaped

    def read_into(self, buffer: memoryview) -> int:
        """Copy stream bytes into ``buffer``; how many."""
        stream = self.stream
        n = 0
        while stream and n < buffer.nbytes:
            chunk = stream[0]
            take = min(chunk.nbytes, buffer.nbytes - n)
            buffer[n : n + take] = chunk[:take]
            n += take
            if take == chunk.nbytes:
                stream.popleft()
            else:
                stream[0] = chunk[take:]
        return n

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
        receives = [entry[:2] for entry in self._receiving] + list(self._bulk.values())
        self._receiving.clear()
        self._prompt.clear()
        self._bulk.clear()
        self.stream.clear()
        return receives
