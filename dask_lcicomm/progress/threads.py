"""Thread progress: dedicated threads that block in ``epoll`` with the GIL
released while idle, progress the devices they own and hand completions to
the event loop through the completion object. Each thread runs while it has
something to progress and exits by itself after."""

from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import count
from typing import Any

from dask_lcicomm.progress.completion import Completion
from dask_lcicomm.progress.driver import Driver
from dask_lcicomm.providers.base import Device, SharedSource

logger = logging.getLogger(__name__)

_thread_ids = count()


class ThreadDriver(Driver):
    def __init__(self, completion: Completion, nthreads: int) -> None:
        self._threads = [_ProgressThread(completion) for _ in range(nthreads)]
        self._owner: dict[Device | SharedSource, _ProgressThread] = {}
        self._next = 0

    def _thread(self) -> _ProgressThread:
        thread = self._threads[self._next % len(self._threads)]
        self._next += 1
        return thread

    def add(self, device: Device) -> None:
        source = device.source
        thread = self._owner[source] if source is not None else self._thread()
        self._owner[device] = thread
        thread.post(_Run.register, device)

    def watch(self, source: SharedSource) -> None:
        thread = self._owner[source] = self._thread()
        thread.post(_Run.watch, source)

    def kick(self, source: SharedSource) -> None:
        thread = self._owner.get(source)
        if thread is not None:
            try:
                thread.post(_Run.kick, source)
            except RuntimeError:
                pass  # stopped: nothing is progressed any more

    def unwatch(self, source: SharedSource) -> None:
        thread = self._owner.pop(source, None)
        if thread is not None:
            try:
                thread.post(_Run.unwatch, source)
            except RuntimeError:
                pass  # stopped: the thread releases what it watched as it exits

    def want_write(self, device: Device) -> None:
        thread = self._owner.get(device)
        if thread is not None and not device.released:
            thread.post(_Run.watch_writes, device)

    def remove(self, device: Device) -> None:
        thread = self._owner.pop(device, None)
        if thread is not None and not device.released:
            thread.post(_Run.unregister, device)

    def close(self) -> None:
        for thread in self._threads:
            thread.stop()


class _ProgressThread:
    """A slot for one dedicated progress thread.

    The thread runs while it has devices to progress: it starts with the
    first command and exits by itself once its last device is gone, so no
    idle thread outlives the comms it served, even after the event loop has
    stopped.
    """

    def __init__(self, completion: Completion) -> None:
        self._completion = completion
        self._lock = threading.Lock()
        self._run: _Run | None = None
        self._closed = False

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(run, *args)`` on the progress thread, starting it if needed."""
        with self._lock:
            if self._closed:
                raise RuntimeError("progress thread is stopped")
            if self._run is None:
                self._run = _Run(self, self._completion)
            self._run.commands.append((fn, args))
            self._run.wake()

    def finished(self, run: _Run) -> bool:
        """Called by ``run`` when it has no device left: may it exit?"""
        with self._lock:
            if run.commands:
                return False
            if self._run is run:
                self._run = None
            return True

    def retire(self, run: _Run) -> None:
        """Close the wake-up pipe of ``run``, which has exited, under the lock
        every wake-up holds: the command that stopped it may have been taken
        before its wake-up byte was written."""
        with self._lock:
            run.close_wake()

    def stop(self) -> None:
        """Tell the thread to exit; not joined: this runs on the event loop,
        and a thread releasing its last devices must not stall it."""
        with self._lock:
            self._closed = True
            run, self._run = self._run, None
            if run is None:
                return
            run.commands.append((_Run.stop, ()))
            run.wake()


class _Run:
    """One run of a progress thread: blocks in epoll, never spins."""

    def __init__(self, slot: _ProgressThread, completion: Completion) -> None:
        self._slot = slot
        self._completion = completion
        self.commands: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._stopping = False
        self._backlog: set[Device | SharedSource] = set()
        #: Sources that asked for a retry, and when to come back to them.
        self._delayed: dict[SharedSource, float] = {}
        #: Devices progressed through a shared source, not a descriptor.
        self._attached: set[Device] = set()
        self.thread = threading.Thread(
            target=self._main, name=f"lci-progress-{next(_thread_ids)}", daemon=True
        )
        self.thread.start()

    def wake(self) -> None:
        os.write(self._wake_w, b"\0")

    def close_wake(self) -> None:
        os.close(self._wake_r)
        os.close(self._wake_w)

    def stop(self) -> None:
        self._stopping = True

    def register(self, device: Device) -> None:
        if device.source is None:
            self._selector.register(device.fileno(), selectors.EVENT_READ, device)
            return
        self._attached.add(device)
        if device.input_pending:
            self._backlog.add(device)

    def watch(self, source: SharedSource) -> None:
        self._selector.register(source.fileno(), selectors.EVENT_READ, source)

    def kick(self, source: SharedSource) -> None:
        self._backlog.add(source)

    def unwatch(self, source: SharedSource) -> None:
        key = self._selector.get_map().get(source.fileno())
        if key is not None and key.data is source:
            self._selector.unregister(key.fd)
        self._backlog.discard(source)
        self._delayed.pop(source, None)
        source.release()

    def watch_writes(self, device: Device) -> None:
        self._watch(device, selectors.EVENT_READ | selectors.EVENT_WRITE)

    def _registered(self, device: Device) -> bool:
        """Whether ``device`` itself is registered: once a released device's
        descriptor is closed, the number may already belong to a new device,
        and a late command for the old one must not touch it."""
        key = self._selector.get_map().get(device.fileno())
        return key is not None and key.data is device

    def _watch(self, device: Device, events: int) -> None:
        if self._registered(device):
            self._selector.modify(device.fileno(), events, device)

    def unregister(self, device: Device) -> None:
        if device.source is not None:
            self._attached.discard(device)
        elif self._registered(device):
            self._selector.unregister(device.fileno())
        device.release()

    def _main(self) -> None:
        selector = self._selector
        try:
            while not self._stopping:
                backlog, self._backlog = self._backlog, set()
                for key, mask in selector.select(0 if backlog else self._next_retry()):
                    item = key.data
                    if item is None:
                        self._run_commands()
                    elif isinstance(item, SharedSource):
                        backlog.discard(item)
                        self._progress(item)
                    else:
                        if mask & selectors.EVENT_READ:
                            backlog.discard(item)
                            self._read(item)
                        if mask & selectors.EVENT_WRITE and not item.released and item.on_writable():
                            self._watch(item, selectors.EVENT_READ)
                backlog.update(self._due())
                for item in backlog:
                    if isinstance(item, SharedSource):
                        self._progress(item)
                    elif not item.released:
                        self._read(item)
                self._completion.flush()
                if len(selector.get_map()) == 1 and self._slot.finished(self):
                    break
        except Exception:
            logger.exception("progress thread failed")
        finally:
            for device in list(self._attached):
                self.unregister(device)
            for key in list(selector.get_map().values()):
                if isinstance(key.data, SharedSource):
                    selector.unregister(key.fd)
                    key.data.release()
                elif key.data is not None:
                    self.unregister(key.data)
            selector.close()
            self._slot.retire(self)
            self._completion.flush()

    def _next_retry(self) -> float | None:
        """How long the selector may sleep before a delayed source is due."""
        if not self._delayed:
            return None
        return max(0.0, min(self._delayed.values()) - time.monotonic())

    def _due(self) -> list[SharedSource]:
        now = time.monotonic()
        due = [source for source, at in self._delayed.items() if at <= now]
        for source in due:
            del self._delayed[source]
        return due

    def _progress(self, source: SharedSource) -> None:
        self._delayed.pop(source, None)
        for device in source.progress():
            if device in self._attached:
                self._read(device)
        if not source.input_pending:
            return
        delay = source.retry_delay
        if delay:
            self._delayed.setdefault(source, time.monotonic() + delay)
        else:
            self._backlog.add(source)

    def _read(self, device: Device) -> None:
        if not device.on_readable():
            self.unregister(device)
        elif device.input_pending:
            self._backlog.add(device)

    def _run_commands(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while self.commands:
            fn, args = self.commands.popleft()
            fn(self, *args)
