"""LCIComm: one Dask comm, a virtual connection over a parcelport device."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

from distributed.comm.core import Comm, CommClosedError
from distributed.comm.utils import from_frames, to_frames

from dask_lcicomm.parcel import OutgoingParcel, encode_close
from dask_lcicomm.providers.base import Device, DeviceClosed, Raw

if TYPE_CHECKING:
    from dask_lcicomm.parcelport import Parcelport


class LCIComm(Comm):
    """A Dask comm multiplexed with others over one device.

    Messages arrive one-sided: progress puts each completed parcel in the
    comm's inbox whether or not a read is waiting, so nothing is lost between
    reads and no receive is ever posted in advance.
    """

    def __init__(
        self,
        port: Parcelport,
        device: Device,
        vc: int,
        local_addr: str,
        peer_addr: str,
        deserialize: bool = True,
    ) -> None:
        super().__init__(deserialize=deserialize)
        self._port = port
        self._device = device
        self._vc = vc
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self._inbox: deque[list[memoryview]] = deque()
        self._reader: asyncio.Future[None] | None = None
        self._closed = False
        self._peer_closed: str | None = None
        self._seq = 0
        settings = port.settings
        self._eager_threshold = settings.eager_threshold
        self._fragment_size = settings.fragment_size
        self._high_water = settings.write_high_water
        self._eager_budget = settings.max_eager_bytes

    @property
    def local_address(self) -> str:
        return self._local_addr

    @property
    def peer_address(self) -> str:
        return self._peer_addr

    @property
    def extra_info(self) -> dict[str, Any]:
        device = self._device
        return {
            "provider": device.provider,
            "device": device.index,
            "vc": self._vc,
            "peer_pid": device.peer_info.get("pid"),
            "peer_host": device.peer_info.get("host"),
        }

    def closed(self) -> bool:
        return self._closed or (self._peer_closed is not None and not self._inbox)

    async def read(self, deserializers: Any = None) -> Any:
        if self._closed:
            raise CommClosedError(f"{self!r}: read on a closed comm")
        inbox = self._inbox
        if not inbox:
            if self._peer_closed is not None:
                self.abort()
                raise CommClosedError(f"{self!r}: {self._peer_closed}")
            reader = self._reader = self._port.loop.create_future()
            try:
                await reader
            except BaseException:
                self.abort()
                raise
            finally:
                self._reader = None
            if not inbox:
                self.abort()
                raise CommClosedError(f"{self!r}: {self._peer_closed or 'closed'}")
        frames = inbox.popleft()
        try:
            return await from_frames(
                frames,
                deserialize=self.deserialize,
                deserializers=deserializers,
                allow_offload=self.allow_offload,
            )
        except EOFError as e:
            self.abort()
            raise CommClosedError(f"{self!r}: aborted on truncated data") from e

    async def write(self, msg: Any, serializers: Any = None, on_error: str = "message") -> int:
        if self._closed or self._peer_closed is not None:
            self.abort()
            raise CommClosedError(f"{self!r}: {self._peer_closed or 'write on a closed comm'}")
        frames = await to_frames(
            msg,
            allow_offload=self.allow_offload,
            serializers=serializers,
            on_error=on_error,
            context={"sender": self.local_info, "recipient": self.remote_info, **self.handshake_options},
        )
        if self._closed or self._peer_closed is not None:
            self.abort()
            raise CommClosedError(f"{self!r}: closed while serializing")
        parcel = OutgoingParcel(
            self._vc,
            self._seq,
            frames,
            self._eager_threshold,
            self._fragment_size,
            self._eager_budget,
        )
        self._seq += 1
        token = None
        if self._device.queued_bytes + parcel.nbytes > self._high_water:
            token = self._port.loop.create_future()
        try:
            self._port.send(self._device, self._vc, parcel, token)
        except DeviceClosed as e:
            self.abort()
            raise CommClosedError(f"{self!r}: {e}") from e
        if token is not None:
            try:
                await token
            except BaseException:
                self.abort()
                raise
        return parcel.nbytes

    async def close(self) -> None:
        """Close after the messages already written have been sent."""
        token = self._port.loop.create_future()
        if self._shut(token):
            try:
                await token
            except CommClosedError:
                pass

    def abort(self) -> None:
        self._shut(None)

    def _shut(self, token: asyncio.Future[None] | None) -> bool:
        """Close this end (once): tell the peer and free the virtual connection.

        True when a CLOSE was queued, whose sending completes ``token``.
        """
        self._closed = True
        self._wake_reader()
        device, vc = self._device, self._vc
        if device.vcs.get(vc) is not self:
            return False
        try:
            self._port.send(device, vc, Raw(encode_close(vc)), token)
            queued = True
        except DeviceClosed:
            queued = False
        self._port.vc_closed(device, vc)
        return queued

    def _deliver(self, frames: list[memoryview]) -> None:
        self._inbox.append(frames)
        self._wake_reader()

    def _closed_by_peer(self, reason: str) -> None:
        self._peer_closed = reason
        self._wake_reader()

    def _wake_reader(self) -> None:
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)
