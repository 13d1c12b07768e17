"""The progress engine: who turns network readiness into completions.

LCI makes progress explicit: nothing moves unless somebody calls progress.
Here the engine owns that duty for every device of a parcelport, in one of
three modes (``distributed.comm.lci.progress``):

``loop``
    The asyncio event loop watches every device and progresses it in its
    own callbacks (HPX's worker-driven progress): no thread hand-off at all.
``thread``
    Dedicated progress threads block in ``epoll`` with the GIL released while
    idle, progress the devices they own and hand completions to the loop
    through the completion object: one wake-up per batch with a queue.
``poll``
    A timer on the event loop polls every device at a fixed period. Simple
    and deterministic, it costs CPU while idle; meant for tests.

Devices are spread over the progress threads round-robin, so ``ndevices``
replicated devices are progressed in parallel where threads allow it. A
device of a shared source (one fabric endpoint for all of a process's peers)
is progressed where its source is: the engine waits on the source and reads
the devices it names.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from dask_lcicomm.progress.completion import Completion
from dask_lcicomm.progress.driver import Driver
from dask_lcicomm.progress.threads import ThreadDriver
from dask_lcicomm.providers.base import Device, SharedSource


class ProgressEngine:
    """Progresses a set of devices in one of the modes ``loop``, ``thread``, ``poll``."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        mode: str,
        completion: Completion,
        nthreads: int = 1,
        poll_interval: float = 0.001,
    ) -> None:
        self.mode = mode
        self.completion = completion
        self._driver: Driver
        if mode == "loop":
            self._driver = _LoopDriver(loop, completion)
        elif mode == "thread":
            self._driver = ThreadDriver(completion, nthreads)
        elif mode == "poll":
            self._driver = _PollDriver(loop, completion, poll_interval)
        else:
            raise ValueError(f"unknown progress mode {mode!r}")
        # Sources are made on the event loop and let go wherever devices are
        # released: holding and dropping are atomic under this lock, so a
        # source being let go is never handed out again.
        self._shared_lock = threading.Lock()
        self._shared: dict[str, SharedSource] = {}
        self._holders: dict[SharedSource, int] = {}

    def shared(self, name: str, make: Callable[[], SharedSource]) -> SharedSource:
        """The source called ``name``, made and watched on first use and held
        for the caller until it calls :meth:`drop`."""
        with self._shared_lock:
            source = self._shared.get(name)
            if source is None:
                source = self._shared[name] = make()
                self._holders[source] = 0
                self._driver.watch(source)
            self._holders[source] += 1
            return source

    def hold(self, source: SharedSource) -> bool:
        """Hold ``source`` once more; False if it is already let go."""
        with self._shared_lock:
            if source not in self._holders:
                return False
            self._holders[source] += 1
            return True

    def drop(self, source: SharedSource) -> None:
        """Let go of ``source``: once nobody holds it, it is unwatched and
        released (so that an idle process keeps no fabric resources)."""
        with self._shared_lock:
            holders = self._holders.get(source)
            if holders is None:
                return
            if holders > 1:
                self._holders[source] = holders - 1
                return
            del self._holders[source]
            self._shared = {name: s for name, s in self._shared.items() if s is not source}
        self._driver.unwatch(source)

    def kick(self, source: SharedSource) -> None:
        """Progress ``source`` soon, though its descriptor may not say so."""
        self._driver.kick(source)

    def add(self, device: Device) -> None:
        """Start progressing ``device``."""
        self._driver.add(device)

    def want_write(self, device: Device) -> None:
        """``device`` has output that could not be sent at once."""
        if device.watch_writable:
            self._driver.want_write(device)

    def remove(self, device: Device) -> None:
        """Stop progressing ``device`` and release it."""
        self._driver.remove(device)

    def close(self) -> None:
        """Stop progress and release the shared sources (after their devices);
        dedicated threads exit by themselves."""
        with self._shared_lock:
            self._shared.clear()
            self._holders.clear()
        self._driver.close()


class _LoopDriver(Driver):
    def __init__(self, loop: asyncio.AbstractEventLoop, completion: Completion) -> None:
        self._loop = loop
        self._completion = completion
        self._devices: set[Device] = set()
        self._sources: set[SharedSource] = set()
        self._backlog: set[Device | SharedSource] = set()
        #: The delayed returns to sources that asked for a retry.
        self._timers: dict[Device | SharedSource, asyncio.TimerHandle] = {}

    def add(self, device: Device) -> None:
        self._devices.add(device)
        if device.source is None:
            self._loop.add_reader(device.fileno(), self._readable, device)
        elif device.input_pending:
            self._later(device)

    def watch(self, source: SharedSource) -> None:
        self._sources.add(source)
        self._loop.add_reader(source.fileno(), self._progress, source)

    def kick(self, source: SharedSource) -> None:
        if source in self._sources:
            self._later(source)

    def unwatch(self, source: SharedSource) -> None:
        if source in self._sources:
            self._sources.discard(source)
            self._loop.remove_reader(source.fileno())
            source.release()

    def _readable(self, device: Device) -> None:
        self._read(device)
        self._completion.flush()

    def _read(self, device: Device) -> None:
        if not device.on_readable():
            self.remove(device)
        elif device.input_pending:
            self._later(device)

    def _progress(self, source: SharedSource) -> None:
        for device in source.progress():
            if device in self._devices:
                self._read(device)
        if source.input_pending:
            self._later(source, source.retry_delay)
        self._completion.flush()

    def _later(self, item: Device | SharedSource, delay: float = 0.0) -> None:
        timer = self._timers.get(item) if not delay else None
        if timer is not None:
            # Wanted at once (a kick): not behind a retry's delay, as in thread mode.
            timer.cancel()
            del self._timers[item]
            self._backlog.discard(item)
        if item not in self._backlog:
            self._backlog.add(item)
            if delay:
                self._timers[item] = self._loop.call_later(delay, self._resume, item)
            else:
                self._loop.call_soon(self._resume, item)

    def _resume(self, item: Device | SharedSource) -> None:
        self._backlog.discard(item)
        self._timers.pop(item, None)
        if isinstance(item, SharedSource):
            if item in self._sources:
                self._progress(item)
        elif item in self._devices:
            self._readable(item)

    def want_write(self, device: Device) -> None:
        if device in self._devices:
            self._loop.add_writer(device.fileno(), self._writable, device)

    def _writable(self, device: Device) -> None:
        if device.on_writable():
            self._loop.remove_writer(device.fileno())
        self._completion.flush()

    def remove(self, device: Device) -> None:
        if device in self._devices:
            self._devices.discard(device)
            if device.source is None:
                self._loop.remove_reader(device.fileno())
                self._loop.remove_writer(device.fileno())
            device.release()

    def close(self) -> None:
        for device in list(self._devices):
            self.remove(device)
        sources, self._sources = self._sources, set()
        for source in sources:
            self._loop.remove_reader(source.fileno())
            source.release()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()


class _PollDriver(Driver):
    def __init__(
        self, loop: asyncio.AbstractEventLoop, completion: Completion, interval: float
    ) -> None:
        self._loop = loop
        self._completion = completion
        self._interval = interval
        self._devices: dict[Device, bool] = {}
        self._sources: list[SharedSource] = []
        self._timer: asyncio.TimerHandle | None = None

    def add(self, device: Device) -> None:
        self._devices[device] = False
        self._start()

    def watch(self, source: SharedSource) -> None:
        self._sources.append(source)
        self._start()

    def kick(self, source: SharedSource) -> None:
        """Polled within a period anyway."""

    def unwatch(self, source: SharedSource) -> None:
        if source in self._sources:
            self._sources.remove(source)
            source.release()

    def _start(self) -> None:
        if self._timer is None:
            self._timer = self._loop.call_later(self._interval, self._poll)

    def want_write(self, device: Device) -> None:
        if device in self._devices:
            self._devices[device] = True

    def _poll(self) -> None:
        # Every device is read below: what the sources name adds nothing.
        for source in list(self._sources):
            for _ in source.progress():
                pass
        for device, writing in list(self._devices.items()):
            if not device.on_readable():
                self.remove(device)
            elif writing and device.on_writable():
                self._devices[device] = False
        self._completion.flush()
        alive = self._devices or self._sources
        self._timer = self._loop.call_later(self._interval, self._poll) if alive else None

    def remove(self, device: Device) -> None:
        if self._devices.pop(device, None) is not None:
            device.release()

    def close(self) -> None:
        for device in list(self._devices):
            self.remove(device)
        sources, self._sources = self._sources, []
        for source in sources:
            source.release()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
