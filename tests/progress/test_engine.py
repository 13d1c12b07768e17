"""The progress engine: every mode moves data, threads block when idle and stop."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import threading
import time

import pytest
from distributed.utils_test import gen_test

from dask_lcicomm.parcel import Message, OutgoingParcel
from dask_lcicomm.progress import ProgressEngine
from dask_lcicomm.progress.completion import CompletionQueue, make_completion
from dask_lcicomm.progress.threads import _ProgressThread, _Run
from dask_lcicomm.providers.base import SharedSource


def _progress_threads():
    return [t for t in threading.enumerate() if t.name.startswith("lci-progress")]


@pytest.mark.parametrize("mode", ["loop", "thread", "poll"])
@pytest.mark.parametrize("completion", ["queue", "sync"])
@gen_test(timeout=60)
async def test_modes_deliver_both_ways(endpoint_pair, mode, completion):
    with endpoint_pair(mode, completion=completion) as (a, b):
        for seq in range(20):
            a.send(1, OutgoingParcel(1, seq, [b"ping"], 1024, 4096))
            b.send(1, OutgoingParcel(1, seq, [b"pong"], 1024, 4096))
        for end in (a, b):
            await end.wait_for(lambda ev: sum(isinstance(e, Message) for e in ev) == 20)


@gen_test(timeout=60)
async def test_queue_wakes_the_loop_once_per_batch(endpoint_pair):
    with endpoint_pair("thread", sndbuf=1 << 20) as (a, b):
        n = 2000
        for seq in range(n):
            a.send(1, OutgoingParcel(1, seq, [b"x"], 1024, 4096))
        await b.wait_for(lambda ev: sum(isinstance(e, Message) for e in ev) == n)
        assert isinstance(b.completion, CompletionQueue)
        assert b.completion.wakeups < n / 4


@gen_test(timeout=60)
async def test_threads_start_with_devices_and_stop_on_close(endpoint_pair):
    assert not _progress_threads()
    with endpoint_pair("thread") as (a, b):
        a.send(1, OutgoingParcel(1, 0, [b"x"], 1024, 4096))
        await b.wait_for(lambda ev: len(ev) == 1)
        assert len(_progress_threads()) == 2
    deadline = time.monotonic() + 5
    while _progress_threads() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not _progress_threads()


@gen_test(timeout=60)
async def test_idle_progress_thread_does_not_spin(endpoint_pair):
    with endpoint_pair("thread") as (a, b):
        a.send(1, OutgoingParcel(1, 0, [b"x"], 1024, 4096))
        await b.wait_for(lambda ev: len(ev) == 1)
        before = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(1.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 0.1, f"idle progress threads burned {cpu:.3f} s of CPU in 1 s"


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="progress mode"):
        ProgressEngine(asyncio.new_event_loop(), "busy", None)


@gen_test(timeout=30)
async def test_closing_does_not_wait_for_a_busy_progress_thread(endpoint_pair):
    """close() runs on the event loop: it tells the threads to stop and
    returns; they exit by themselves once their devices are released."""
    with endpoint_pair("thread") as (a, b):
        a.send(1, OutgoingParcel(1, 0, [b"x"], 1024, 4096))
        await b.wait_for(lambda ev: len(ev) == 1)
        busy = threading.Event()
        a.engine._driver._threads[0].post(lambda run: (busy.set(), time.sleep(1.0)))
        assert busy.wait(5)
        start = time.monotonic()
        a.engine.remove(a.device)
        a.engine.close()
        assert time.monotonic() - start < 0.5
    deadline = time.monotonic() + 5
    while _progress_threads() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not _progress_threads()


class _NoCompletions:
    """The socket devices below complete nothing: a progress thread only flushes."""

    def flush(self):
        pass


class _SocketDevice:
    """What a progress thread calls on a device, over one end of a socket
    pair; like a real device, once released it keeps its descriptor number
    and reads as gone."""

    input_pending = False
    source = None

    def __init__(self, sock):
        sock.setblocking(False)
        self._sock = sock
        self._fd = sock.fileno()
        self.released = False
        self.read = threading.Event()
        self.gone = threading.Event()

    def fileno(self):
        return self._fd

    def on_readable(self):
        if self.released:
            return False
        self.read.set()
        return bool(self._sock.recv(4096))

    def release(self):
        self.released = True
        self._sock.close()
        self.gone.set()


@pytest.mark.parametrize("command", ["unregister", "watch_writes"])
def test_late_command_for_a_released_device_spares_the_one_reusing_its_descriptor(command):
    """The progress thread releases a lost device while the loop may still
    post a command for it (its remove, or a want_write from a blocked flush);
    the descriptor is closed by then and a new device may get its number. The
    late command must leave the new device's registration alone, or the new
    device is never read."""
    slot = _ProgressThread(_NoCompletions())
    socks = []

    def socket_pair():
        pair = socket.socketpair()
        socks.extend(pair)
        return pair

    keeper = _SocketDevice(socket_pair()[0])
    old_end, old_peer = socket_pair()
    old = _SocketDevice(old_end)
    # The keeper stays registered, so one run of the thread, with one
    # selector, sees every command.
    slot.post(_Run.register, keeper)
    run = slot._run
    try:
        slot.post(_Run.register, old)
        old_peer.close()
        assert old.gone.wait(5), "the progress thread did not release the lost device"
        new_end, new_peer = socket_pair()
        assert new_end.fileno() == old.fileno(), "the new device did not reuse the descriptor number"
        new = _SocketDevice(new_end)
        commands_done = threading.Event()
        slot.post(_Run.register, new)
        slot.post(getattr(_Run, command), old)
        slot.post(lambda _: commands_done.set())
        assert commands_done.wait(5)
        assert not new.read.is_set()
        new_peer.send(b"x")
        assert new.read.wait(5), f"a late {command} for the released device lost the new one"
    finally:
        slot.stop()
        run.thread.join(5)
        for sock in socks:
            sock.close()
    assert not run.thread.is_alive()


class _PipeSource(SharedSource):
    """A pipe standing for a fabric that many devices share: each byte
    written names the device that has news."""

    def __init__(self):
        self._r, self.w = os.pipe()
        os.set_blocking(self._r, False)
        self.members = {}
        self.progressed = 0
        self.released = threading.Event()

    def fileno(self):
        return self._r

    def progress(self):
        self.progressed += 1
        try:
            data = os.read(self._r, 4096)
        except BlockingIOError:
            data = b""
        return [self.members[key] for key in data if key in self.members]

    def release(self):
        os.close(self._r)
        os.close(self.w)
        self.released.set()


class _Member:
    """A device of a shared source: it has no descriptor of its own."""

    watch_writable = False
    input_pending = False

    def __init__(self, source, key):
        self.source = source
        self.released = False
        self.reads = 0
        source.members[key] = self

    def fileno(self):
        raise AssertionError("a device of a shared source is not waited on")

    def on_readable(self):
        self.reads += 1
        return True

    def release(self):
        self.released = True


async def _until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("mode", ["loop", "thread", "poll"])
@gen_test(timeout=30)
async def test_a_shared_source_serves_its_devices_until_its_last_holder_lets_go(mode):
    """One descriptor for many devices: the engine progresses the source,
    reads the devices it names, and releases it when the last holder drops
    it (then its progress thread exits); a source let go is never handed
    out again."""
    loop = asyncio.get_running_loop()
    engine = ProgressEngine(loop, mode, make_completion("queue", loop, lambda batch: None,
                                                        threadsafe=mode == "thread"))
    try:
        source = engine.shared("pipe", _PipeSource)
        assert engine.shared("pipe", _PipeSource) is source
        first, second = _Member(source, 1), _Member(source, 2)
        engine.add(first)
        engine.add(second)
        os.write(source.w, b"\x02")
        await _until(lambda: second.reads >= 1)
        if mode != "poll":
            assert first.reads == 0
        before = source.progressed
        engine.kick(source)
        await _until(lambda: source.progressed > before)
        engine.remove(first)
        engine.remove(second)
        await _until(lambda: first.released and second.released)
        engine.drop(source)
        assert not source.released.is_set(), "released while still held"
        engine.drop(source)
        await _until(source.released.is_set)
        assert not engine.hold(source)
        await _until(lambda: not _progress_threads())
        again = engine.shared("pipe", _PipeSource)
        assert again is not source
        engine.drop(again)
        await _until(again.released.is_set)
    finally:
        engine.close()


@gen_test(timeout=30)
async def test_kicking_a_source_after_the_engine_closed_does_nothing():
    """A fabric may ask for progress (a send it must retry) while the engine
    closes: its progress thread is stopped by then, and the kick is dropped."""
    loop = asyncio.get_running_loop()
    engine = ProgressEngine(loop, "thread", make_completion("queue", loop, lambda batch: None,
                                                            threadsafe=True))
    source = engine.shared("pipe", _PipeSource)
    engine.close()
    engine.kick(source)
    await _until(source.released.is_set)
    await _until(lambda: not _progress_threads())


@gen_test(timeout=30)
async def test_a_thread_stopped_before_its_wake_up_byte_is_written_keeps_its_pipe_until_then(monkeypatch):
    """The stop command is in the run's queue before the byte that wakes it
    is written: a run already awake takes it, exits, and must not close its
    pipe under that write (EBADF, or a write into a reused descriptor)."""
    loop = asyncio.get_running_loop()
    slot = _ProgressThread(make_completion("queue", loop, lambda batch: None, threadsafe=True))
    appended = threading.Event()
    stopping = False
    real_wake = _Run.wake

    def wake(run):
        if stopping:
            appended.set()
            time.sleep(0.2)  # the run takes the stop command meanwhile
        real_wake(run)

    monkeypatch.setattr(_Run, "wake", wake)
    source = _PipeSource()
    # The run watches a source (so it does not exit by itself) and is awake,
    # inside a command, when the stop command comes.
    slot.post(_Run.watch, source)
    slot.post(lambda run: appended.wait(5))
    run = slot._run
    stopping = True
    slot.stop()
    run.thread.join(5)
    assert not run.thread.is_alive() and source.released.is_set()
