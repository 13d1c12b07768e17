"""Fabric providers behind one interface, found by name.

A provider is a module ``dask_lcicomm.providers.<name>`` whose ``PROVIDER``
attribute implements :class:`Provider`; adding a fabric is adding one module
and naming it in ``distributed.comm.lci.providers``. The parcelport and the
listener only ever talk to this interface.

A channel starts on the *bootstrap* provider (``tcp``): it reaches every
peer and carries the greeting in which a listener offers the other providers
it runs. The connecting side then tries the offered providers it prefers to
the bootstrap, in its configured order, and keeps the first that connects.
A list without the bootstrap still greets over it, but no channel may stay
on it: a peer none of the listed providers reaches is an error. Only when
the most preferred provider finds the listener by its address alone
(:meth:`Provider.direct`: shared memory on this host) does a channel start
there, with no bootstrap connection.

A provider whose module cannot be imported here (a dependency or a compiled
helper is missing) is unavailable, with the import error as the reason: the
package installs and runs without any of them.
"""

from __future__ import annotations

import functools
import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed.comm.core import FatalCommClosedError

from dask_lcicomm.config import Section, Settings
from dask_lcicomm.providers.base import Device, DeviceOptions

if TYPE_CHECKING:
    from dask_lcicomm.providers.frame_memory import FrameMemory

logger = logging.getLogger(__name__)

BOOTSTRAP = "tcp"


class NotAnLCIPeer(FatalCommClosedError):
    """The peer answered in another protocol: retrying cannot help."""


class ProviderUnavailable(ConnectionError):
    """This provider cannot be used with this peer; the reason says why."""


@dataclass(frozen=True)
class PeerOffer:
    """What the connecting side knows of a peer when it tries a provider."""

    host: str
    port: int
    #: The peer process's id and host name, from its greeting (None before one).
    pid: Any
    hostname: Any
    #: What the peer's listener offered for this provider (None for the
    #: bootstrap), or what :meth:`Provider.direct` found.
    offer: Any
    #: The addresses the new device stands for (the bootstrap device's, if any).
    local_address: str = ""
    peer_address: str = ""


@dataclass
class Offering:
    """A provider accepting for one listener; close it with the listener."""

    close: Callable[[], None]
    #: Goes into the listener's greeting so that peers can connect (JSON).
    offer: Any = None
    #: The bound (host, port) of the bootstrap provider.
    address: tuple[str, int] | None = None


class Provider(ABC):
    """One fabric: how to accept and how to connect devices over it."""

    name: str
    #: The options the provider declares (``distributed.comm.lci.<name>.*``), if any.
    section: Section | None = None

    def unavailable(self) -> str | None:
        """Why this process cannot use the provider at all, or None."""
        return None

    @abstractmethod
    def listen(
        self,
        host: str | None,
        port: int,
        settings: Settings,
        options: DeviceOptions,
        accepted: Callable[[Device], None],
    ) -> Offering:
        """Start accepting peers; ``accepted`` gets each new device.

        The bootstrap provider binds ``host:port``; the others get the
        address it is bound to, so that peers that reach it reach them too
        (and a provider may name its endpoint after it, see :meth:`direct`).
        On failure nothing stays open.
        """

    def direct(self, host: str, port: int) -> Any:
        """The offer of the listener at ``host:port`` when this provider finds
        it by that address alone (a listener on this host), so that no
        bootstrap connection needs to ask for it; None otherwise."""
        return None

    @abstractmethod
    async def connect(self, peer: PeerOffer, settings: Settings, options: DeviceOptions) -> Device:
        """A device connected to ``peer``; :class:`ProviderUnavailable` (or
        ``OSError`` for the bootstrap) when that cannot be."""


class _Unimportable(Provider):
    """Stands for a provider module that cannot be imported in this process."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self._reason = reason

    def unavailable(self) -> str:
        return self._reason

    def listen(self, *args: Any, **kwargs: Any) -> Offering:
        raise ProviderUnavailable(self._reason)

    async def connect(self, *args: Any, **kwargs: Any) -> Device:
        raise ProviderUnavailable(self._reason)


@functools.cache
def get(name: str) -> Provider:
    """The provider called ``name``; ``ValueError`` if there is none."""
    module_name = f"{__package__}.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            return _Unimportable(name, str(e))
        raise ValueError(f"no lci:// provider called {name!r}") from e
    except ImportError as e:
        return _Unimportable(name, str(e))
    try:
        provider = module.PROVIDER
    except AttributeError as e:
        raise ValueError(f"no lci:// provider called {name!r}: {e}") from e
    if not isinstance(provider, Provider):
        raise ValueError(f"{module.__name__}.PROVIDER is not a Provider")
    return provider


def checked(settings: Settings) -> Settings:
    """``settings``, once the options of every provider it lists are valid:
    else ``ValueError`` naming the option, before anything opens."""
    for name in settings.providers:
        section = get(name).section
        if section is not None:
            section.parse(settings)
    return settings


def upgrades(settings: Settings) -> list[Provider]:
    """The providers preferred to the bootstrap, in order of preference."""
    names = settings.providers
    if BOOTSTRAP in names:
        names = names[: names.index(BOOTSTRAP)]
    return [get(name) for name in names]


def bootstrap_allowed(settings: Settings) -> bool:
    """Whether a channel may stay on the bootstrap provider."""
    return BOOTSTRAP in settings.providers


def offered(settings: Settings) -> tuple[list[Provider], dict[str, str]]:
    """The providers a listener offers besides the bootstrap: all it can run;
    and why each of the others cannot run in this process."""
    usable, unusable = [], {}
    for name in settings.providers:
        if name == BOOTSTRAP:
            continue
        provider = get(name)
        reason = provider.unavailable()
        if reason is None:
            usable.append(provider)
        else:
            _report_unavailable(name, reason)
            unusable[name] = reason
    return usable, unusable


def frame_memory(settings: Settings) -> FrameMemory | None:
    """The running event loop's memory for the large frames its devices
    receive (:mod:`.frame_memory`); None, new memory for each frame, with
    ``release-after: 0`` or where the C helper that lends it was not built."""
    if not settings.release_after:
        return None
    try:
        module = importlib.import_module("dask_lcicomm.providers.frame_memory")
    except ImportError:
        return None
    memory: FrameMemory = module.frame_memory(settings.release_after)
    return memory


@functools.cache
def _report_unavailable(name: str, reason: str) -> None:
    """Logged once per process, not once per event loop: every parcelport of
    a process sees the same reason."""
    logger.warning("lci:// provider %s is unavailable: %s", name, reason)
