"""Send aggregation: the parcels written in one event-loop iteration leave
together.

Without aggregation a parcel leaves at once (as far as its device is not
busy). With it, the first send of an iteration leaves at once, and whatever
any comm writes after it in the same iteration leaves together when the
iteration is over: one system call or one ring notification for many small
parcels. A device whose backlog reaches ``fragment-size`` bytes is flushed at
once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dask_lcicomm.progress.completion import Completion
from dask_lcicomm.providers.base import Device
from dask_lcicomm.providers.send_queue import Unit


class Aggregator:
    """Puts parcels on devices and decides when each device flushes."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, completion: Completion, enabled: bool
    ) -> None:
        self._loop = loop
        self._completion = completion
        self._enabled = enabled
        self._unflushed: dict[Device, None] = {}
        self._handle: asyncio.Handle | None = None

    def put(self, device: Device, vc: int, unit: Unit, token: Any = None) -> None:
        """Queue ``unit`` on ``device``; raises :class:`DeviceClosed`."""
        if not self._enabled:
            device.post(vc, unit, token)
            self._completion.flush()
        elif device.put(vc, unit, token):
            self._flush_device(device)
        elif self._handle is None:
            self._handle = self._loop.call_soon(self._flush)
            self._flush_device(device)
        else:
            self._unflushed[device] = None

    def _flush_device(self, device: Device) -> None:
        device.flush()
        self._completion.flush()

    def _flush(self) -> None:
        self._handle = None
        devices, self._unflushed = self._unflushed, {}
        for device in devices:
            device.flush()
        self._completion.flush()
