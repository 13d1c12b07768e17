"""Links: the parcelport's records of its devices, and how they open and close.

The device moves bytes and the link's protocol (:mod:`.link_protocol`) keeps
its state; a :class:`Link` ties them together with what belongs to the event
loop: the future that the greeting completes, the greeting deadline or
linger timer, and the channel that opened it. :class:`Links` makes links of
the devices the providers accept and connect (the bootstrap first, then the
providers a peer offers), greets them within Dask's connect timeout and
finishes them with a linger.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from distributed.comm.addressing import unparse_host_port

from dask_lcicomm.aggregation import Aggregator
from dask_lcicomm.config import Settings
from dask_lcicomm.link_protocol import Acceptor, Greeting, LinkProtocol, Receiver
from dask_lcicomm.parcel import Limits
from dask_lcicomm.progress import ProgressEngine
from dask_lcicomm.progress.completion import Completion
from dask_lcicomm.providers import registry
from dask_lcicomm.providers.base import Device, DeviceOptions, connect_timeout
from dask_lcicomm.providers.registry import (
    NotAnLCIPeer,
    Offering,
    PeerOffer,
    Provider,
    ProviderUnavailable,
)
from dask_lcicomm.providers.send_queue import Raw

#: How long a closing link waits for the peer's end before it is closed hard.
LINGER = 10.0


class Listening:
    """A listener's registration: the providers accepting for it, and what
    becomes of the virtual connections its peers open (an opaque callable
    here, called by whoever routes the protocol's effects)."""

    def __init__(self, accept: Callable[[Any], None]) -> None:
        self.accept = accept
        self.active = True
        self.offerings: list[Offering] = []

    @property
    def address(self) -> tuple[str, int] | None:
        """Where the bootstrap provider listens."""
        return self.offerings[0].address if self.offerings else None

    def close(self) -> None:
        self.active = False
        offerings, self.offerings = self.offerings, []
        for offering in offerings:
            offering.close()


class Owner(Protocol):
    """Who opened a link and wants to know what becomes of it (a channel)."""

    def link_idle(self, link: Link) -> None:
        """A virtual connection on ``link`` closed."""

    def link_lost(self, link: Link) -> None:
        """``link`` is gone."""

    def retire(self) -> None:
        """The peer refused a virtual connection: open no more."""


class Link:
    """One device of the parcelport, its protocol and its waiters."""

    def __init__(
        self,
        device: Device,
        index: int,
        protocol: LinkProtocol,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.device = device
        #: Which of a channel's replicated devices this is.
        self.index = index
        self.protocol = protocol
        #: The connecting side: whoever opened the link.
        self.owner: Owner | None = None
        #: Done when the peer's greeting arrived; fails if the link is lost first.
        self.greeted: asyncio.Future[None] = loop.create_future()
        # Nobody may be waiting when the link is lost: never report "exception
        # never retrieved" for it.
        self.greeted.add_done_callback(lambda f: f.cancelled() or f.exception())
        #: The greeting deadline, then the linger of a closing link.
        self.timer: asyncio.TimerHandle | None = None

    @property
    def vcs(self) -> dict[int, Receiver]:
        return self.protocol.vcs

    @property
    def peer_limits(self) -> Limits:
        return self.protocol.peer_limits

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def describe(self) -> dict[str, Any]:
        """For diagnostics and a comm's ``extra_info``."""
        peer = self.protocol.peer
        return {
            "provider": self.device.provider,
            "device": self.index,
            "state": self.protocol.state.value,
            "local_address": self.device.local_address,
            "peer_address": self.device.peer_address,
            "peer_pid": peer.pid if peer else None,
            "peer_host": peer.host if peer else None,
            "comms": len(self.vcs),
        }


class Links:
    """The links of one parcelport, over the providers its configuration lists."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        settings: Settings,
        completion: Completion,
        engine: ProgressEngine,
        aggregator: Aggregator,
        overdue: Callable[[Link], None],
    ) -> None:
        self._loop = loop
        self._settings = settings
        self.limits = Limits(
            max_message_bytes=settings.max_message_bytes,
            max_frames=settings.max_frames,
            max_eager_bytes=settings.max_eager_bytes,
        )
        self._completion = completion
        self._engine = engine
        self._aggregator = aggregator
        self._overdue = overdue
        self._identity = (os.getpid(), socket.gethostname())
        self._bootstrap = registry.get(registry.BOOTSTRAP)
        self._offered, self.unusable = registry.offered(settings)
        self.bootstrap_allowed = registry.bootstrap_allowed(settings)
        self._upgrades = [p for p in registry.upgrades(settings) if p in self._offered]
        self._links: set[Link] = set()
        self._frames = registry.frame_memory(settings)

    def __bool__(self) -> bool:
        return bool(self._links)

    def __iter__(self) -> Iterator[Link]:
        return iter(self._links)

    def _options(self, accepting: bool) -> DeviceOptions:
        return DeviceOptions(
            completion=self._completion,
            progress=self._engine,
            limits=self.limits,
            batch_bytes=self._settings.fragment_size,
            accepting=accepting,
            frames=self._frames,
        )

    def _adopt(self, device: Device, index: int, acceptor: Acceptor | None, offers: Any) -> Link:
        greeting = Greeting(*self._identity, self.limits, offers)
        link = Link(device, index, LinkProtocol(greeting, acceptor), self._loop)
        device.context = link
        self._links.add(link)
        self._engine.add(device)
        return link

    def listen(self, host: str | None, port: int, accept: Callable[[Any], None]) -> Listening:
        """Accept peers at ``host:port`` over the bootstrap provider, and
        over every other provider this process runs, offered to them in the
        greeting; ``accept`` gets what a peer opens. Nothing stays open on
        failure."""
        listening = Listening(accept)
        options = self._options(accepting=True)
        offers: dict[str, Any] = {}

        def accepted(device: Device) -> None:
            link = self._adopt(device, 0, listening, offers)
            # A peer that never greets must not hold a link forever.
            link.timer = self._loop.call_later(connect_timeout(), self._overdue, link)

        try:
            boot = self._bootstrap.listen(host, port, self._settings, options, accepted)
            listening.offerings.append(boot)
            bound_host, bound_port = boot.address or (host, port)
            for provider in self._offered:
                offering = provider.listen(bound_host, bound_port, self._settings, options, accepted)
                listening.offerings.append(offering)
                offers[provider.name] = offering.offer
        except BaseException:
            listening.close()
            raise
        return listening

    async def bootstrap(self, host: str, port: int, index: int) -> Link:
        """A greeted link to the listener at ``host:port`` over the bootstrap provider."""
        device = await self._bootstrap.connect(
            PeerOffer(host, port, None, None, None), self._settings, self._options(False)
        )
        return await self._greeted(device, index)

    def upgrades(self) -> list[Provider]:
        return self._upgrades

    async def direct(self, provider: Provider, host: str, port: int, offer: Any, index: int) -> Link:
        """A greeted link over ``provider`` to the listener at ``host:port``,
        which ``provider`` found by that address (its ``offer``), with no
        bootstrap link first."""
        # No port of ours stands for the device: port 0 in its local address.
        local = f"lci://{unparse_host_port(host, 0)}"
        peer = f"lci://{unparse_host_port(host, port)}"
        device = await provider.connect(
            PeerOffer(host, port, None, None, offer, local, peer),
            self._settings,
            self._options(False),
        )
        return await self._greeted_over(provider, device, index)

    async def upgrade(self, provider: Provider, first: Link, index: int) -> Link:
        """A greeted link over ``provider`` to the peer greeted on ``first``."""
        peer = first.protocol.peer
        assert peer is not None
        device = await provider.connect(
            PeerOffer(
                "", 0, peer.pid, peer.host, peer.offers[provider.name],
                first.device.local_address, first.device.peer_address,
            ),
            self._settings,
            self._options(False),
        )
        return await self._greeted_over(provider, device, index)

    async def _greeted_over(self, provider: Provider, device: Device, index: int) -> Link:
        try:
            return await self._greeted(device, index)
        except (OSError, asyncio.TimeoutError) as e:
            raise ProviderUnavailable(f"no greeting over {provider.name}: {e!r}") from e

    async def _greeted(self, device: Device, index: int) -> Link:
        link = self._adopt(device, index, None, {})
        try:
            self._aggregator.put(device, 0, Raw(link.protocol.greet().data))
            await asyncio.wait_for(link.greeted, connect_timeout())
        except BaseException:
            self.close(link)
            raise
        return link

    def finish(self, link: Link) -> None:
        """Close ``link`` gracefully: what is queued is sent, then the output
        ends and the link is closed. It closes at once when nothing is left to
        send: waiting for the peer's end would need the event loop to keep
        running, and a synchronous Client stops its loop right after closing.
        Only a link with sends in flight lingers, for at most :data:`LINGER`."""
        if not link.protocol.finish():
            return
        link.cancel_timer()
        try:
            sent = link.device.finish()
        except OSError:
            sent = True
        if sent:
            self.close(link)
        else:
            link.timer = self._loop.call_later(LINGER, self.close, link)

    def close(self, link: Link) -> None:
        """Close ``link`` now; its loss comes back as a completion, made
        visible at once: no other progress may come to carry it."""
        self._engine.remove(link.device)
        self._completion.flush()

    def lose(self, link: Link, reason: str, violation: bool) -> list[int] | None:
        """``link`` is gone: its protocol and its greeting learn it (once).
        The virtual connections we opened that the peer never answered, or
        None if the link was lost already."""
        peer = link.device.peer_address
        lost = link.protocol.lose(f"lci connection to {peer} lost: {reason}", violation)
        if lost is None:
            return None
        link.cancel_timer()
        if not link.greeted.done():
            if lost.not_a_peer:
                link.greeted.set_exception(NotAnLCIPeer(f"{peer} is not an lci:// listener: {reason}"))
            else:
                link.greeted.set_exception(
                    ConnectionResetError(f"connection to {peer} lost during greeting: {reason}")
                )
        return lost.opening

    def discard(self, link: Link) -> None:
        """``link``'s device is released: forget it."""
        self._links.discard(link)

    def release_all(self) -> None:
        """The event loop is gone: release every device without telling anyone."""
        links, self._links = self._links, set()
        for link in links:
            self._engine.remove(link.device)

    def release_memory(self) -> None:
        """No link is left: the memory kept for frames goes now, not when
        the releaser would have looked (the event loop may close first)."""
        if self._frames is not None:
            self._frames.release()
