"""The shared-memory provider: one-sided puts between processes on one host.

Two parcelports on one host talk through two segments (see
:mod:`.shm_segment`), one per direction, each created by its receiver and
granted to the sender. A parcel's head and small frames go through the
segment's ring (:mod:`.shm_ring`); each large frame is written once, by the
sender, into a pool block of the receiver's segment, and the receiver hands
that memory to the deserializer as the frame itself (:mod:`.shm_pool`). The
sender rings a doorbell, one byte on a Unix socket, only when the receiver
sleeps; the same socket tells each side that the other is gone. A peer
proves that it shares our host in the handshake (:mod:`.shm_handshake`).
What the senders of a process lend and write counts against one budget
(:mod:`.shm_budget`), and what they no longer use goes back to the OS
(:mod:`.shm_release`). A large frame that finds no pool block is read by the
receiver from the sender's own memory where the kernel allows it
(:mod:`.shm_reads`), into memory that frames read before left free
(:mod:`.frame_memory`), else it goes through the ring.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import dask.config

from dask_lcicomm.config import Settings
from dask_lcicomm.parcel import OutgoingParcel, ProtocolError
from dask_lcicomm.providers.base import Device, DeviceOptions, SendDone, connect_timeout
from dask_lcicomm.providers.registry import Offering, PeerOffer, Provider, ProviderUnavailable
from dask_lcicomm.providers.send_queue import Unit
from dask_lcicomm.providers.sockets import accept_handshakes, shut_socket

try:
    import dask_lcicomm.providers._atomics  # noqa: F401
except ImportError as e:
    raise ImportError(
        "the shm provider needs its C helper dask_lcicomm.providers._atomics, which was not"
        " built (no C compiler when this package was installed); lci:// uses the other"
        " providers"
    ) from e

from dask_lcicomm.providers.frame_memory import FrameMemory
from dask_lcicomm.providers.shm_budget import SharedMemoryBudget, budget
from dask_lcicomm.providers.shm_handshake import ShmLink, accept, connect, listen, names_for
from dask_lcicomm.providers.shm_options import SECTION, ShmOptions
from dask_lcicomm.providers.shm_pool import ALIGN, PoolAllocator
from dask_lcicomm.providers.shm_reads import READ_HANDLE, Lender, Loan, LoanCompletions, read
from dask_lcicomm.providers.shm_release import MemoryReleaser, releaser
from dask_lcicomm.providers.shm_ring import RingReader, RingWriter
from dask_lcicomm.providers.shm_segment import Layout, round_up
from dask_lcicomm.providers.spare_core import SpareCore

logger = logging.getLogger(__name__)

_DOORBELL = b"\1"
#: Whether a device may poll now (one reading per millisecond per process).
_spare_core = SpareCore(period=1e-3)


def unavailable() -> str | None:
    """Why this process cannot use the provider at all, or None."""
    if not hasattr(os, "memfd_create") or not hasattr(socket, "SO_PEERCRED"):
        return "memfd_create and SO_PEERCRED need Linux"
    return None


class ShmDevice(Device):
    """A device over two shared segments and a Unix socket for doorbells."""

    provider = "shm"
    watch_writable = False

    def __init__(
        self,
        link: ShmLink,
        options: DeviceOptions,
        poll_window: float = 0.0,
        releaser: MemoryReleaser | None = None,
        budget: SharedMemoryBudget | None = None,
        rendezvous_bytes: int = 0,
        frames: FrameMemory | None = None,
    ) -> None:
        super().__init__(options, link.local_address, link.peer_address, placement=self._lend)
        self._sock = link.sock
        self._fd = link.sock.fileno()
        self._shared: _Shared | None = _Shared(link, budget)
        self._budget = budget
        self._peer_pid = link.peer_pid
        self._reads = link.reads
        # Where frames read from the peer land (None: new memory each).
        self._frames = frames
        # The smallest group lent to the peer for reading (0: none).
        self._lend_from = rendezvous_bytes if link.peer_reads else 0
        # Where the writes of lent groups complete once read.
        self._sink = self.completion
        if self._lend_from:
            self.completion = LoanCompletions(self._sink, self._lender)
        self._peer_gone = False
        self._poll_window = poll_window
        # Until when the receiving side polls the ring instead of sleeping.
        self._poll_until = 0.0
        # Who has us give back, once a period, the pages of the peer's
        # segment that we wrote and no longer use.
        self._releaser = releaser
        self.sent = False

    def fileno(self) -> int:
        return self._fd

    @property
    def input_pending(self) -> bool:
        shared = self._shared
        return shared is not None and not shared.reader.asleep and not self.lost

    def _sending(self) -> None:
        """Written into the peer's segment: the ring counts against the
        budget, and is watched, until idle again."""
        if self.sent:
            return
        self.sent = True
        shared = self._shared
        if self._budget is not None and shared is not None:
            self._budget.charge(self, shared.tx_layout.ring_bytes)
        if self._releaser is not None:
            self._releaser.watch(self)

    def release_idle_memory(self) -> bool:
        """Give back the pages of the peer's segment that we wrote and that
        are free now: the free ring space, and pool blocks free for a whole
        period (those freed just now may be reused at once). True when
        nothing is left to watch: no send since the last look, no block lent."""
        with self._lock:
            shared = self._shared
            if shared is None:
                return True
            pool_offset = shared.tx_layout.pool_offset
            unused = shared.writer.free_pages() + [
                (pool_offset + offset, nbytes) for offset, nbytes in shared.pool.idle_free()
            ]
            try:
                for offset, nbytes in unused:
                    shared.tx.discard(offset, nbytes)
            except OSError as e:
                logger.warning("shm device to %s keeps its shared memory: %s", self.peer_address, e)
                self._releaser, self.sent = None, False
                return True
            sent, self.sent = self.sent, False
            if self._budget is not None:
                self._budget.give(self)
            return not sent and shared.pool.settled

    def _place(self, unit: Unit, token: Any) -> Any:
        """Write each bulk group of a parcel (the frames that will share one
        buffer at the receiver) into a pool block of its own now, where one
        is free; the parcel then carries only where they lie, and releasing
        one group's objects at the receiver frees that block alone. Whatever
        thread later publishes the parcel in the ring does so under the
        device lock, after these writes, so the ring's release store covers
        them. A large group that finds no block is lent for reading, and the
        write then completes once it is read."""
        shared = self._shared
        if type(unit) is not OutgoingParcel or not unit.has_bulk or shared is None or self.lost:
            return token
        parcel = unit
        self._sending()
        loan = None
        for group, views in enumerate(parcel.bulk_groups):
            nbytes = sum(view.nbytes for view in views)
            spot = shared.pool.allocate(nbytes)
            if spot is None:
                if not self._lend_from or nbytes < self._lend_from:
                    break
                if loan is None and token is not None:
                    loan = Loan(token)
                lent = shared.lender.lend(views, loan)
                if lent is None:
                    break
                parcel.place(group, *lent)
                continue
            block, offset = spot
            position = shared.tx_layout.pool_offset + offset
            for view in views:
                shared.tx.write(position, view)
                position += view.nbytes
            parcel.place(group, block, offset)
        return loan if loan is not None and loan.unread else token

    def _lender(self) -> Lender | None:
        shared = self._shared
        return None if shared is None else shared.lender

    def _lend(self, block: int, offset: int, nbytes: int) -> memoryview:
        """The placed frames, as a buffer whose release returns ``block``."""
        shared = self._shared
        if shared is None:
            raise ProtocolError("placed frames after the device was released")
        layout = shared.rx_layout
        if block & READ_HANDLE:
            return self._read(shared, block ^ READ_HANDLE, offset, nbytes)
        if block >= layout.blocks or offset % ALIGN or offset + nbytes > layout.pool_bytes:
            raise ProtocolError(
                f"placed frames in block {block} at {offset}+{nbytes} lie outside the pool"
            )
        return memoryview(shared.rx.lease(layout.pool_offset + offset, nbytes, layout.flag(block)))

    def _read(self, shared: _Shared, block: int, at: int, nbytes: int) -> memoryview:
        """Frames lent at address ``at`` of the peer, read into our memory;
        ``block`` goes back to the peer at once, with a doorbell."""
        if not self._reads:
            raise ProtocolError("the peer lent frames for reading, which we did not offer")
        if block >= shared.rx_layout.blocks:
            raise ProtocolError(f"frames lent under handle {block}, beyond the segment's blocks")
        view = read(self._peer_pid, at, nbytes, self._frames)
        shared.rx.store(shared.rx_layout.flag(block), 1)
        self._ring()
        return view

    def on_readable(self) -> bool:
        shared = self._shared
        if shared is None:
            return False
        self._take_doorbell()
        shared.reader.woken()
        if shared.lender:
            for token in shared.lender.collect():
                self._sink.push((self, SendDone(token)))
        self.resume_blocked_sends()
        return super().on_readable()

    def _take_doorbell(self) -> None:
        """Read one doorbell. A side rings at most once per sleep of the
        other, so one is what is pending; another keeps the socket readable
        and brings us back."""
        try:
            if not self._sock.recv(16):
                self._peer_gone = True
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._peer_gone = True

    def _transmit(self, buffers: deque[Any]) -> int:
        shared = self._shared
        if shared is None:
            raise ConnectionAbortedError("device released")
        writer = shared.writer
        try:
            n = writer.write(buffers)
            while writer.full and writer.wait_for_space():
                n += writer.write(buffers, n)
        except ProtocolError as e:
            logger.warning("closing shm device to %s: %s", self.peer_address, e)
            raise ConnectionAbortedError(str(e)) from e
        if n and not self.sent:
            self._sending()
        if n and writer.wake_receiver():
            self._ring()
        if not n:
            raise BlockingIOError
        if self._poll_window:
            # A reply is likely: keep polling for it (if still awake and a
            # core is free).
            now = time.monotonic()
            if _spare_core(now):
                self._poll_until = now + self._poll_window
        return n

    def _receive_into(self, buffer: memoryview) -> int:
        shared = self._shared
        if shared is None:
            raise ConnectionAbortedError("device released")
        reader = shared.reader
        n = reader.read_into(buffer)
        if self._poll_window:
            now = time.monotonic()
            if n or now < self._poll_until:
                if not _spare_core(now):
                    self._poll_until = 0.0  # others want the cores: sleep
                elif n:
                    self._poll_until = now + self._poll_window
            if now < self._poll_until:
                # Stay awake: the engine comes back while input is pending.
                return self._received(reader, n)
        while n < buffer.nbytes and not reader.sleep():
            n += reader.read_into(buffer[n:])
        return self._received(reader, n)

    def _received(self, reader: RingReader, n: int) -> int:
        """``n`` bytes were read: ring a sender that waits for the space they
        freed; nothing read is the end of input once the peer is gone."""
        if n:
            if reader.sender_waiting():
                self._ring()
            return n
        if self._peer_gone:
            return 0
        raise BlockingIOError

    def _ring(self) -> None:
        try:
            self._sock.send(_DOORBELL)
        except OSError:
            # Full: a doorbell is pending anyway. Gone: reading will tell.
            pass

    def _shutdown(self, both: bool) -> None:
        shut_socket(self._sock, both)

    def _close_transport(self) -> None:
        # Unmapped as soon as no object lent from the segments lives (each
        # lease holds its own region): a closed comm that somebody keeps
        # must not keep the shared memory with it.
        self._decoder.placement = None
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.pool.close()
            shared.lender.close()
        if self._budget is not None:
            self._budget.give(self)
        self._sock.close()
        if self._releaser is not None:
            self._releaser.forget(self)


class _Shared:
    """Everything of a device that lives in the two shared segments."""

    def __init__(self, link: ShmLink, budget: SharedMemoryBudget | None) -> None:
        self.rx, self.rx_layout = link.rx, link.rx_layout
        self.tx, self.tx_layout = link.tx, link.tx_layout
        self.reader = RingReader(link.rx, link.rx_layout)
        self.writer = RingWriter(link.tx, link.tx_layout)
        tx, flag = link.tx, link.tx_layout.flag
        returned = lambda block: tx.load(flag(block)) == 1  # noqa: E731
        self.pool = PoolAllocator(
            link.tx_layout.pool_bytes,
            link.tx_layout.blocks,
            returned=returned,
            claim=lambda block: tx.store(flag(block), 0),
            budget=budget,
        )
        self.lender = Lender(self.pool.take_handle, self.pool.give_handle, returned)


class ShmProvider(Provider):
    """Shared memory with a peer that proves it runs on this host."""

    name = "shm"
    section = SECTION

    def unavailable(self) -> str | None:
        return unavailable()

    def listen(
        self,
        host: str | None,
        port: int,
        settings: Settings,
        options: DeviceOptions,
        accepted: Callable[[Device], None],
    ) -> Offering:
        sock, name = listen(int(dask.config.get("distributed.comm.socket-backlog")), host, port)
        shm = ShmOptions.of(settings)
        layout = _layout(shm)
        timeout = connect_timeout()

        async def handshake(conn: socket.socket) -> Device:
            link = await accept(conn, layout, timeout, reads=shm.rendezvous_bytes > 0)
            return _device(link, options, settings, shm)

        close = accept_handshakes(sock, handshake, accepted, name)
        return Offering(close=close, offer=name)

    def direct(self, host: str, port: int) -> tuple[str, ...] | None:
        return names_for(host, port) or None

    async def connect(self, peer: PeerOffer, settings: Settings, options: DeviceOptions) -> Device:
        # A greeting offers one name (JSON has no tuples); :meth:`direct` the names to try.
        names = peer.offer if isinstance(peer.offer, tuple) else (peer.offer,)
        if not all(isinstance(name, str) and 0 < len(name) <= 100 for name in names):
            raise ProviderUnavailable(f"malformed shared-memory offer {peer.offer!r}")
        shm = ShmOptions.of(settings)
        link = await connect(
            names, peer.pid, _layout(shm),
            peer.local_address, peer.peer_address, connect_timeout(),
            reads=shm.rendezvous_bytes > 0,
        )
        return _device(link, options, settings, shm)


def _device(link: ShmLink, options: DeviceOptions, settings: Settings, shm: ShmOptions) -> ShmDevice:
    """A device as configured: the event loop's releaser unless idle memory
    is kept, the frame memory its owner gave, and the process's budget."""
    period = settings.release_after
    return ShmDevice(link, options, _poll_window(settings, shm), releaser(period) if period else None,
                     budget(shm.budget), shm.rendezvous_bytes, options.frames)


def _layout(shm: ShmOptions) -> Layout:
    """The configured sizes, in whole pages (segments are mapped by the page)."""
    return Layout(round_up(shm.ring_size), round_up(shm.pool_size), shm.pool_blocks)


def _poll_window(settings: Settings, shm: ShmOptions) -> float:
    """How long a device polls after traffic: only when the event loop makes
    progress. A progress thread polling would hold the GIL the event loop
    needs (8 B round trips measured 4.3x slower than without)."""
    return shm.poll_window if settings.progress == "loop" else 0.0


PROVIDER = ShmProvider()
