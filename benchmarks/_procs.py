"""Lifecycle of the benchmark peer processes.

Every peer runs in its own ``spawn``-ed process so that a backend's global
state (progress threads, native runtimes) is fresh for each round and a crash
or hang in one scheme cannot take the harness down with it.  The helpers here
guarantee that a started process is always stopped again, escalating from a
polite pipe close to ``terminate`` and finally ``kill``.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

_CTX = multiprocessing.get_context("spawn")

#: Seconds a peer gets to exit by itself after its pipe is closed, and again
#: after ``terminate``, before we escalate.
_GRACE_S = 3.0


@dataclass
class Peer:
    """A running child process and the parent's end of its pipe."""

    process: BaseProcess
    conn: Connection


class PeerError(RuntimeError):
    """A peer died, timed out or reported a failure instead of an answer."""


@contextmanager
def spawned(target: Callable[..., None], *args: Any, name: str) -> Iterator[Peer]:
    """Run ``target(conn, *args)`` in a fresh process for the ``with`` body.

    The child gets its end of a duplex pipe as first argument.  On exit, the
    parent's end is closed first (peers treat EOF as "stop"), then the process
    is joined with increasingly forceful means.
    """
    parent_conn, child_conn = _CTX.Pipe()
    process = _CTX.Process(target=target, args=(child_conn, *args), name=name, daemon=True)
    process.start()
    child_conn.close()  # only the child holds it now, so EOF is seen on its death
    try:
        yield Peer(process, parent_conn)
    finally:
        parent_conn.close()
        _stop(process)


def _stop(process: BaseProcess) -> None:
    """Join ``process``, escalating to terminate/kill if it does not exit."""
    process.join(_GRACE_S)
    for escalate in (process.terminate, process.kill):
        if not process.is_alive():
            break
        escalate()
        process.join(_GRACE_S)
    if not process.is_alive():
        process.close()


def receive(peer: Peer, timeout_s: float) -> Any:
    """Return the next message from ``peer``, or raise :class:`PeerError`.

    Bounded in time so that a hung peer (e.g. a native call blocking its event
    loop) cannot block the harness.
    """
    try:
        ready = peer.conn.poll(max(timeout_s, 0.0))
    except (EOFError, OSError) as exc:
        raise PeerError(f"{peer.process.name}: pipe broken ({exc})") from exc
    if not ready:
        raise PeerError(f"{peer.process.name}: no answer within {timeout_s:.0f} s")
    try:
        return peer.conn.recv()
    except (EOFError, OSError) as exc:
        peer.process.join(_GRACE_S)
        raise PeerError(
            f"{peer.process.name}: exited with code {peer.process.exitcode}"
        ) from exc


def ignore_sigint() -> None:
    """Let only the parent react to Ctrl-C; it tears the children down itself.

    Without this every child would print its own KeyboardInterrupt traceback.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
