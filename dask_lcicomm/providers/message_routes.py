"""What a message fabric routes to: its devices, by the route in every tag
(:mod:`.message_tags`), and its listeners, by number, which make a device
for each hello (:mod:`.message_fabric`)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dask_lcicomm.providers.base import Device


class RoutedDevice(Device):
    """A device of the shared fabric: what the fabric asks of it. The fabric
    calls these under its lock."""

    route: int

    @abstractmethod
    def arrived(self, kind: int, number: int, nbytes: int, message: Any, data: Any) -> bool:
        """Receive ``message`` (a handle from :meth:`MessageFabric.take`),
        or take its ``data`` where it came with it; or raise
        ``ProtocolError`` before receiving anything. True when the fabric
        now works for the device (a receive or read under way)."""

    @abstractmethod
    def reap(self) -> bool:
        """Take what the fabric completed; True when the device has news."""

    @property
    @abstractmethod
    def busy(self) -> bool:
        """Whether the fabric has work of this device under way."""

    @abstractmethod
    def violated(self, reason: str) -> None:
        """The peer broke the protocol; the device is to be lost."""

    @abstractmethod
    def peer_failed(self) -> None:
        """The fabric reports the peer unreachable."""

    @abstractmethod
    def welcome(self) -> None:
        """Answer the peer's hello with this device's route."""

    @property
    @abstractmethod
    def unposted(self) -> bool:
        """Whether the fabric answered "retry" to a message not yet posted."""


#: A handle for the peer a device answers, and the device's local and peer addresses.
Answer = tuple[Any, str, str]


@dataclass(frozen=True)
class Listener:
    """A listener's part of the fabric: how it makes and hands over devices."""

    #: ``make(peer, peer_route, local_address, peer_address)``.
    make: Callable[[Any, int, str, str], RoutedDevice]
    accepted: Callable[[Device], None]
