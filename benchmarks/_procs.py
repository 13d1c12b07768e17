"""Benchmark peers, each a ``spawn``-ed process: a backend's global state is fresh every
round, and a crash or hang in one scheme cannot take the run with it."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any
from unittest import mock

import psutil

_CTX = multiprocessing.get_context("spawn")

#: Seconds a peer gets to exit after its pipe closes, and after each escalation.
_GRACE_S = 3.0


@dataclass
class Peer:
    process: BaseProcess
    conn: Connection


class PeerError(RuntimeError):
    """A peer died, timed out or reported a failure instead of an answer."""


@contextmanager
def spawned(target: Callable[..., Any], *args: Any, name: str, daemon: bool = True,
            dask_config: Mapping[str, Any] | None = None, pythonpath: str | None = None
            ) -> Iterator[Peer]:
    """``target(conn, *args)`` (on a fresh event loop if a coroutine function) in a fresh
    process with ``dask_config`` set, importing from ``pythonpath`` first (``daemon=False`` if
    it starts processes); on exit the pipe closes (EOF: "stop"), then it and its descendants
    are stopped, ever more forcefully."""
    parent_conn, child_conn = _CTX.Pipe()
    process = _CTX.Process(target=_child, name=name, daemon=daemon,
                           args=(dict(dask_config or {}), target, child_conn, *args))
    with _modules_first_from(pythonpath):
        process.start()
    child_conn.close()  # only the child holds it now: EOF on its death
    try:
        yield Peer(process, parent_conn)
    finally:
        try:
            descendants = psutil.Process(process.pid).children(recursive=True)
        except (psutil.NoSuchProcess, ValueError):
            descendants = []
        parent_conn.close()
        process.join(_GRACE_S)
        for escalate in (process.terminate, process.kill):
            if process.is_alive():
                escalate()
                process.join(_GRACE_S)
        if not process.is_alive():
            process.close()
        _, alive = psutil.wait_procs(descendants, timeout=_GRACE_S)
        for signal_ in (psutil.Process.terminate, psutil.Process.kill):
            for proc in alive:  # psutil checks creation times: no recycled pid is hit
                with suppress(psutil.NoSuchProcess):
                    signal_(proc)
            _, alive = psutil.wait_procs(alive, timeout=_GRACE_S)


@contextmanager
def _modules_first_from(path: str | None) -> Iterator[None]:
    """A spawned child takes ``PYTHONPATH`` (which its children inherit), then the parent's
    ``sys.path`` before unpickling the target: both are set during ``start()``."""
    if path is None:
        yield
        return
    inherited = os.environ.get("PYTHONPATH")
    with (mock.patch.dict(os.environ, {"PYTHONPATH": os.pathsep.join(filter(None, [path, inherited]))}),
          mock.patch.object(sys, "path", [path, *sys.path])):
        yield


def _child(overrides: dict[str, Any], target: Callable[..., Any], conn: Connection, *args: Any) -> None:
    """Every child: Ctrl-C is left to the parent, which stops the children itself; a crash is
    sent as ``("failed", traceback)``.  Dask settings are set here, not as ``DASK_*`` variables:
    Dask reads those before a backend registers its defaults (``eager-threshold`` would arrive
    as ``eager_threshold``).  Nannies pass them on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if overrides:
            import dask.config

            dask.config.set(overrides)
        if inspect.iscoroutine(done := target(conn, *args)):
            asyncio.run(done)
    except Exception:
        send_quietly(conn, ("failed", traceback.format_exc()))


def run_in_child(work: Callable[..., Any], *args: Any, name: str, dask_config: Mapping[str, Any],
                 timeout_s: float) -> Any:
    """``work(*args)`` (awaited if a coroutine function) in a fresh process with ``dask_config``
    set, which may start processes of its own: its result, else a :class:`PeerError`."""
    with spawned(_answer, work, *args, name=f"{name}-{work.__name__}", dask_config=dask_config,
                 daemon=False) as child:
        return expect(child, "result", timeout_s)


def _answer(conn: Connection, work: Callable[..., Any], *args: Any) -> None:
    conn.send(("result", asyncio.run(work(*args)) if inspect.iscoroutinefunction(work) else work(*args)))


def report_origin(conn: Connection, module: str) -> None:
    """Child: where this process found ``module``."""
    conn.send(("origin", importlib.import_module(module).__file__))


def receive(peer: Peer, timeout_s: float) -> Any:
    """The peer's next message; a :class:`PeerError` if it hangs, dies or reports a crash
    (``("failed", traceback)``: its last line)."""
    try:
        if not peer.conn.poll(max(timeout_s, 0.0)):
            raise PeerError(f"{peer.process.name}: no answer within {timeout_s:.0f} s")
        message = peer.conn.recv()
    except (EOFError, OSError) as exc:
        peer.process.join(_GRACE_S)
        raise PeerError(f"{peer.process.name}: pipe broken ({type(exc).__name__}), exit code "
                        f"{peer.process.exitcode}") from exc
    if message[0] == "failed" and len(message) == 2:
        lines = [line for line in str(message[1]).strip().splitlines() if line.strip()]
        raise PeerError(f"{peer.process.name} failed: {lines[-1] if lines else message[1]}")
    return message


def expect(peer: Peer, kind: str, timeout_s: float) -> Any:
    """The payload of the peer's next message, which must be ``(kind, payload)``."""
    got, payload = receive(peer, timeout_s)
    if got != kind:
        raise PeerError(f"{peer.process.name} answered {got!r}, not {kind!r}")
    return payload


def send_quietly(conn: Connection, message: tuple[Any, ...]) -> None:
    """Report to the parent if it still listens; it may have given up."""
    with suppress(EOFError, OSError):
        conn.send(message)
