"""The hook that follows tornado's IOLoop.close(all_fds=True)."""

from __future__ import annotations

import asyncio
import os

from tornado.ioloop import IOLoop

from dask_lcicomm.loop_close import LoopCloseHook


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _run_then_close(make_hooks, all_fds: bool = True):
    """Make hooks on a fresh loop driven by tornado, then close it as Dask's
    test harness does; returns the hooks and what each saw."""
    calls: list[int] = []
    made: list[LoopCloseHook] = []
    ioloops: list[IOLoop] = []

    async def main() -> None:
        ioloops.append(IOLoop.current())
        made.extend(make_hooks(calls))

    asyncio.run(main())
    ioloops[0].close(all_fds=all_fds)
    return made, calls


def test_closing_the_ioloop_with_its_descriptors_runs_the_hook_once():
    baseline = _descriptors()
    hooks, calls = _run_then_close(lambda calls: [LoopCloseHook(lambda: calls.append(1))])
    assert calls == [1]
    assert hooks[0].fileno() == -1
    assert _descriptors() == baseline
    hooks[0].cancel()  # after the close: nothing left to do
    assert calls == [1]


def test_a_cancelled_hook_holds_nothing_and_is_not_run():
    def make(calls):
        baseline = _descriptors()
        hook = LoopCloseHook(lambda: calls.append(1))
        assert hook.fileno() >= 0 and _descriptors() == baseline + 1
        hook.cancel()
        assert _descriptors() == baseline
        return [hook]

    _, calls = _run_then_close(make)
    assert calls == []


def test_a_loop_closed_without_its_descriptors_does_not_run_the_hook():
    hooks, calls = _run_then_close(lambda calls: [LoopCloseHook(lambda: calls.append(1))], False)
    assert calls == []
    hooks[0].cancel()


def test_without_a_tornado_ioloop_nothing_is_registered():
    async def main() -> LoopCloseHook:
        return LoopCloseHook(lambda: None)

    baseline = _descriptors()
    hook = asyncio.run(main())
    assert hook.fileno() == -1 and _descriptors() == baseline
    hook.cancel()
