"""A channel: the devices that connect this parcelport to one remote listener.

Every comm a process opens to the same listener becomes a virtual connection
on the channel; with ``ndevices`` > 1 the virtual connections are spread over
replicated devices (LCI's answer to contention on one network queue). The
channel closes its devices once its last virtual connection is gone.

The provider is chosen when the channel opens: the first device connects
over tcp and greets the listener; if the listener offers shared memory and
``providers`` prefers it, the channel proves it shares the host by attaching
to it, and then uses only shm devices (the tcp one is closed); otherwise it
stays on tcp.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from typing import TYPE_CHECKING

from dask_lcicomm.parcel import MAX_VC
from dask_lcicomm.providers.base import Device
from dask_lcicomm.providers.shm import ShmUnavailable

if TYPE_CHECKING:
    from dask_lcicomm.parcelport import Parcelport

logger = logging.getLogger("dask_lcicomm.channel")


class Channel:
    """The devices to the listener at ``key``, opened once, shared by its comms."""

    def __init__(self, port: Parcelport, key: str) -> None:
        self.port = port
        self.key = key
        self.devices: list[Device] = []
        self.closed = False
        self._opening: asyncio.Task[None] | None = None
        self._pending = 0
        self._next_vc = 1

    def start(self, host: str, port: int) -> None:
        """Begin connecting the devices; :meth:`allocate` waits for them."""
        self._opening = asyncio.ensure_future(self._open(host, port))
        # Retrieved here so that a failure nobody waited for is not reported.
        self._opening.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def _open(self, host: str, port: int) -> None:
        # The channel's state changes inside the task, so that whoever sees
        # the task done sees the devices too (a done-callback would run later).
        try:
            devices = await self._open_devices(host, port)
        except BaseException:
            self.closed = True
            self.port.forget_channel(self)
            raise
        self.devices = devices
        for device in devices:
            device.channel = self
        self.maybe_close()

    async def _open_devices(self, host: str, port: int) -> list[Device]:
        n = self.port.settings.ndevices
        first = await self.port.open_device(host, port, 0)
        if self.port.prefers_shm and "shm" in first.peer_info:
            try:
                devices = await self._all(self.port.open_shm_device(first, i) for i in range(n))
            except ShmUnavailable as e:
                logger.info("channel to %s stays on tcp: shared memory unavailable: %s", self.key, e)
            except BaseException:
                self.port.finish_device(first)
                raise
            else:
                self.port.finish_device(first)
                return devices
        try:
            return [first, *await self._all(self.port.open_device(host, port, i) for i in range(1, n))]
        except BaseException:
            self.port.finish_device(first)
            raise

    async def _all(self, openings: Iterable[Awaitable[Device]]) -> list[Device]:
        """Open devices concurrently; if any fails, close the others and raise."""
        results = await asyncio.gather(*openings, return_exceptions=True)
        devices = [r for r in results if isinstance(r, Device)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for device in devices:
                self.port.finish_device(device)
            raise errors[0]
        return devices

    async def allocate(self) -> tuple[Device, int]:
        """A device and a fresh virtual-connection id on it."""
        assert self._opening is not None
        self._pending += 1
        try:
            await asyncio.shield(self._opening)
        finally:
            self._pending -= 1
        if self.closed:
            self.maybe_close()
            raise ConnectionResetError(f"channel to {self.key} closed while connecting")
        vc = self._next_vc
        if vc > MAX_VC:
            raise ConnectionError(f"channel to {self.key} ran out of virtual connection ids")
        self._next_vc += 1
        return self.devices[vc % len(self.devices)], vc

    @property
    def nvcs(self) -> int:
        return sum(len(device.vcs) for device in self.devices)

    def maybe_close(self) -> None:
        """Close once opened (or broken) with no virtual connection and nobody waiting."""
        if not self._pending and not self.nvcs and (self.devices or self.closed):
            self._close()

    def retire(self) -> None:
        """The listener refused a virtual connection: it is not the one we
        connected to any more. Open no more virtual connections here; close
        when the last one is gone."""
        self.closed = True
        self.port.forget_channel(self)
        self.maybe_close()

    def device_lost(self) -> None:
        """One device died: the channel is broken; close the rest."""
        self.closed = True
        self._close()

    def _close(self) -> None:
        self.closed = True
        devices, self.devices = self.devices, []
        for device in devices:
            self.port.finish_device(device)
        self.port.forget_channel(self)
