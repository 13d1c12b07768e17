"""A provider over a message fabric: how its devices are asked for and made.

A listener offers the fabric endpoint's address and its own number; a peer
asks for a device with a hello to that endpoint and is welcomed with the
route to use (see :mod:`.message_fabric`). No listener or socket of its own:
the fabric connects the endpoints. A provider names its fabric
(:meth:`MessageProvider.make_fabric`) and adds nothing else.
"""

from __future__ import annotations

import asyncio
import functools
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

from dask_lcicomm.config import Settings
from dask_lcicomm.providers.base import Device, DeviceOptions, Progress, connect_timeout
from dask_lcicomm.providers.message_device import MessageDevice
from dask_lcicomm.providers.message_fabric import MessageFabric
from dask_lcicomm.providers.message_routes import Listener
from dask_lcicomm.providers.registry import Offering, PeerOffer, Provider, ProviderUnavailable


def _settle_soon(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None], reason: str | None) -> None:
    """Settle ``future`` on its loop: the welcome comes wherever progress runs."""
    loop.call_soon_threadsafe(_settle, future, reason)


def _settle(future: asyncio.Future[None], reason: str | None) -> None:
    if future.done():
        return
    if reason is None:
        future.set_result(None)
    else:
        future.set_exception(ProviderUnavailable(reason))


class MessageProvider(Provider):
    """A message fabric with a peer whose listener offers it and that the
    fabric can reach."""

    @abstractmethod
    def make_fabric(self, loop: asyncio.AbstractEventLoop, progress: Progress) -> MessageFabric:
        """A fresh endpoint on the fabric, for the engine ``progress``."""

    def _fabric(self, options: DeviceOptions) -> MessageFabric:
        """The fabric endpoint of the engine behind ``options``, held for the caller."""
        loop = asyncio.get_running_loop()
        fabric = options.progress.shared(self.name, lambda: self.make_fabric(loop, options.progress))
        assert isinstance(fabric, MessageFabric)
        return fabric

    def maker(self, fabric: MessageFabric, options: DeviceOptions) -> Callable[..., MessageDevice]:
        """How ``fabric`` makes the devices a listener accepts."""

        def make(peer: Any, peer_route: int, local: str, peer_address: str) -> MessageDevice:
            return MessageDevice(fabric, peer, peer_route, options, local, peer_address)

        return make

    def listen(
        self,
        host: str | None,
        port: int,
        settings: Settings,
        options: DeviceOptions,
        accepted: Callable[[Device], None],
    ) -> Offering:
        fabric = self._fabric(options)
        number = fabric.listen(Listener(self.maker(fabric, options), accepted))

        def close() -> None:
            fabric.stop_listening(number)
            fabric.drop()

        return Offering(close=close, offer=[fabric.address, number])

    async def connect(self, peer: PeerOffer, settings: Settings, options: DeviceOptions) -> Device:
        offer = peer.offer
        if not (isinstance(offer, list) and len(offer) == 2 and isinstance(offer[0], str)
                and isinstance(offer[1], int)):
            raise ProviderUnavailable(f"malformed {self.name} offer {offer!r}")
        address, listener = offer
        return await self.hello(options, lambda fabric: fabric.open_peer(address), listener,
                                peer.local_address, peer.peer_address)

    async def hello(
        self,
        options: DeviceOptions,
        open_peer: Callable[[MessageFabric], Any],
        listener: int,
        local: str,
        remote: str,
        on_failure: Callable[[], None] | None = None,
    ) -> Device:
        """A device to the peer that ``open_peer`` gives a handle for, once
        the peer's listener numbered ``listener`` welcomed it; what the
        handle was made of is given up by ``on_failure`` if none was made."""
        fabric = self._fabric(options)
        loop = asyncio.get_running_loop()
        welcomed: asyncio.Future[None] = loop.create_future()
        handle = device = None
        try:
            with fabric.lock:
                handle = open_peer(fabric)
                device = MessageDevice(fabric, handle, 0, options, local, remote)
                device.on_welcome = functools.partial(_settle_soon, loop, welcomed)
                device.hello(listener)
        except BaseException as e:
            # Not under the lock: letting go of the fabric may release it.
            if device is None:
                if handle is not None:
                    with fabric.lock:
                        fabric.close_peer(handle)
                elif on_failure is not None:
                    on_failure()
                fabric.drop()
            else:
                device.abandon()
            if isinstance(e, fabric.setup_errors()):
                raise ProviderUnavailable(
                    f"{self.name} cannot reach the peer: {type(e).__name__}: {e}"
                ) from e
            raise
        options.progress.kick(fabric)
        try:
            await asyncio.wait_for(welcomed, connect_timeout())
        except asyncio.TimeoutError as e:
            device.abandon()
            raise ProviderUnavailable(f"no {self.name} welcome within {connect_timeout()} s") from e
        except BaseException:
            device.abandon()
            raise
        device.on_welcome = None
        return device
