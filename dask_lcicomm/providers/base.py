"""The device: one endpoint of a network channel, as a progress engine sees it.

A device moves parcels between two parcelports. Its verbs are ``put``, which
queues a parcel for a virtual connection (see :mod:`.send_queue`), and
``flush``, which sends what is queued on the calling thread as far as the
fabric takes it without waiting; what cannot be sent now is left to
progress. On the receiving side progress writes bytes where the parcel
decoder says they belong and reports every arrival to the completion sink;
nothing is ever received because someone asked for it (LCI's one-sided
model).

A device knows nothing of comms, listeners or channels: whoever owns it may
hang an opaque :attr:`Device.context` on it (LCI's ``user_context``), and
every completion names the device it came from.

A fabric whose resources a process's peers share (one UCX worker for all of
them, as LCI's device serves every peer) hangs its devices on a
:class:`SharedSource`: the engine waits on the source's one descriptor and
reads the devices it names, instead of waiting on a descriptor per device.

A provider implements the transport primitives: :meth:`Device.fileno`,
:meth:`Device._transmit`, :meth:`Device._shutdown` and
:meth:`Device._close_transport`, and :meth:`Device._receive_into` where it
receives a byte stream (a device that receives messages decodes them in its
own :meth:`Device.on_readable`). A provider
whose ``fileno`` never becomes writable (shared memory: space in the peer's
ring is signalled through the readable side) sets ``watch_writable`` to False
and resumes blocked sends itself; one that stops reading early for fairness
with input left reports ``input_pending`` so that progress comes back to it.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import dask.config
from dask.utils import parse_timedelta

from dask_lcicomm.parcel import Limits, ParcelDecoder, Placement, ProtocolError
from dask_lcicomm.providers.send_queue import SendQueue, Unit

if TYPE_CHECKING:
    # Only where its C helper was built (registry.frame_memory).
    from dask_lcicomm.providers.frame_memory import FrameMemory

logger = logging.getLogger(__name__)


class CompletionSink(Protocol):
    """Where a device reports completions: ``(device, event)`` pairs."""

    def push(self, item: Any) -> None: ...


@dataclass(slots=True)
class SendDone:
    """The unit source queued with ``token`` has been handed to the fabric."""

    token: Any


@dataclass(slots=True)
class DeviceLost:
    """The device is gone; ``tokens`` are the sends that will never finish."""

    reason: str
    tokens: list[Any]
    #: The peer broke the protocol (it may not speak it at all).
    violation: bool = False


class SharedSource(ABC):
    """One descriptor that progress waits on for many devices: the fabric
    resources a process's peers share. Its devices name it as
    :attr:`Device.source`; the engine that made it (:meth:`Progress.shared`)
    progresses it, reads the devices it names, and releases it on close."""

    @abstractmethod
    def fileno(self) -> int:
        """What the progress engine waits on."""

    @abstractmethod
    def progress(self) -> Iterable[Device]:
        """Progress the fabric; the devices with something to read or send."""

    @property
    def input_pending(self) -> bool:
        """Whether progress must come back without waiting on the descriptor."""
        return False

    @property
    def retry_delay(self) -> float:
        """How long progress waits (on the descriptor too) before it comes
        back to pending input: 0 for at once; more while the fabric only
        asks for sends to be retried, for a fabric whose own threads need
        the endpoint meanwhile (spinning would keep them out)."""
        return 0.0

    @abstractmethod
    def release(self) -> None:
        """Called by the engine once it stopped waiting on the source."""


class Progress(Protocol):
    """The progress engine, as providers and devices see it."""

    def want_write(self, device: Device) -> None:
        """``device`` has output that could not be sent at once."""

    def shared(self, name: str, make: Callable[[], SharedSource]) -> SharedSource:
        """The engine's source called ``name``, made and watched on first use,
        held for the caller until it calls :meth:`drop`."""

    def hold(self, source: SharedSource) -> bool:
        """Hold ``source`` once more; False if it is already let go."""

    def drop(self, source: SharedSource) -> None:
        """Let go of ``source``; the last holder's drop unwatches and releases it."""

    def kick(self, source: SharedSource) -> None:
        """Progress ``source`` soon, though its descriptor may not say so
        (work posted from outside progress)."""


class DeviceClosed(ConnectionError):
    """A put on a device that is gone."""


@dataclass(frozen=True)
class DeviceOptions:
    """What every device gets from its owner, whatever the provider."""

    completion: CompletionSink
    #: The engine that progresses the device.
    progress: Progress
    #: What the peer may make us allocate.
    limits: Limits
    #: Most bytes taken from the send queue per transmission.
    batch_bytes: int
    #: The accepting side: parcels only on virtual connections the peer opened.
    accepting: bool
    #: Where large frames from the peer land; None: new memory for each.
    frames: FrameMemory | None = None


def connect_timeout() -> float:
    """Dask's bound on setting up a connection, in seconds."""
    return float(parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s"))


def dead_after() -> float:
    """Dask's bound on a connected peer that takes no data, in seconds: after
    it a TCP connection is dead (``distributed.comm.timeouts.tcp``)."""
    return float(parse_timedelta(dask.config.get("distributed.comm.timeouts.tcp"), "s"))


class Device(ABC):
    """One endpoint of a channel between two parcelports."""

    #: The provider's name.
    provider: str
    watch_writable: ClassVar[bool] = True
    #: Where progress waits for this device, if not on its own descriptor.
    source: SharedSource | None = None

    def __init__(
        self,
        options: DeviceOptions,
        local_address: str,
        peer_address: str,
        placement: Placement | None = None,
    ) -> None:
        self.completion = options.completion
        self._want_write = options.progress.want_write
        self._decoder = ParcelDecoder(
            options.limits, require_connect=options.accepting, placement=placement
        )
        self._queue = SendQueue(options.batch_bytes)
        # Serialises the send side and the transport's release: a flush on
        # one thread never sends on a transport another thread closed.
        self._lock = threading.Lock()
        self._writing = False
        self._finishing = False
        self._lost: str | None = None
        self._send_failure: tuple[str, list[Any]] | None = None
        self.released = False
        self.local_address = local_address
        self.peer_address = peer_address
        #: The owner's record of this device; never touched here.
        self.context: Any = None

    @abstractmethod
    def fileno(self) -> int:
        """What the progress engine waits on."""

    @abstractmethod
    def _transmit(self, buffers: deque[Any]) -> int:
        """Send a prefix of ``buffers`` without blocking; return the byte count."""

    def _receive_into(self, buffer: memoryview) -> int:
        """Receive into ``buffer`` without blocking; 0 means end of stream.
        Called by :meth:`on_readable` alone."""
        raise NotImplementedError(f"{type(self).__name__} receives no byte stream")

    @abstractmethod
    def _close_transport(self) -> None:
        """Release the transport; called once, by the progress engine."""

    @abstractmethod
    def _shutdown(self, both: bool) -> None:
        """End the output (and the input too if ``both``); the peer sees the end."""

    @property
    def lost(self) -> bool:
        return self._lost is not None

    @property
    def queued_bytes(self) -> int:
        """Bytes put and not yet handed to the fabric."""
        return self._queue.queued_bytes

    @property
    def input_pending(self) -> bool:
        """Whether :meth:`on_readable` left input that no readiness event will announce."""
        return False

    def put(self, vc: int, unit: Unit, token: Any = None) -> bool:
        """Queue ``unit`` on virtual connection ``vc``; :meth:`flush` sends it.

        Returns True when so much is queued that the caller should flush now
        rather than wait for more parcels to aggregate. A ``token`` comes
        back in a :class:`SendDone` completion once ``unit`` has been sent,
        or in :class:`DeviceLost` if it never will be.
        """
        token = self._place(unit, token)
        with self._lock:
            if self._lost is not None or self._finishing:
                raise DeviceClosed(self._lost or "device is closing")
            return self._queue.push(vc, unit, token)

    def post(self, vc: int, unit: Unit, token: Any = None) -> None:
        """:meth:`put`, then :meth:`flush`, under one hold of the lock (LCI's
        post): the fabric is tried at once, and the send queue keeps only what
        it did not take."""
        token = self._place(unit, token)
        with self._lock:
            if self._lost is not None or self._finishing:
                raise DeviceClosed(self._lost or "device is closing")
            queue = self._queue
            if self._writing:
                queue.push(vc, unit, token)
                return
            if queue.idle:
                queue.push_first(vc, unit, token)
            else:
                queue.push(vc, unit, token)
            done = self._send()
            self._writing = not done
        if self._send_failure is not None:
            self._report_send_failure()
        if not done:
            self._want_write(self)

    def _place(self, unit: Unit, token: Any) -> Any:
        """Before ``unit`` is queued: a fabric with memory the peer granted
        writes its bulk groups there now (see :meth:`OutgoingParcel.place`);
        the token to queue with ``unit`` (the provider's own, if the unit's
        send completes later than the fabric takes it)."""
        return token

    def flush(self) -> bool:
        """Send what is queued, on the calling thread, as far as the fabric
        takes it now; progress sends the rest. True when all is sent."""
        with self._lock:
            if self._writing:
                return False
            done = self._send()
            self._writing = not done
        self._report_send_failure()
        if not done:
            self._want_write(self)
        return done

    def finish(self) -> bool:
        """Send what is queued, then end the output; the peer closes in turn.
        True when all was sent at once (progress sends the rest otherwise)."""
        with self._lock:
            if self._finishing or self._lost is not None:
                return True
            self._finishing = True
        if self.flush():
            self._shutdown(both=False)
            return True
        return False

    def on_writable(self) -> bool:
        """Progress the send side; True when nothing is left to send."""
        return self._progress_sends(blocked_only=False)

    def resume_blocked_sends(self) -> None:
        """Progress the send side if a send is waiting for the fabric; for
        providers whose ``fileno`` never becomes writable. The check is made
        under the lock, so a flush that is just blocking is not missed."""
        self._progress_sends(blocked_only=True)

    def _progress_sends(self, blocked_only: bool) -> bool:
        with self._lock:
            if blocked_only and not self._writing:
                return True
            done = self._send()
            self._writing = not done
            if done and self._finishing and self._lost is None:
                self._shutdown(both=False)
        self._report_send_failure()
        return done

    def on_readable(self) -> bool:
        """Progress the receive side; False once the device is gone."""
        decoder = self._decoder
        push = self.completion.push
        try:
            for _ in range(64):
                buffer = decoder.get_buffer()
                n = self._receive_into(buffer)
                if not n:
                    decoder.check_eof()
                    return self._fail("closed by peer", logging.DEBUG)
                for event in decoder.buffer_updated(n):
                    push((self, event))
                if n < buffer.nbytes:
                    break
        except (BlockingIOError, InterruptedError):
            decoder.read_nothing()
        except ProtocolError as e:
            return self._fail(f"protocol error: {e}", logging.WARNING, violation=True)
        except OSError as e:
            return self._fail(f"{type(e).__name__}: {e}", logging.INFO)
        return True

    def release(self) -> None:
        """Called by the progress engine once the device is unregistered."""
        self._fail("closed", logging.DEBUG)
        with self._lock:
            if self.released:
                return
            self.released = True
            self._close_transport()

    def abandon(self) -> None:
        """Release a device that was never handed to an owner: nobody is
        told, since nobody knows of it."""
        with self._lock:
            self._lost = self._lost or "abandoned"
            if self.released:
                return
            self.released = True
            self._close_transport()

    def _fail(self, reason: str, level: int, violation: bool = False) -> bool:
        with self._lock:
            lost = self._lose(reason)
        if lost is not None:
            self._report_loss(reason, lost, level, violation)
        return False

    def _lose(self, reason: str) -> list[Any] | None:
        """Mark the device lost (under the lock); the tokens that will never
        complete, or None if it was lost already."""
        if self._lost is not None:
            return None
        self._lost = reason
        return self._queue.clear()

    def _report_loss(
        self, reason: str, tokens: list[Any], level: int, violation: bool = False
    ) -> None:
        logger.log(
            level, "%s device %s <-> %s lost: %s",
            self.provider, self.local_address, self.peer_address, reason,
        )
        self.completion.push((self, DeviceLost(reason, tokens, violation)))

    def _report_send_failure(self) -> None:
        """Report a loss found while sending, outside the lock: a synchronous
        completion sink handles it at once and may call back into us."""
        failure, self._send_failure = self._send_failure, None
        if failure is not None:
            self._report_loss(*failure, logging.INFO)

    def _send(self) -> bool:
        """Send under the lock; True when nothing is left (or the device died)."""
        queue = self._queue
        out = queue.out
        push = self.completion.push
        while True:
            if not out and not queue.fill():
                return True
            try:
                n = self._transmit(out)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as e:
                # The peer may be gone before our receive side noticed: every
                # queued send fails now, its writer with it, and the transport
                # is shut so that reading sees the end too.
                reason = f"send failed: {type(e).__name__}: {e}"
                tokens = self._lose(reason)
                self._shutdown(both=True)
                if tokens is not None:
                    self._send_failure = (reason, tokens)
                return True
            for token in queue.consume(n):
                push((self, SendDone(token)))
            if out:
                return False
