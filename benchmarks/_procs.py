"""Lifecycle of the benchmark peer processes.

Every peer runs in its own ``spawn``-ed process so that a backend's global
state (progress threads, native runtimes) is fresh for each round and a crash
or hang in one scheme cannot take the harness down with it.  The helpers here
guarantee that a started process is always stopped again, escalating from a
polite pipe close to ``terminate`` and finally ``kill`` -- and so are the
processes it started itself (e.g. the workers of a ``LocalCluster``).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

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
def spawned(
    target: Callable[..., None],
    *args: Any,
    name: str,
    daemon: bool = True,
    dask_config: Mapping[str, Any] | None = None,
    pythonpath: str | None = None,
) -> Iterator[Peer]:
    """Run ``target(conn, *args)`` in a fresh process for the ``with`` body.

    The child gets its end of a duplex pipe as first argument, and
    ``dask_config`` (dotted keys) on top of its Dask configuration (see
    :func:`_with_dask_config`); with ``pythonpath``, it and every process it
    starts look for modules there first (see :func:`_modules_first_from`).
    On exit, the parent's end is closed first (peers treat EOF as "stop"), then the process
    is joined with increasingly forceful means, and finally whatever it had
    started and left behind is stopped too: a peer killed mid-way cannot clean
    up its own children.  Pass ``daemon=False`` for a peer that starts
    processes itself (``multiprocessing`` forbids daemons to have children).
    """
    parent_conn, child_conn = _CTX.Pipe()
    process = _CTX.Process(
        target=_with_dask_config, args=(dict(dask_config or {}), target, child_conn, *args),
        name=name, daemon=daemon,
    )
    with _modules_first_from(pythonpath):
        process.start()
    child_conn.close()  # only the child holds it now, so EOF is seen on its death
    try:
        yield Peer(process, parent_conn)
    finally:
        descendants = _descendants(process.pid)  # before the child can die and orphan them
        parent_conn.close()
        _stop(process)
        _stop_all(descendants)


@contextmanager
def _modules_first_from(path: str | None) -> Iterator[None]:
    """Make a process started in the body look for modules in ``path`` first.

    A ``spawn``-ed child gets its module path twice: the interpreter starts
    with ``PYTHONPATH`` from its environment, then ``multiprocessing``
    replaces ``sys.path`` with the copy of the parent's that ``start()``
    took -- before it imports the parent's ``__main__`` again (which may
    import the backend) and unpickles the target.  So ``PYTHONPATH`` alone
    is overwritten, and changing ``sys.path`` in the child comes too late:
    both are set here for the duration of ``start()``, then restored.  The
    child's own children (a ``LocalCluster``'s workers, spawned by their
    nannies) inherit both from it.
    """
    if path is None:
        yield
        return
    saved_env = os.environ.get("PYTHONPATH")
    saved_path = list(sys.path)
    os.environ["PYTHONPATH"] = os.pathsep.join([path, saved_env] if saved_env else [path])
    sys.path.insert(0, path)
    try:
        yield
    finally:
        sys.path[:] = saved_path
        if saved_env is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved_env


def report_origin(conn: Connection, module: str) -> None:
    """Child target: send ``("origin", <module>.__file__)``, or the import
    error as ``("failed", reason)``: where this process found ``module``."""
    try:
        imported = importlib.import_module(module)
    except Exception as exc:
        send_quietly(conn, ("failed", f"{type(exc).__name__}: {exc}"))
    else:
        send_quietly(conn, ("origin", imported.__file__))


def _with_dask_config(
    overrides: dict[str, Any], target: Callable[..., None], conn: Connection, *args: Any
) -> None:
    """Child side of :func:`spawned`: apply ``overrides``, then run ``target``.

    Not ``DASK_*`` environment variables: Dask reads those when it is
    imported, before a backend registers its defaults, so a hyphenated knob
    such as ``eager-threshold`` arrives spelled ``eager_threshold`` -- which
    a backend reading the hyphenated key does not see.  A dotted key given to
    :func:`dask.config.set` is stored as spelled, whatever the import order.
    Processes the child starts itself (``LocalCluster`` workers) get the
    overrides from their nanny, which hands its whole configuration down.
    """
    if overrides:
        import dask.config

        dask.config.set(overrides)  # process-wide: never exited
    target(conn, *args)


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


def _descendants(pid: int | None) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, ValueError):  # ValueError: never started (pid None)
        return []


def _stop_all(processes: list[psutil.Process]) -> None:
    """Give ``processes`` time to exit by themselves, then terminate, then kill.

    ``psutil`` checks the creation time before signalling, so a pid recycled
    in the meantime is never hit.
    """
    _, alive = psutil.wait_procs(processes, timeout=_GRACE_S)
    for escalate in (psutil.Process.terminate, psutil.Process.kill):
        for proc in alive:
            try:
                escalate(proc)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(alive, timeout=_GRACE_S)


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


def expect(peer: Peer, kind: str, timeout_s: float) -> Any:
    """The payload of ``peer``'s next message, which must be ``(kind, payload)``.

    Peers report a crash as ``("failed", traceback)``; its last line (the
    exception) becomes the :class:`PeerError` message.
    """
    got, payload = receive(peer, timeout_s)
    if got != kind:
        raise PeerError(f"{peer.process.name} failed: {_last_line(str(payload))}")
    return payload


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def send_quietly(conn: Connection, message: tuple[Any, ...]) -> None:
    """Report to the parent if it is still listening; it may have given up."""
    try:
        conn.send(message)
    except (BrokenPipeError, EOFError, OSError):
        pass


def ignore_sigint() -> None:
    """Let only the parent react to Ctrl-C; it tears the children down itself.

    Without this every child would print its own KeyboardInterrupt traceback.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
