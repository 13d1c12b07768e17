"""A virtual connection: one Dask comm's share of a link.

Messages arrive one-sided: progress puts each completed parcel in the
connection's inbox whether or not a receive is waiting, so nothing is lost
between reads and no receive is ever posted in advance. Sending builds a
parcel within the *peer's* limits (from its greeting) and queues it on the
link's device; a writer waits only when its device holds more than the high
water mark.

The parcelport holds a virtual connection while it is open; whoever uses it
(a comm) holds it too, and closes or aborts it, or drops it: see
:class:`dask_lcicomm.comm.comm.LCIComm`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from distributed.comm.core import CommClosedError

from dask_lcicomm.config import Settings
from dask_lcicomm.link import Link
from dask_lcicomm.parcel import Buffer, OutgoingParcel
from dask_lcicomm.providers.base import DeviceClosed
from dask_lcicomm.providers.send_queue import Unit


class Transport(Protocol):
    """What a virtual connection needs from its parcelport."""

    loop: asyncio.AbstractEventLoop
    settings: Settings

    def send(self, link: Link, vc: int, unit: Unit, token: Any = None) -> None:
        """Queue ``unit``; :class:`DeviceClosed` if the link is gone."""

    def close_vc(
        self, link: Link, vc: int, receiver: VirtualConnection, token: asyncio.Future[None] | None
    ) -> bool:
        """``receiver`` closed its end of ``vc``: tell the peer and forget
        it. True when a CLOSE was queued; its sending completes ``token``."""


class VirtualConnection:
    """Sends and receives the frames of one comm over a link."""

    def __init__(self, transport: Transport, link: Link, vc: int) -> None:
        self._transport = transport
        self._link = link
        self.vc = vc
        self._inbox: deque[list[memoryview]] = deque()
        self._reader: asyncio.Future[None] | None = None
        self._closed = False
        self._peer_closed: str | None = None
        self._seq = 0

    @property
    def local_address(self) -> str:
        return self._link.device.local_address

    @property
    def peer_address(self) -> str:
        return self._link.device.peer_address

    @property
    def info(self) -> dict[str, Any]:
        link = self._link.describe()
        return {key: link[key] for key in ("provider", "device", "peer_pid", "peer_host")} | {
            "vc": self.vc
        }

    @property
    def closed(self) -> bool:
        """Closed here, or by the peer with nothing left to read."""
        return self._closed or (self._peer_closed is not None and not self._inbox)

    def _closed_error(self, default: str) -> CommClosedError:
        return CommClosedError(f"{self.peer_address} vc {self.vc}: {self._peer_closed or default}")

    async def receive(self) -> list[memoryview]:
        """The frames of the next message; :class:`CommClosedError` once closed."""
        if self._closed:
            raise self._closed_error("read on a closed comm")
        inbox = self._inbox
        if not inbox:
            if self._peer_closed is not None:
                raise self._closed_error("closed")
            if self._reader is not None:
                raise RuntimeError(f"{self.peer_address} vc {self.vc}: a read is already waiting")
            reader = self._reader = self._transport.loop.create_future()
            try:
                await reader
            finally:
                self._reader = None
            if not inbox:
                raise self._closed_error("closed")
        return inbox.popleft()

    async def send(self, frames: Sequence[Buffer]) -> int:
        """Queue one message; returns its size once the device can take more."""
        if self._closed or self._peer_closed is not None:
            raise self._closed_error("write on a closed comm")
        settings = self._transport.settings
        limits = self._link.peer_limits
        parcel = OutgoingParcel(
            self.vc,
            self._seq,
            frames,
            settings.eager_threshold,
            settings.fragment_size,
            limits.max_eager_bytes,
            max_frames=limits.max_frames,
            max_message_bytes=limits.max_message_bytes,
        )
        self._seq += 1
        token = None
        if self._link.device.queued_bytes + parcel.nbytes > settings.write_high_water:
            token = self._transport.loop.create_future()
        try:
            self._transport.send(self._link, self.vc, parcel, token)
        except DeviceClosed as e:
            raise CommClosedError(f"{self.peer_address} vc {self.vc}: {e}") from e
        if token is not None:
            await token
        return parcel.nbytes

    async def close(self) -> None:
        """Close after what was already sent has left."""
        token = self._transport.loop.create_future()
        if self._shut(token):
            try:
                await token
            except CommClosedError:
                pass

    def abort(self) -> None:
        """Close at once; never raises."""
        self._shut(None)

    def _shut(self, token: asyncio.Future[None] | None) -> bool:
        """Close this end (once): tell the peer and free the id. True when a
        CLOSE was queued, whose sending completes ``token``."""
        self._closed = True
        self._wake_reader()
        return self._transport.close_vc(self._link, self.vc, self, token)

    # -- called by the parcelport (Receiver) ---------------------------------

    def deliver(self, frames: list[memoryview]) -> None:
        if not self._closed:
            self._inbox.append(frames)
            self._wake_reader()

    def peer_closed(self, reason: str) -> None:
        self._peer_closed = reason
        self._wake_reader()

    def _wake_reader(self) -> None:
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)
