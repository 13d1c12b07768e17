"""A message device: one peer of a process's endpoint on a message fabric
(:mod:`.message_fabric`), the same for every such fabric.

The parcel stream (heads, eager frames, the other control units) goes as
*stream* messages, in order; each bulk group of a parcel as a *bulk*
message of its own, written nowhere first: the fabric sends a large one by
its rendezvous protocol (an RDMA read by the receiver on a real fabric), and
the buffer it lands in becomes the frames handed to Dask. The parcel names
its groups by number (a PLACED record, see :mod:`dask_lcicomm.parcel`);
:mod:`.message_tags` has the kinds.

A parcel whose bulk groups are larger than a send batch joins the stream
only once they have reached the peer: a writer's send completes when its
frames are there, and the small parcels of other virtual connections flow
past a large one meanwhile. A parcel with smaller groups is sent at once,
behind them (*prompt* bulk messages): a stream message's tag counts the
prompt ones sent before it, and the receiver reads the stream on only once
they have arrived, which costs later parcels little and spares this one a
round trip.

What it sends goes to the fabric in order through the device's
:class:`~.message_outbox.Outbox`; what arrives is taken in order, within
the limits, by its :class:`~.message_inbox.Inbox`.

A peer that dies is reported by the fabric (:meth:`MessageDevice.peer_failed`).
A fabric need not tell a peer that a handle closed while its process lives:
an END behind everything sent says so, also when a device is closed abruptly.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from dask_lcicomm.parcel import OutgoingParcel, ProtocolError
from dask_lcicomm.providers.base import DeviceClosed, DeviceOptions, SendDone
from dask_lcicomm.providers.held_parcels import Held, HeldParcels
from dask_lcicomm.providers.message_fabric import MessageFabric
from dask_lcicomm.providers.message_inbox import Inbox
from dask_lcicomm.providers.message_outbox import Outbox
from dask_lcicomm.providers.message_rendezvous import Loans, read_message
from dask_lcicomm.providers.message_routes import RoutedDevice
from dask_lcicomm.providers.message_tags import (
    BULK,
    CONTROL,
    NUMBER_MASK,
    PROMPT,
    READ,
    READABLE,
    STREAM,
    WELCOME,
    peer_route,
    welcome_message,
)
from dask_lcicomm.providers.message_verbs import Request
from dask_lcicomm.providers.send_queue import Unit

logger = logging.getLogger(__name__)

#: Stream bytes in flight, in send batches, before sends wait for the fabric.
_INFLIGHT_BATCHES = 8
#: Messages whose buffers hold this much on average go as the list of them
#: where the fabric gathers; many small buffers cost less joined.
_GATHERED_BYTES = 8192


class MessageDevice(RoutedDevice):
    """A device over one peer handle of the shared fabric; made under its
    lock. A provider names it (:attr:`provider`) and adds nothing else."""

    watch_writable = False

    def __init__(
        self,
        fabric: MessageFabric,
        peer: Any,
        peer_route: int,
        options: DeviceOptions,
        local_address: str,
        peer_address: str,
    ) -> None:
        frames = options.frames
        self._inbox = Inbox(options.limits, fabric.receive, self._read if fabric.rma else None,
                            frames.array if frames else None)
        self._loans = Loans(fabric.rma)
        super().__init__(options, local_address, peer_address, placement=self._inbox.take_bulk)
        self.source = self._fabric = fabric
        self.provider = fabric.provider
        self._batch_bytes = options.batch_bytes
        # Stream bytes the fabric may hold before writers wait: back-pressure when
        # the peer takes them more slowly than they are written.
        self._max_inflight = _INFLIGHT_BATCHES * options.batch_bytes
        self._outbox = Outbox(fabric, peer, self, self._note_failure, self._unreachable)
        self._outbox.route = peer_route
        #: Told the peer's WELCOME (None) or why none will come.
        self.on_welcome: Callable[[str | None], None] | None = None
        # Lock order: held, then the device lock, then the fabric's.
        self._held_lock = threading.Lock()
        self._failed: str | None = None
        self._violation: str | None = None
        # Send side: parcels waiting for their bulk messages.
        self._held = HeldParcels()
        self._finish_when_sent = False
        self._bulk_sent = 0
        self._prompt_sent = 0
        self._prompt_bytes = options.batch_bytes
        self.route = fabric.add(self)
        fabric.watch(peer, self)

    def fileno(self) -> int:
        return self._fabric.fileno()

    @property
    def peer(self) -> Any:
        """The fabric's handle of the peer; None once closed."""
        return self._outbox.peer

    @property
    def input_pending(self) -> bool:
        """Stream left, or an end that no event will announce again."""
        if self._lost is not None:
            return False
        inbox = self._inbox
        return bool(inbox.stream) or inbox.ended or self._failed is not None or self._violation is not None

    # -- sending ---------------------------------------------------------

    def put(self, vc: int, unit: Unit, token: Any = None) -> bool:
        """Bulk groups leave at once, out of band. A parcel with large ones
        joins the stream once they have arrived, so that it never holds up
        the small parcels of other virtual connections; one with small ones
        follows them at once, as prompt bulk messages."""
        parcel = unit if type(unit) is OutgoingParcel and unit.has_bulk else None
        with self._held_lock:
            if self._lost is not None or self._finishing:
                raise DeviceClosed(self._lost or "device is closing")
            if not self._held.holds(vc) and (parcel is None or self._fits_prompt(parcel)):
                if parcel is not None:
                    self._send_bulk(parcel, None)
                return super().put(vc, unit, token)
            held = Held(unit, token)
            if parcel is not None:
                self._send_bulk(parcel, held)
            self._held.append(vc, held)
            # Small bulk messages may have gone at once.
            return self._release_ready()

    def post(self, vc: int, unit: Unit, token: Any = None) -> None:
        # No bulk groups, and no parcel held (on any virtual connection: the
        # one writer of ours that could have put one came first): one stream
        # message at once, or LCI's post, queued and tried under one hold of
        # the lock.
        if not self._held and not (type(unit) is OutgoingParcel and unit.has_bulk):
            if unit.nbytes > self._batch_bytes or not self._post_at_once(unit, token):
                super().post(vc, unit, token)
            return
        self.put(vc, unit, token)
        self.flush()

    def _post_at_once(self, unit: Unit, token: Any) -> bool:
        """Post ``unit`` (no larger than a send batch) as one stream message
        where nothing is queued before it, and say so: what a put and a
        flush would do, without the send queue. False, touching nothing,
        where that is not so."""
        with self._lock:
            if self._writing or not self._queue.idle or self._finishing:
                return False
            if self._lost is not None or self._failed is not None:
                return False
            with self._fabric.lock:
                if self._outbox.unposted or self._outbox.inflight_bytes >= self._max_inflight:
                    return False
                nbytes = unit.nbytes
                self._outbox.post(self._message(unit.next_unit(), nbytes), STREAM,
                                  self._prompt_sent, nbytes)
        if token is not None:
            self.completion.push((self, SendDone(token)))
        return True

    def _message(self, buffers: list[Any], nbytes: int) -> Any:
        """``buffers`` (``nbytes`` in all) as one message: where they lie, if
        one bytes object or a large buffer, or large and the fabric gathers;
        else one bytes object (what the tcp connection writes fastest when
        small). Read after the write is done, as ``tcp://`` reads them: Dask
        does not change a frame it wrote."""
        if len(buffers) == 1 and (type(buffers[0]) is bytes or nbytes >= _GATHERED_BYTES):
            return buffers[0]
        if nbytes >= _GATHERED_BYTES * len(buffers) and self._fabric.gathers:
            return buffers
        return b"".join(buffers)

    def hello(self, listener: int) -> None:
        """Ask the peer's listener numbered ``listener`` for its end (under
        the fabric's lock)."""
        message = self._fabric.hello(listener, self.route, self.local_address, self.peer_address)
        self._outbox.post(message, CONTROL, 0)

    def _fits_prompt(self, parcel: OutgoingParcel) -> bool:
        return all(
            sum(v.nbytes for v in views) <= self._prompt_bytes and not self._loans.lends(views)
            for views in parcel.bulk_groups
        )

    def _read(self, buffer: np.ndarray, address: int, key: int) -> Request:
        assert self._fabric.rma is not None
        return self._fabric.rma.read(self.peer, buffer, address, key)

    def _send_bulk(self, parcel: OutgoingParcel, held: Held | None) -> None:
        """Send each bulk group of ``parcel`` as a message of its own; the
        parcel then carries only their numbers. Without ``held`` they are
        prompt: the parcel follows at once."""
        with self._fabric.lock:
            for group, views in enumerate(parcel.bulk_groups):
                number = self._bulk_sent & NUMBER_MASK
                parcel.place(group, number, 0)
                self._bulk_sent += 1
                readable = None if held is None else self._loans.lend(number, views, held)
                if readable is not None:
                    self._outbox.post(readable, CONTROL, READABLE)
                    continue
                # Several buffers (a large frame's shards) are one message.
                message = self._message(views, sum(view.nbytes for view in views))
                if held is None:
                    self._prompt_sent += 1
                else:
                    held.bulk_out += 1
                self._outbox.post(message, BULK if held else PROMPT, number, 0, held)

    def welcome(self) -> None:
        """Answer the peer's hello with our route (under the fabric's lock)."""
        self._outbox.post(welcome_message(self.route), CONTROL, WELCOME)

    @property
    def unposted(self) -> bool:
        """Whether the fabric answered "retry" to a message not yet posted."""
        return self._outbox.unposted

    def _release_held(self) -> None:
        """Send the parcels whose bulk messages have all arrived; end the
        output if that was all it waited for."""
        if not self._held:
            return
        with self._held_lock:
            self._release_ready()
            finish = not self._held and self._finish_when_sent
        if finish:
            super().finish()
        else:
            self.flush()

    def _release_ready(self) -> bool:
        """Queue the parcels at the head of each virtual connection's line
        whose bulk messages have all arrived (under the held lock); True
        when the caller should flush."""
        flush = False
        for vc, held in self._held.ready():
            flush = super().put(vc, held.unit, held.token) or flush
        return flush

    @property
    def queued_bytes(self) -> int:
        return self._queue.queued_bytes + self._held.nbytes

    def flush(self) -> bool:
        return super().flush() and not self._held

    def finish(self) -> bool:
        """As for any device, but done only once the fabric has finished every
        send: closing the peer handle earlier would abort the transfers under way."""
        with self._held_lock:
            if self._held:
                self._finish_when_sent = True
                return False
        return super().finish() and not self._outbox.ending

    def _lose(self, reason: str) -> list[Any] | None:
        tokens = super()._lose(reason)
        if tokens is not None:
            tokens.extend(self._held.drop())
        return tokens

    def _transmit(self, buffers: deque[Any]) -> int:
        """Post ``buffers`` as stream messages of up to a send batch each,
        while the bytes in flight allow: a fabric that finishes a send at
        once (a socket that took it) leaves nothing to come back for."""
        if self._failed is not None:
            raise ConnectionResetError(self._failed)
        n = 0
        batch: list[Any] = []
        batch_bytes = 0
        outbox = self._outbox
        with self._fabric.lock:
            outbox.reap()
            last = len(buffers) - 1
            for i, buffer in enumerate(buffers):
                if outbox.inflight_bytes >= self._max_inflight:
                    break
                batch.append(buffer)
                batch_bytes += memoryview(buffer).nbytes
                if batch_bytes >= self._batch_bytes or i == last:
                    outbox.post(self._message(batch, batch_bytes), STREAM, self._prompt_sent, batch_bytes)
                    n += batch_bytes
                    batch, batch_bytes = [], 0
        if not n:
            raise BlockingIOError
        return n

    # -- receiving (under the fabric's lock) --------------------------------

    def arrived(self, kind: int, number: int, nbytes: int, message: Any, data: Any) -> bool:
        if self._violation is not None:
            raise ProtocolError(self._violation)
        inbox = self._inbox
        inbox.arrived(kind, number, nbytes, message, welcomed=bool(self._outbox.route), data=data)
        return inbox.busy

    def reap(self) -> bool:
        inbox = self._inbox
        reaped = self._outbox.reap()
        reaped = inbox.reap(self._welcomed, self._note_failure) or reaped
        for number in inbox.acknowledge:
            self._outbox.post(read_message(number), CONTROL, READ)
        inbox.acknowledge.clear()
        for number in inbox.returned:
            self._loans.returned(number)
        inbox.returned.clear()
        return reaped or bool(inbox.stream)

    def _note_failure(self, reason: str) -> None:
        self._failed = self._failed or reason

    @property
    def busy(self) -> bool:
        """Whether the fabric has work of this device under way."""
        return self._outbox.busy or self._inbox.busy

    def _welcomed(self, message: np.ndarray) -> None:
        try:
            self._outbox.route = peer_route(message)
        except ProtocolError as e:
            self.violated(str(e))
            return
        if self.on_welcome is not None:
            self.on_welcome(None)

    def violated(self, reason: str) -> None:
        self._violation = self._violation or reason
        if self.on_welcome is not None:
            self.on_welcome(f"protocol error: {reason}")

    def peer_failed(self) -> None:
        self._unreachable(f"the {self.provider} fabric lost the peer")

    def _unreachable(self, reason: str) -> None:
        self._failed = self._failed or reason
        if self.on_welcome is not None and not self._outbox.route:
            self.on_welcome(self._failed)

    # -- progress (on the engine's thread) ---------------------------------

    def on_readable(self) -> bool:
        if self.released:
            return False
        if self._violation is not None:
            return self._fail(f"protocol error: {self._violation}", logging.WARNING, violation=True)
        self._release_held()
        self.resume_blocked_sends()
        decoder, push, inbox = self._decoder, self.completion.push, self._inbox
        try:
            while inbox.stream:
                for event in decoder.feed(inbox.stream.popleft()):
                    push((self, event))
            if inbox.ended:
                decoder.check_eof()
                return self._fail("closed by peer", logging.DEBUG)
        except ProtocolError as e:
            return self._fail(f"protocol error: {e}", logging.WARNING, violation=True)
        if self._failed is not None:
            return self._fail(self._failed, logging.INFO)
        return True

    # -- ending ----------------------------------------------------------

    def _shutdown(self, both: bool) -> None:
        """End the output: an END behind every send in flight. (``both``
        follows a failed send, already reported: release closes the peer handle.)"""
        if both:
            return
        with self._fabric.lock:
            self._outbox.end()

    def _close_transport(self) -> None:
        self._decoder.placement = None
        fabric = self._fabric
        with fabric.lock:
            # The peer's fabric need not see a handle close while this
            # process lives: the END tells it, behind what is in flight.
            peer = self.peer
            dropped, sends = self._outbox.close(end=bool(self._outbox.route) and self._failed is None)
            if dropped:
                logger.info("%s device to %s closed with %d messages the fabric never took",
                            self.provider, self.peer_address, dropped)
            self._loans.clear()
            fabric.remove(self, self._inbox.close())
            fabric.retire(peer, sends)
        fabric.settle()
