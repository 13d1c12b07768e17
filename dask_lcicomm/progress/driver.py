"""What the progress engine asks of a mode's driver."""

from __future__ import annotations

from abc import ABC, abstractmethod

from dask_lcicomm.providers.base import Device, SharedSource


class Driver(ABC):
    """Progresses devices and shared sources in one mode; each method does
    what :class:`~dask_lcicomm.progress.engine.ProgressEngine`'s method of
    that name promises."""

    @abstractmethod
    def add(self, device: Device) -> None: ...

    @abstractmethod
    def watch(self, source: SharedSource) -> None: ...

    @abstractmethod
    def kick(self, source: SharedSource) -> None: ...

    @abstractmethod
    def unwatch(self, source: SharedSource) -> None: ...

    @abstractmethod
    def want_write(self, device: Device) -> None: ...

    @abstractmethod
    def remove(self, device: Device) -> None: ...

    @abstractmethod
    def close(self) -> None: ...
