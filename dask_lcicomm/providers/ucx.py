"""The UCX provider: one-sided puts over the fabric UCX drives (InfiniBand,
RoCE; TCP and shared memory where that is all there is; not Slingshot 11,
EFA or Omni-Path, which only libfabric drives).

One UCX worker per progress engine serves every ucx device of it
(:mod:`.ucx_worker`); a device is one endpoint of it (:mod:`.ucx_device`).
A listener offers the worker's address and its own number; a peer asks for
a device with a hello to that worker and is welcomed with the route to use.
No listener or socket of its own: UCX connects the workers.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from dask_lcicomm.config import Settings
from dask_lcicomm.providers import ucx_context
from dask_lcicomm.providers.base import Device, DeviceOptions, connect_timeout
from dask_lcicomm.providers.registry import Offering, PeerOffer, Provider, ProviderUnavailable
from dask_lcicomm.providers.ucx_device import UcxDevice
from dask_lcicomm.providers.ucx_options import SECTION
from dask_lcicomm.providers.ucx_worker import Listener, UcxWorker


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


class UcxProvider(Provider):
    """UCX with a peer whose listener offers it and that UCX can reach."""

    name = "ucx"
    section = SECTION

    def unavailable(self) -> str | None:
        return ucx_context.unavailable()

    @staticmethod
    def _worker(options: DeviceOptions) -> UcxWorker:
        """The worker of the engine behind ``options``, held for the caller."""
        loop = asyncio.get_running_loop()
        worker = options.progress.shared("ucx", lambda: UcxWorker(loop, options.progress))
        assert isinstance(worker, UcxWorker)
        return worker

    def listen(
        self,
        host: str | None,
        port: int,
        settings: Settings,
        options: DeviceOptions,
        accepted: Callable[[Device], None],
    ) -> Offering:
        worker = self._worker(options)

        def make(endpoint: Any, peer_route: int, local: str, peer: str) -> UcxDevice:
            return UcxDevice(worker, endpoint, peer_route, options, local, peer)

        number = worker.listen(Listener(make, accepted))

        def close() -> None:
            worker.stop_listening(number)
            worker.drop()

        return Offering(close=close, offer=[worker.address, number])

    async def connect(self, peer: PeerOffer, settings: Settings, options: DeviceOptions) -> Device:
        offer = peer.offer
        if not (isinstance(offer, list) and len(offer) == 2 and isinstance(offer[0], str)
                and isinstance(offer[1], int)):
            raise ProviderUnavailable(f"malformed UCX offer {offer!r}")
        address, listener = offer
        worker = self._worker(options)
        loop = asyncio.get_running_loop()
        welcomed: asyncio.Future[None] = loop.create_future()
        device = None
        try:
            with worker.lock:
                endpoint = worker.endpoint(address)
                device = UcxDevice(worker, endpoint, 0, options, peer.local_address, peer.peer_address)
                device.on_welcome = functools.partial(_settle_soon, loop, welcomed)
                device.hello(listener)
        except BaseException as e:
            # Not under the lock: letting go of the worker may release it.
            if device is None:
                worker.drop()
            else:
                device.abandon()
            if isinstance(e, ucx_context.setup_errors()):
                raise ProviderUnavailable(f"UCX cannot reach the peer: {type(e).__name__}: {e}") from e
            raise
        options.progress.kick(worker)
        try:
            await asyncio.wait_for(welcomed, connect_timeout())
        except asyncio.TimeoutError as e:
            device.abandon()
            raise ProviderUnavailable(f"no UCX welcome within {connect_timeout()} s") from e
        except BaseException:
            device.abandon()
            raise
        device.on_welcome = None
        return device


PROVIDER = UcxProvider()
