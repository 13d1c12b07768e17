"""The TCP provider: works between any two hosts, and bootstraps every
channel (:mod:`.registry`).

TCP as a message fabric (:mod:`.tcp_fabric`): one endpoint per progress
engine, waiting on one descriptor for every socket; a listener is a
listening socket of it, and a peer one connection, over which the devices
of both ends are asked for and answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from dask_lcicomm.config import Settings
from dask_lcicomm.providers.base import Device, DeviceOptions, Progress
from dask_lcicomm.providers.message_fabric import MessageFabric
from dask_lcicomm.providers.message_provider import MessageProvider
from dask_lcicomm.providers.message_routes import Listener
from dask_lcicomm.providers.registry import NotAnLCIPeer, Offering, PeerOffer, ProviderUnavailable
from dask_lcicomm.providers.sockets import address_of, open_connection
from dask_lcicomm.providers.tcp_connection import NotAnEndpoint
from dask_lcicomm.providers.tcp_fabric import TcpFabric


class TcpProvider(MessageProvider):
    """The bootstrap: a listener's TCP port, and a connection per peer."""

    name = "tcp"

    def make_fabric(self, loop: asyncio.AbstractEventLoop, progress: Progress) -> TcpFabric:
        return TcpFabric(loop, progress)

    def listen(
        self,
        host: str | None,
        port: int,
        settings: Settings,
        options: DeviceOptions,
        accepted: Callable[[Device], None],
    ) -> Offering:
        fabric = self._fabric(options)
        assert isinstance(fabric, TcpFabric)
        try:
            number, bound = fabric.bind_listener(Listener(self.maker(fabric, options), accepted),
                                                 host, port)
        except BaseException:
            fabric.drop()
            raise

        def close() -> None:
            fabric.stop_listening(number)
            fabric.drop()

        return Offering(close=close, address=bound)

    async def connect(self, peer: PeerOffer, settings: Settings, options: DeviceOptions) -> Device:
        sock = await open_connection(peer.host, peer.port)
        try:
            local, remote = address_of(sock.getsockname()), address_of(sock.getpeername())
        except OSError:
            sock.close()
            raise

        adopted = []

        def adopt(fabric: MessageFabric) -> Any:
            assert isinstance(fabric, TcpFabric)
            adopted.append(fabric.adopt(sock))
            return adopted[0]

        try:
            return await self.hello(options, adopt, 0, local, remote, on_failure=sock.close)
        except ProviderUnavailable as e:
            error = adopted[0].error if adopted else None
            if isinstance(error, NotAnEndpoint):
                raise NotAnLCIPeer(f"{remote} is not an lci:// listener: {error}") from e
            raise


PROVIDER = TcpProvider()
