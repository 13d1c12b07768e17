"""The parcelport: this process's lci:// endpoint on one event loop.

It owns the progress engine, the completion object, its links (see
:mod:`dask_lcicomm.link`) and the channels to remote listeners, and routes
each completion: a wire event to its link's protocol, whose effects it
carries out, and a send or a loss to whoever waits for it. Dask comms
between the same two processes are virtual connections multiplexed over one
channel, so a thousand comms do not cost a thousand sockets. The parcelport
exists while a link, channel or listener does; when the last one goes,
progress stops (and its threads exit). A loop that tornado closes with its
descriptors takes everything with it at once (see
:mod:`dask_lcicomm.loop_close`).

What uses a virtual connection knows it only as a
:class:`~dask_lcicomm.vconn.VirtualConnection`.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

from distributed.comm.addressing import unparse_host_port
from distributed.comm.core import CommClosedError

from dask_lcicomm.aggregation import Aggregator
from dask_lcicomm.channel import Channel
from dask_lcicomm.config import Settings
from dask_lcicomm.link import Link, Links, Listening
from dask_lcicomm.link_protocol import (
    Accepted,
    Effect,
    Greeted,
    LinkError,
    Opened,
    Receiver,
    Refused,
    Send,
    State,
)
from dask_lcicomm.loop_close import LoopCloseHook
from dask_lcicomm.progress import ProgressEngine, make_completion
from dask_lcicomm.providers import registry
from dask_lcicomm.providers.base import Device, DeviceClosed, DeviceLost, SendDone
from dask_lcicomm.providers.send_queue import Raw, Unit
from dask_lcicomm.vconn import VirtualConnection

logger = logging.getLogger(__name__)

SCHEME = "lci://"


class Parcelport:
    """One per event loop; get it with :meth:`current`."""

    _ports: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Parcelport]] = (
        weakref.WeakKeyDictionary()
    )

    @classmethod
    def current(cls) -> Parcelport:
        """The parcelport of the running event loop, created on first use."""
        loop = asyncio.get_running_loop()
        port = cls._ports.get(loop)
        if port is None:
            port = cls._ports[loop] = cls(loop, registry.checked(Settings.from_config()))
        return port

    def __init__(self, loop: asyncio.AbstractEventLoop, settings: Settings) -> None:
        self.loop = loop
        self.settings = settings
        self.completion = make_completion(
            settings.completion, loop, self._handle, threadsafe=settings.progress == "thread"
        )
        self.engine = ProgressEngine(
            loop,
            settings.progress,
            self.completion,
            nthreads=settings.progress_threads,
            poll_interval=settings.poll_interval,
        )
        self._aggregator = Aggregator(loop, self.completion, settings.aggregation)
        self.links = Links(loop, settings, self.completion, self.engine, self._aggregator, self._overdue)
        self._channels: dict[str, Channel] = {}
        self._listenings: set[Listening] = set()
        self._accepts: dict[tuple[Link, int], asyncio.Future[None]] = {}
        self.closed = False
        self._loop_close = LoopCloseHook(self._loop_closed)

    def _maybe_shut_down(self) -> None:
        if self.links or self._listenings or self._channels or self.closed:
            return
        self._shut_down()

    def _shut_down(self) -> None:
        self.closed = True
        if self._ports.get(self.loop) is self:
            del self._ports[self.loop]
        self._loop_close.cancel()
        self.engine.close()
        self.links.release_memory()

    def _loop_closed(self) -> None:
        """The event loop is closed with its descriptors while listeners or
        links are left (servers nobody closed): release them now, as tornado
        closes tcp's sockets. Nothing runs on the loop any more, so nobody
        is told."""
        if self.closed:
            return
        listenings, self._listenings = self._listenings, set()
        for listening in listenings:
            listening.close()
        self.links.release_all()
        self._channels.clear()
        self._shut_down()

    def listen(
        self, host: str | None, port: int, accept: Callable[[VirtualConnection], None]
    ) -> Listening:
        """Accept peers at ``host:port``; ``accept`` gets each virtual
        connection a peer opens. Nothing stays open on failure."""
        try:
            listening = self.links.listen(host, port, accept)
        except BaseException:
            self._maybe_shut_down()
            raise
        self._listenings.add(listening)
        return listening

    def stop_listening(self, listening: Listening) -> None:
        listening.close()
        self._listenings.discard(listening)
        self._maybe_shut_down()

    def _overdue(self, link: Link) -> None:
        if link.protocol.state is State.GREETING:
            self._violation(link, "no greeting in time")

    def _forget(self, channel: Channel) -> None:
        if self._channels.get(channel.key) is channel:
            del self._channels[channel.key]
        self._maybe_shut_down()

    def connections(self) -> list[dict[str, Any]]:
        """What each device connects to and over which provider (diagnostics)."""
        return [link.describe() for link in self.links if not link.device.lost]

    # -- virtual connections ---------------------------------------------------

    async def connect(self, host: str, port: int) -> VirtualConnection:
        """Open a virtual connection to the listener at ``host:port``."""
        key = unparse_host_port(host, port)
        channel = self._channels.get(key)
        if channel is None:
            channel = Channel(self.links, key, self.settings.ndevices, self._forget)
            self._channels[key] = channel
            channel.start(host, port)
        link, vc = await channel.allocate()
        vconn = VirtualConnection(self, link, vc)
        accepted = self._accepts[link, vc] = self.loop.create_future()
        try:
            self.send(link, vc, Raw(link.protocol.open_vc(vc, vconn).data))
            await accepted
        except (DeviceClosed, LinkError) as e:
            vconn.abort()
            raise CommClosedError(f"channel to {SCHEME}{key} closed: {e}") from e
        except BaseException:
            vconn.abort()
            raise
        finally:
            self._accepts.pop((link, vc), None)
        return vconn

    def send(self, link: Link, vc: int, unit: Unit, token: Any = None) -> None:
        """Queue ``unit`` on ``link``'s device; raises :class:`DeviceClosed`."""
        self._aggregator.put(link.device, vc, unit, token)

    def close_vc(
        self, link: Link, vc: int, receiver: Receiver, token: asyncio.Future[None] | None
    ) -> bool:
        """``receiver`` closed its end of ``vc``: tell the peer, free the id,
        maybe the channel. True when a CLOSE was queued; its sending completes
        ``token``."""
        close = link.protocol.close_vc(vc, receiver)
        if close is None:
            return False
        try:
            self.send(link, vc, Raw(close.data), token)
            queued = True
        except DeviceClosed:
            queued = False
        if link.owner is not None:
            link.owner.link_idle(link)
        return queued

    # -- completions ----------------------------------------------------------

    def _handle(self, batch: list[tuple[Device, Any]]) -> None:
        """Route a batch of completions (on the event loop). A failure routing
        one completion is logged and must not lose the rest of the batch."""
        for device, event in batch:
            try:
                self._dispatch(device.context, event)
            except Exception:
                logger.exception(
                    "failed to handle %s from %s", type(event).__name__, device.peer_address
                )

    def _dispatch(self, link: Link, event: Any) -> None:
        kind = type(event)
        if kind is SendDone:
            if not event.token.done():
                event.token.set_result(None)
        elif kind is DeviceLost:
            self._lost(link, event)
        else:
            for effect in link.protocol.receive(event):
                if not self._apply(link, effect):
                    break

    def _apply(self, link: Link, effect: Effect) -> bool:
        """Carry out one effect of the link's protocol; False voids the rest."""
        if isinstance(effect, Send):
            try:
                self.send(link, effect.vc, Raw(effect.data))
            except DeviceClosed:
                return False
        elif isinstance(effect, Greeted):
            link.cancel_timer()
            if not link.greeted.done():
                link.greeted.set_result(None)
        elif isinstance(effect, Opened):
            self._settle(link, effect.vc, None)
        elif isinstance(effect, Refused):
            refused = f"{link.device.peer_address} refused a new comm: listener stopped"
            self._settle(link, effect.vc, ConnectionRefusedError(refused))
            if link.owner is not None:
                link.owner.retire()
        elif isinstance(effect, Accepted):
            listening = link.protocol.acceptor
            assert isinstance(listening, Listening)
            vconn = VirtualConnection(self, link, effect.vc)
            link.protocol.attach(effect.vc, vconn)
            listening.accept(vconn)
        else:
            self._violation(link, effect.reason)
        return True

    def _settle(self, link: Link, vc: int, error: BaseException | None) -> None:
        """The peer answered the virtual connection ``vc`` we opened."""
        accepted = self._accepts.get((link, vc))
        if accepted is None or accepted.done():
            return
        if error is None:
            accepted.set_result(None)
        else:
            accepted.set_exception(error)

    def _violation(self, link: Link, reason: str) -> None:
        """The peer broke the protocol: this link goes, nothing else."""
        if link.protocol.state is State.LOST:
            return
        device = link.device
        logger.warning(
            "closing lci connection %s <-> %s: %s", device.local_address, device.peer_address, reason
        )
        self._lose(link, reason, violation=True)
        self.links.close(link)

    def _lost(self, link: Link, event: DeviceLost) -> None:
        """The device is released: fail what it will never send, forget it."""
        error = CommClosedError(f"lci connection to {link.device.peer_address} lost: {event.reason}")
        for token in event.tokens:
            if not token.done():
                token.set_exception(error)
        self._lose(link, event.reason, event.violation)
        self.links.close(link)
        self.links.discard(link)
        self._maybe_shut_down()

    def _lose(self, link: Link, reason: str, violation: bool) -> None:
        """Everything that rides on ``link`` learns that it is gone (once)."""
        opening = self.links.lose(link, reason, violation)
        if opening is None:
            return
        error = f"lci connection to {link.device.peer_address} lost: {reason}"
        for vc in opening:
            self._settle(link, vc, ConnectionResetError(error))
        if link.owner is not None:
            link.owner.link_lost(link)


async def connections() -> list[dict[str, Any]]:
    """The lci:// devices of the calling event loop's process and their
    providers, for diagnostics: ``client.run(connections)`` asks every worker."""
    port = Parcelport._ports.get(asyncio.get_running_loop())
    return port.connections() if port is not None else []
