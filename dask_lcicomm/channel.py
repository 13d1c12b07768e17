"""A channel: the links that connect this parcelport to one remote listener.

Every comm a process opens to the same listener becomes a virtual connection
on the channel; with ``ndevices`` > 1 the virtual connections are spread over
replicated devices (LCI's answer to contention on one network queue). The
channel closes its links once its last virtual connection is gone.

The provider is chosen when the channel opens. When the most preferred
provider finds the listener by its address alone (shared memory with a
listener on this host), all devices connect and greet over it directly.
Otherwise, or if that fails, the first link connects over the bootstrap
provider and greets the listener; then each provider the listener offered,
that we prefer to the bootstrap, is tried in turn for all devices, and the
first that connects is used (the bootstrap link closes); if none does, the
channel stays on the bootstrap, unless the configuration leaves the
bootstrap out: then opening fails at once, saying why each provider did not
connect.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from distributed.comm.core import FatalCommClosedError

from dask_lcicomm.link import Link
from dask_lcicomm.parcel import MAX_VC
from dask_lcicomm.providers.registry import Provider, ProviderUnavailable

logger = logging.getLogger(__name__)

#: Seconds opened links wait for a comm when whoever asked for them gave up.
GRACE = 2.0


class NoProvider(FatalCommClosedError):
    """None of the providers the configuration requires reaches the peer."""


class Opener(Protocol):
    """How a channel gets its links (:class:`~dask_lcicomm.link.Links`)."""

    #: Whether a channel may stay on the bootstrap provider.
    bootstrap_allowed: bool
    #: Why each configured provider this process cannot run is left out.
    unusable: dict[str, str]

    def bootstrap(self, host: str, port: int, index: int) -> Awaitable[Link]:
        """A greeted link over the bootstrap provider."""

    def upgrades(self) -> list[Provider]:
        """Providers to try after the bootstrap link, in order of preference."""

    def upgrade(self, provider: Provider, first: Link, index: int) -> Awaitable[Link]:
        """A greeted link over ``provider`` to the peer greeted on ``first``."""

    def direct(self, provider: Provider, host: str, port: int, offer: Any, index: int) -> Awaitable[Link]:
        """A greeted link over ``provider``, which found the listener by its address."""

    def finish(self, link: Link) -> None:
        """Close ``link`` gracefully."""


class Channel:
    """The links to the listener at ``key``, opened once, shared by its comms."""

    def __init__(
        self, opener: Opener, key: str, ndevices: int, forget: Callable[[Channel], None]
    ) -> None:
        self._opener = opener
        #: Called once the channel is closed.
        self._forget = forget
        self.key = key
        self._ndevices = ndevices
        self.links: list[Link] = []
        self.closed = False
        self._opening: asyncio.Task[None] | None = None
        self._pending = 0
        self._next_vc = 1
        self._grace: asyncio.TimerHandle | None = None

    def start(self, host: str, port: int) -> None:
        """Begin connecting the links; :meth:`allocate` waits for them."""
        self._opening = asyncio.ensure_future(self._open(host, port))
        # Retrieved here so that a failure nobody waited for is not reported.
        self._opening.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def _open(self, host: str, port: int) -> None:
        # The channel's state changes inside the task, so that whoever sees
        # the task done sees the links too (a done-callback would run later).
        try:
            links = await self._open_links(host, port)
        except BaseException:
            self.closed = True
            self._forget(self)
            raise
        if self.closed:
            for link in links:
                self._opener.finish(link)
            return
        self.links = links
        for link in links:
            link.owner = self
        if not self._pending:
            # Everyone who asked gave up waiting (Dask's connect() retries
            # after a deadline of its own): keep the links a moment for the
            # retry instead of closing them now and opening them again.
            self._grace = asyncio.get_running_loop().call_later(GRACE, self._maybe_close)

    async def _open_links(self, host: str, port: int) -> list[Link]:
        direct = await self._open_direct(host, port)
        if direct is not None:
            return direct
        n = self._ndevices
        opener = self._opener
        first = await opener.bootstrap(host, port, 0)
        assert first.protocol.peer is not None
        reasons = dict(opener.unusable)
        try:
            for provider in opener.upgrades():
                if provider.name not in first.protocol.peer.offers:
                    reasons[provider.name] = "the peer does not offer it"
                    continue
                try:
                    links = await self._all(opener.upgrade(provider, first, i) for i in range(n))
                except ProviderUnavailable as e:
                    logger.info("channel to %s does not use %s: %s", self.key, provider.name, e)
                    reasons[provider.name] = str(e)
                    continue
                opener.finish(first)
                return links
            if not opener.bootstrap_allowed:
                raise NoProvider(
                    f"no required lci:// provider reaches {self.key}: "
                    + "; ".join(f"{name}: {why}" for name, why in reasons.items())
                )
            return [first, *await self._all(opener.bootstrap(host, port, i) for i in range(1, n))]
        except BaseException:
            opener.finish(first)
            raise

    async def _open_direct(self, host: str, port: int) -> list[Link] | None:
        """The links over the most preferred provider if it finds the
        listener by its address; None to ask over the bootstrap (the reason
        a direct attempt failed is logged at debug: the bootstrap path tries
        again and says why)."""
        upgrades = self._opener.upgrades()
        if not upgrades:
            return None
        provider = upgrades[0]
        offer = provider.direct(host, port)
        if offer is None:
            return None
        try:
            return await self._all(
                self._opener.direct(provider, host, port, offer, i) for i in range(self._ndevices)
            )
        except ProviderUnavailable as e:
            logger.debug("channel to %s does not start on %s: %s", self.key, provider.name, e)
            return None

    async def _all(self, openings: Iterable[Awaitable[Link]]) -> list[Link]:
        """Open links concurrently; if any fails, close the others and raise."""
        results = await asyncio.gather(*openings, return_exceptions=True)
        links = [r for r in results if isinstance(r, Link)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for link in links:
                self._opener.finish(link)
            raise errors[0]
        return links

    async def allocate(self) -> tuple[Link, int]:
        """A link and a fresh virtual-connection id on it."""
        assert self._opening is not None
        self._pending += 1
        try:
            await asyncio.shield(self._opening)
        except BaseException:
            self._pending -= 1
            if self._opening.done():
                # Cancelled after the links were ready: nobody else may come.
                self._maybe_close()
            raise
        self._pending -= 1
        if self.closed or not self.links:
            self._maybe_close()
            raise ConnectionResetError(f"channel to {self.key} closed while connecting")
        vc = self._next_vc
        if vc > MAX_VC:
            raise ConnectionError(f"channel to {self.key} ran out of virtual connection ids")
        self._next_vc += 1
        return self.links[vc % len(self.links)], vc

    def link_idle(self, link: Link) -> None:
        """A virtual connection closed on one of our links."""
        self._maybe_close()

    def link_lost(self, link: Link) -> None:
        """One link died: the channel is broken; close the rest."""
        self._close()

    def retire(self) -> None:
        """The listener refused a virtual connection: it is not the one we
        connected to any more. Open no more virtual connections here; close
        when the last one is gone."""
        self.closed = True
        self._forget(self)
        self._maybe_close()

    def _maybe_close(self) -> None:
        """Close once opened (or broken) with no virtual connection and nobody waiting."""
        if self._pending or any(link.vcs for link in self.links):
            return
        if self.links or self.closed:
            self._close()

    def _close(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        self.closed = True
        links, self.links = self.links, []
        for link in links:
            self._opener.finish(link)
        self._forget(self)
