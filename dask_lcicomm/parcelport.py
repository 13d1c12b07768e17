"""The parcelport: this process's lci:// endpoint on one event loop.

It owns the progress engine, the completion object, every link (a device and
what rides on it) and the channels to remote listeners, and it routes each
completion to its link and virtual connection. Dask comms between the same
two processes are virtual connections multiplexed over one channel, so a
thousand comms do not cost a thousand sockets. The parcelport exists while a
link, channel or listener does; when the last one goes, progress stops (and
its threads exit). A loop that tornado closes with its descriptors takes
everything with it at once (see :mod:`dask_lcicomm.loop_close`).

It knows providers only through :mod:`dask_lcicomm.providers.registry`, and
what uses a virtual connection only as a :class:`~dask_lcicomm.vconn.VirtualConnection`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

from distributed.comm.addressing import unparse_host_port
from distributed.comm.core import CommClosedError, FatalCommClosedError

from dask_lcicomm.channel import Channel
from dask_lcicomm.config import Settings
from dask_lcicomm.link import Greeting, Link, State, Step
from dask_lcicomm.loop_close import LoopCloseHook
from dask_lcicomm.parcel import (
    Close,
    Connect,
    Hello,
    Limits,
    Message,
    encode_close,
    encode_connect,
    encode_hello,
)
from dask_lcicomm.progress import ProgressEngine, make_completion
from dask_lcicomm.providers import registry
from dask_lcicomm.providers.base import (
    Device,
    DeviceClosed,
    DeviceLost,
    DeviceOptions,
    SendDone,
    connect_timeout,
)
from dask_lcicomm.providers.registry import Offering, PeerOffer, Provider, ProviderUnavailable
from dask_lcicomm.providers.send_queue import Raw, Unit
from dask_lcicomm.vconn import VirtualConnection

logger = logging.getLogger(__name__)

SCHEME = "lci://"
#: How long a closing link waits for the peer's end before it is closed hard.
LINGER = 10.0


@functools.cache
def _report_unavailable(name: str, reason: str) -> None:
    """Log once per process, not once per event loop: every parcelport of a
    process sees the same reason."""
    logger.warning("lci:// provider %s is unavailable: %s", name, reason)


class NotAnLCIPeer(FatalCommClosedError):
    """The peer answered in another protocol: retrying cannot help."""


class Listening:
    """A listener's registration: the providers accepting for it, and what
    becomes of the virtual connections its peers open."""

    def __init__(self, accept: Callable[[VirtualConnection], None]) -> None:
        self.accept = accept
        self.active = True
        self.offerings: list[Offering] = []
        self.offers: dict[str, Any] = {}
        self.address: tuple[str, int] | None = None

    def close(self) -> None:
        self.active = False
        offerings, self.offerings = self.offerings, []
        for offering in offerings:
            offering.close()


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
            port = cls._ports[loop] = cls(loop, Settings.from_config())
        return port

    def __init__(self, loop: asyncio.AbstractEventLoop, settings: Settings) -> None:
        self.loop = loop
        self.settings = settings
        self.limits = Limits(
            max_message_bytes=settings.max_message_bytes,
            max_frames=settings.max_frames,
            max_eager_bytes=settings.max_eager_bytes,
        )
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
        self._identity: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname()}
        self._bootstrap = registry.get(registry.BOOTSTRAP)
        offered = registry.offered(settings)
        self.unusable = self._unusable(offered)
        self.bootstrap_allowed = registry.bootstrap_allowed(settings)
        self._offered = [p for p in offered if p.name not in self.unusable]
        self._upgrades = [p for p in registry.upgrades(settings) if p in self._offered]
        self._links: set[Link] = set()
        self._channels: dict[str, Channel] = {}
        self._listenings: set[Listening] = set()
        self._accepts: dict[tuple[Link, int], asyncio.Future[None]] = {}
        self._unflushed: dict[Device, None] = {}
        self._flush_handle: asyncio.Handle | None = None
        self.closed = False
        self._loop_close = LoopCloseHook(self._loop_closed)

    @staticmethod
    def _unusable(providers: list[Provider]) -> dict[str, str]:
        """Why each provider this process cannot run is left out."""
        unusable = {}
        for provider in providers:
            reason = provider.unavailable()
            if reason is not None:
                _report_unavailable(provider.name, reason)
                unusable[provider.name] = reason
        return unusable

    def _maybe_shut_down(self) -> None:
        if self._links or self._listenings or self._channels or self.closed:
            return
        self._shut_down()

    def _shut_down(self) -> None:
        self.closed = True
        if self._ports.get(self.loop) is self:
            del self._ports[self.loop]
        self._loop_close.cancel()
        self.engine.close()

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
        links, self._links = self._links, set()
        for link in links:
            self.engine.remove(link.device)
        self._channels.clear()
        self._shut_down()

    def _options(self, accepting: bool) -> DeviceOptions:
        return DeviceOptions(
            completion=self.completion,
            want_write=self.engine.want_write,
            limits=self.limits,
            batch_bytes=self.settings.fragment_size,
            accepting=accepting,
        )

    def _hello(self, offers: dict[str, Any]) -> bytes:
        identity = self._identity
        return encode_hello(Greeting(identity["pid"], identity["host"], self.limits, offers).encode())

    # -- listening ------------------------------------------------------------

    def listen(
        self, host: str | None, port: int, accept: Callable[[VirtualConnection], None]
    ) -> Listening:
        """Accept peers at ``host:port`` over the bootstrap provider and offer
        them every other provider this process runs; ``accept`` gets each
        virtual connection a peer opens. Nothing stays open on failure."""
        listening = Listening(accept)
        options = self._options(accepting=True)

        def accepted(device: Device) -> None:
            self._accepted_device(device, listening)

        try:
            boot = self._bootstrap.listen(host, port, self.settings, options, accepted)
            listening.offerings.append(boot)
            listening.address = boot.address
            bound_host = boot.address[0] if boot.address else host
            for provider in self._offered:
                offering = provider.listen(bound_host, 0, self.settings, options, accepted)
                listening.offerings.append(offering)
                listening.offers[provider.name] = offering.offer
        except BaseException:
            listening.close()
            self._maybe_shut_down()
            raise
        self._listenings.add(listening)
        return listening

    def stop_listening(self, listening: Listening) -> None:
        listening.close()
        self._listenings.discard(listening)
        self._maybe_shut_down()

    def _accepted_device(self, device: Device, listening: Listening) -> None:
        link = self._adopt(device, 0, self._hello(listening.offers), listening)
        # A peer that never greets must not hold a link forever.
        link.timer = self.loop.call_later(
            connect_timeout(), self._overdue, link
        )

    def _overdue(self, link: Link) -> None:
        if link.state is State.GREETING:
            self._violation(link, "no greeting in time")

    # -- links --------------------------------------------------------------

    def _adopt(self, device: Device, index: int, hello: bytes, acceptor: Listening | None) -> Link:
        link = Link(device, index, hello, acceptor, self.loop)
        device.context = link
        self._links.add(link)
        self.engine.add(device)
        return link

    async def bootstrap(self, host: str, port: int, index: int) -> Link:
        """A greeted link to the listener at ``host:port`` over the bootstrap provider."""
        device = await self._bootstrap.connect(
            PeerOffer(host, port, None, None, None), self.settings, self._options(False)
        )
        return await self._greeted(device, index)

    def upgrades(self) -> list[Provider]:
        return self._upgrades

    async def upgrade(self, provider: Provider, first: Link, index: int) -> Link:
        """A greeted link over ``provider`` to the peer greeted on ``first``."""
        peer = first.peer
        assert peer is not None
        device = await provider.connect(
            PeerOffer(
                "", 0, peer.pid, peer.host, peer.offers[provider.name],
                first.device.local_address, first.device.peer_address,
            ),
            self.settings,
            self._options(False),
        )
        try:
            return await self._greeted(device, index)
        except (OSError, asyncio.TimeoutError) as e:
            raise ProviderUnavailable(f"no greeting over {provider.name}: {e!r}") from e

    async def _greeted(self, device: Device, index: int) -> Link:
        link = self._adopt(device, index, self._hello({}), None)
        try:
            self.send(link, 0, Raw(link.hello))
            await asyncio.wait_for(link.greeted, connect_timeout())
        except BaseException:
            self._close(link)
            raise
        return link

    def finish(self, link: Link) -> None:
        """Close ``link`` gracefully: what is queued is sent, then the output
        ends and the link is closed. It closes at once when nothing is left to
        send: waiting for the peer's end would need the event loop to keep
        running, and a synchronous Client stops its loop right after closing.
        Only a link with sends in flight lingers, for at most :data:`LINGER`."""
        if link.state not in (State.GREETING, State.OPEN):
            return
        link.advance(Step.FINISH)
        if link.timer is not None:
            link.timer.cancel()
            link.timer = None
        try:
            sent = link.device.finish()
        except OSError:
            sent = True
        if sent:
            self._close(link)
        else:
            link.timer = self.loop.call_later(LINGER, self._close, link)

    def _close(self, link: Link) -> None:
        """Close ``link`` now; its loss comes back as a completion, made
        visible at once: no other progress may come to carry it."""
        self.engine.remove(link.device)
        self.completion.flush()

    def forget(self, channel: Channel) -> None:
        if self._channels.get(channel.key) is channel:
            del self._channels[channel.key]
        self._maybe_shut_down()

    def connections(self) -> list[dict[str, Any]]:
        """What each device connects to and over which provider (diagnostics)."""
        return [link.describe() for link in self._links if not link.device.lost]

    # -- virtual connections ---------------------------------------------------

    async def connect(self, host: str, port: int) -> VirtualConnection:
        """Open a virtual connection to the listener at ``host:port``."""
        key = unparse_host_port(host, port)
        channel = self._channels.get(key)
        if channel is None:
            channel = self._channels[key] = Channel(self, key, self.settings.ndevices)
            channel.start(host, port)
        link, vc = await channel.allocate()
        vconn = VirtualConnection(self, link, vc)
        link.vcs[vc] = vconn
        accepted = self._accepts[link, vc] = self.loop.create_future()
        try:
            self.send(link, vc, Raw(encode_connect(vc)))
            await accepted
        except DeviceClosed as e:
            vconn.abort()
            raise CommClosedError(f"channel to {SCHEME}{key} closed: {e}") from e
        except BaseException:
            vconn.abort()
            raise
        finally:
            self._accepts.pop((link, vc), None)
        return vconn

    def send(self, link: Link, vc: int, unit: Unit, token: Any = None) -> None:
        """Queue ``unit`` on ``link``'s device; raises :class:`DeviceClosed`.

        Without aggregation the parcel leaves at once (as far as the device
        is not busy). With it, the first send of an event-loop iteration
        leaves at once and whatever is written after it in the same
        iteration, by any comm, leaves together when the iteration is over;
        a backlog of ``fragment-size`` bytes is flushed at once.
        """
        device = link.device
        if device.put(vc, unit, token) or not self.settings.aggregation:
            self._flush_device(device)
        elif self._flush_handle is None:
            self._flush_handle = self.loop.call_soon(self._flush)
            self._flush_device(device)
        else:
            self._unflushed[device] = None

    def _flush_device(self, device: Device) -> None:
        device.flush()
        self.completion.flush()

    def _flush(self) -> None:
        self._flush_handle = None
        devices, self._unflushed = self._unflushed, {}
        for device in devices:
            device.flush()
        self.completion.flush()

    def release(self, link: Link, vc: int) -> None:
        """The local side of ``vc`` closed: free the id, maybe the channel."""
        if link.vcs.pop(vc, None) is not None and link.owner is not None:
            link.owner.link_idle(link)

    # -- completions ----------------------------------------------------------

    def _handle(self, batch: list[tuple[Device, Any]]) -> None:
        """Route a batch of completions (runs on the event loop).

        A failure routing one completion is logged and must not lose the rest
        of the batch.
        """
        for device, event in batch:
            try:
                self._dispatch(device.context, event)
            except Exception:
                logger.exception(
                    "failed to handle %s from %s", type(event).__name__, device.peer_address
                )

    def _dispatch(self, link: Link, event: Any) -> None:
        kind = type(event)
        if kind is Message:
            receiver = link.vcs.get(event.vc)
            if receiver is not None:
                receiver.deliver(event.frames)
            elif not link.accepts(event):
                self._violation(link, f"parcel in state {link.state.value}")
        elif kind is SendDone:
            if not event.token.done():
                event.token.set_result(None)
        elif kind is DeviceLost:
            self._lost(link, event)
        elif not link.accepts(event):
            self._violation(link, f"{kind.__name__} in state {link.state.value}")
        elif kind is Hello:
            self._greet(link, event.payload)
        elif kind is Connect:
            if link.acceptor is None:
                self._connected(link, event.vc)
            else:
                self._open_vc(link, event.vc)
        elif kind is Close:
            receiver = link.vcs.get(event.vc)
            if receiver is not None:
                self._refused(link, event.vc)
                receiver.peer_closed("closed by peer")

    def _greet(self, link: Link, payload: bytes) -> None:
        try:
            link.peer = Greeting.decode(payload)
        except ValueError as e:
            self._violation(link, f"malformed HELLO: {e}")
            return
        link.advance(Step.GREETED)
        if link.timer is not None:
            link.timer.cancel()
            link.timer = None
        if link.acceptor is not None:
            try:
                self.send(link, 0, Raw(link.hello))
            except DeviceClosed:
                return
        if not link.greeted.done():
            link.greeted.set_result(None)

    def _connected(self, link: Link, vc: int) -> None:
        accepted = self._accepts.get((link, vc))
        if accepted is None:
            self._violation(link, f"unexpected CONNECT for vc {vc}")
        elif not accepted.done():
            accepted.set_result(None)

    def _refused(self, link: Link, vc: int) -> None:
        accepted = self._accepts.get((link, vc))
        if accepted is not None and not accepted.done():
            accepted.set_exception(
                ConnectionRefusedError(f"{link.device.peer_address} refused a new comm: listener stopped")
            )
            if link.owner is not None:
                link.owner.retire()

    def _open_vc(self, link: Link, vc: int) -> None:
        """The peer opens ``vc``: accept it if our listener still listens."""
        listening = link.acceptor
        assert isinstance(listening, Listening)
        if not (listening.active and link.open):
            logger.debug("refused vc %d from %s: listener stopped", vc, link.device.peer_address)
            try:
                self.send(link, vc, Raw(encode_close(vc)))
            except DeviceClosed:
                pass
            return
        try:
            self.send(link, vc, Raw(encode_connect(vc)))
        except DeviceClosed:
            return
        vconn = VirtualConnection(self, link, vc)
        link.vcs[vc] = vconn
        listening.accept(vconn)

    def _violation(self, link: Link, reason: str) -> None:
        """The peer broke the protocol: this link goes, nothing else."""
        if link.state is State.LOST:
            return
        device = link.device
        logger.warning(
            "closing lci connection %s <-> %s: %s", device.local_address, device.peer_address, reason
        )
        self._lose(link, reason, violation=True)
        self._close(link)

    def _lost(self, link: Link, event: DeviceLost) -> None:
        """The device is released: fail what it will never send, forget it."""
        error = CommClosedError(f"lci connection to {link.device.peer_address} lost: {event.reason}")
        for token in event.tokens:
            if not token.done():
                token.set_exception(error)
        self._lose(link, event.reason, event.violation)
        self._close(link)
        self._links.discard(link)
        self._maybe_shut_down()

    def _lose(self, link: Link, reason: str, violation: bool) -> None:
        """Everything that rides on ``link`` learns that it is gone (once)."""
        if link.state is State.LOST:
            return
        greeting = link.state is State.GREETING
        link.advance(Step.LOSE)
        if link.timer is not None:
            link.timer.cancel()
            link.timer = None
        peer = link.device.peer_address
        if not link.greeted.done():
            if greeting and violation:
                link.greeted.set_exception(NotAnLCIPeer(f"{peer} is not an lci:// listener: {reason}"))
            else:
                link.greeted.set_exception(
                    ConnectionResetError(f"connection to {peer} lost during greeting: {reason}")
                )
        error = f"lci connection to {peer} lost: {reason}"
        receivers = list(link.vcs.items())
        link.vcs.clear()
        for vc, receiver in receivers:
            accepted = self._accepts.get((link, vc))
            if accepted is not None and not accepted.done():
                accepted.set_exception(ConnectionResetError(error))
            receiver.peer_closed(error)
        if link.owner is not None:
            link.owner.link_lost(link)


async def connections() -> list[dict[str, Any]]:
    """The lci:// devices of the calling event loop's process and their
    providers, for diagnostics: ``client.run(connections)`` asks every worker."""
    port = Parcelport._ports.get(asyncio.get_running_loop())
    return port.connections() if port is not None else []
