"""What a message device sends its peer, handed to the fabric in order.

A message goes to the fabric at once unless messages it answered "retry"
to wait before it (:mod:`.retry_line`): a stream must arrive in order. The
stream bytes in flight are counted, for the device's back-pressure; sends
the fabric finished are taken back oldest first (:mod:`.sends_in_flight`),
and a failed one is reported. A peer the fabric takes nothing for, for its
:attr:`~.MessageFabric.retry_limit`, is unreachable; once it took a send,
"retry" may be a busy peer's back-pressure, and only Dask's TCP timeout
(:func:`~.base.dead_after`) without one makes it lost. The output ends with
an END behind every send.

The outbox knows the fabric by its send verb and the device only as the
fabric's opaque owner of the sends; what goes wrong it reports through
callbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dask_lcicomm.providers.base import dead_after
from dask_lcicomm.providers.held_parcels import Held
from dask_lcicomm.providers.message_fabric import MessageFabric
from dask_lcicomm.providers.message_routes import RoutedDevice
from dask_lcicomm.providers.message_tags import CONTROL, END, tag
from dask_lcicomm.providers.message_verbs import DONE, Request
from dask_lcicomm.providers.retry_line import RetryLine
from dask_lcicomm.providers.sends_in_flight import SendsInFlight


class Outbox:
    """The send side of one message device, to the peer handle ``peer``
    (under the fabric's lock). ``failed(reason)`` hears of a send that
    failed, ``unreachable(reason)`` of a peer the fabric took nothing for
    (once)."""

    def __init__(
        self,
        fabric: MessageFabric,
        peer: Any,
        owner: RoutedDevice,
        failed: Callable[[str], None],
        unreachable: Callable[[str], None],
    ) -> None:
        self._fabric = fabric
        self.peer = peer
        self._owner = owner
        self._failed = failed
        self._unreachable = unreachable
        #: Where the peer receives: 0 until its WELCOME says.
        self.route = 0
        #: Stream bytes posted and not yet finished by the fabric.
        self.inflight_bytes = 0
        #: Whether the END is posted.
        self.ended = False
        self._inflight = SendsInFlight()
        self._unposted = RetryLine()
        self._reached = False
        self._gave_up = False
        self._end_after_sends = False
        self._dead_after = dead_after()

    @property
    def busy(self) -> bool:
        """Whether the fabric has sends of ours to finish or take."""
        return bool(self._inflight or self._unposted)

    @property
    def unposted(self) -> bool:
        """Whether the fabric answered "retry" to a message not yet posted."""
        return bool(self._unposted)

    @property
    def ending(self) -> bool:
        """Whether the END waits for the sends in flight."""
        return self._end_after_sends

    def post(self, message: Any, kind: int, number: int, nbytes: int = 0, held: Held | None = None) -> None:
        """Hand ``message`` to the fabric, behind the messages it answered
        "retry" to; ``nbytes`` of it count as stream bytes in flight, and
        ``held`` is the held parcel it is a bulk message of."""
        self.inflight_bytes += nbytes
        value = tag(self.route, kind, number)
        if not self._unposted:
            request = self._fabric.send(self.peer, value, message)
            if request is DONE:
                # The common answer, settled here: nothing to take back.
                self._reached = True
                self.inflight_bytes -= nbytes
                if held is not None:
                    held.bulk_out -= 1
                return
            if request is not None:
                self._posted(request, message, nbytes, held)
                return
        self._unposted.append((message, value, nbytes, held))
        self._fabric.retry_later(self._owner)

    def _posted(self, request: Request, message: Any, nbytes: int, held: Held | None) -> None:
        self._reached = True
        if request.completed:
            self.inflight_bytes -= nbytes
            self._completed(request, held)
        else:
            self._inflight.add((request, nbytes, message, held))
            self._fabric.busy(self._owner)

    def _completed(self, request: Request, held: Held | None) -> None:
        try:
            request.check_error()
        except Exception as e:
            self._failed(f"send failed: {type(e).__name__}: {e}")
            return
        if held is not None:
            held.bulk_out -= 1

    def _send_to_peer(self, value: int, message: Any) -> Request | None:
        return self._fabric.send(self.peer, value, message)

    def post_unposted(self) -> bool:
        """Hand the fabric what it answered "retry" to, in order; True when
        any went, or when the peer turned out unreachable."""
        posted = False
        for request, (message, _, nbytes, held) in self._unposted.post(self._send_to_peer):
            self._posted(request, message, nbytes, held)
            posted = True
        waited = self._unposted.waited if self._unposted else 0.0
        limit = self._dead_after if self._reached else self._fabric.retry_limit
        if waited > limit and not self._gave_up:
            self._gave_up = True
            why = "it is gone" if self._reached else "it cannot reach it"
            self._unreachable(f"the {self._fabric.provider} fabric took no send to the peer "
                              f"for {waited:.1f} s: {why}")
            return True
        return posted

    def reap(self) -> bool:
        """Post what waits, take back the finished sends, and post the END
        once they were all it waited for; True when any of that happened."""
        reaped = self.post_unposted() if self._unposted else False
        for request, nbytes, _, held in self._inflight.finished():
            self.inflight_bytes -= nbytes
            self._completed(request, held)
            reaped = True
        if self._end_after_sends and not self._inflight and not self._unposted:
            self._end_after_sends = False
            self._post_end()
        return reaped

    def end(self) -> None:
        """End the output: an END behind every send in flight."""
        if self.busy:
            self._end_after_sends = True
        else:
            self._post_end()

    def _post_end(self) -> None:
        self.ended = True
        self.post(b"", CONTROL, END)

    def close(self, end: bool) -> tuple[int, list[tuple[Request, Any]]]:
        """Post the END (if ``end`` and not posted yet) and what waits, as
        far as the fabric takes them; how many it never took (dropped), and
        the sends in flight with their messages, which the fabric must
        finish before the peer handle closes."""
        if end and not self.ended:
            self._post_end()
        self.post_unposted()
        dropped = len(self._unposted)
        self._unposted.clear()
        sends = [(request, message) for request, _, message, _ in self._inflight]
        self._inflight.clear()
        self.peer = None
        return dropped, sends
