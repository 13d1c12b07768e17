"""The worker side of a run: one long-running task per worker drives the
local steps, the mode's exchange runs on the worker's event loop.

The client installs a :class:`WorkerRun` on every worker (``client.run``),
which registers the handler that receives the peers' messages, and has it
open its links to its peers (:func:`open_links`); then a task
pinned to each worker (:func:`train_task`) steps the model in the task
thread and hands each stepped model to the event loop, where the exchange
state machine decides what to send and when the round's reduce is done.
Messages therefore arrive and leave while the task thread computes.

Instrumentation, all per worker: bytes written to peers, seconds blocked in
the exchange, the largest staleness inside a reduce, the time and round of
every reduce (stamped on the event loop before any consequence of it is
sent, so timelines of different workers are causally consistent), and
model snapshots whose loss is evaluated after the clock stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from distributed import get_worker

from dask_lcicomm.asap.graphs import Graph
from dask_lcicomm.asap.links import OP, PeerLinks
from dask_lcicomm.asap.modes import make_exchange
from dask_lcicomm.asap.pacing import Pacing
from dask_lcicomm.asap.protocol import Action, Kind, Message, Reduced, Send
from dask_lcicomm.asap.task import Task

logger = logging.getLogger(__name__)

#: Runs installed in this process, by (run id, worker address): an
#: in-process cluster has several workers in one process.
_RUNS: dict[tuple[str, str], WorkerRun] = {}


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs to take part in one run."""

    run: str
    mode: str
    graph: Graph  # the graph the mode exchanges on (see modes.mode_graph)
    addresses: tuple[str, ...]  # worker address by rank
    task: Task
    rounds: int
    time_limit_s: float
    pacing: Pacing = Pacing()
    record_every: int = 1


class WorkerRun:
    """One worker's state in one run; created and used on its event loop,
    except :meth:`drive`, which runs in the task thread."""

    def __init__(self, spec: RunSpec, rank: int, connection_args: dict[str, Any]) -> None:
        self.spec, self.rank = spec, rank
        self.loop = asyncio.get_running_loop()
        self.machine = make_exchange(spec.mode, spec.graph, rank)
        self.links = PeerLinks(spec.run, rank, spec.addresses, connection_args)
        self.start_at = 0.0
        self.reduces: list[tuple[float, int, int]] = []  # (t, rounds completed, bytes sent)
        self.max_staleness = 0
        self.aborted = False  # set when another worker's task failed
        self._reduced: dict[int, Reduced] = {}
        self._changed = asyncio.Event()

    # ---- event loop side ----------------------------------------------------
    def deliver(self, src: int, message: Message) -> None:
        try:
            self._act(self.machine.receive(src, message))
        except RuntimeError as exc:  # a protocol violation fails the run, not the handler
            self.links.fail(f"from rank {src}: {exc}")

    def _act(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self.links.send(action)
            else:
                self.reduces.append((time.time() - self.start_at, action.round + 1,
                                     self.links.bytes_sent))
                self.max_staleness = max(self.max_staleness, action.staleness)
                self._reduced[action.round] = action
                self._changed.set()

    def abort(self) -> None:
        self.aborted = True
        self._changed.set()

    async def exchange(self, round: int, model: np.ndarray, deadline: float) -> Reduced | None:
        """Hand the stepped model of ``round`` to the exchange; the reduced
        model, or None if ``deadline`` (epoch seconds) passed or the run was
        aborted first."""
        self._act(self.machine.start_round(round, model))
        while round not in self._reduced:
            if self.links.failed.is_set():
                raise RuntimeError("; ".join(self.links.errors))
            remaining = deadline - time.time()
            if remaining <= 0 or self.aborted:
                return None
            self._changed.clear()
            waiters = [asyncio.ensure_future(self._changed.wait()),
                       asyncio.ensure_future(self.links.failed.wait())]
            _, pending = await asyncio.wait(waiters, timeout=remaining,
                                            return_when=asyncio.FIRST_COMPLETED)
            for waiter in pending:
                waiter.cancel()
        return self._reduced.pop(round)

    # ---- task thread side ---------------------------------------------------
    def drive(self, start_at: float) -> dict[str, Any]:
        """Run the rounds from ``start_at`` until done or out of time; the report."""
        spec, n = self.spec, len(self.spec.addresses)
        self.start_at = start_at
        deadline = start_at + spec.time_limit_s
        model = spec.task.init_model()
        lag = time.time() - start_at
        if lag > 0:
            logger.warning("rank %d starts %.2f s late", self.rank, lag)
        else:
            time.sleep(-lag)
        snapshots = [(0.0, 0, 0, model.copy())]
        wait_s = step_s = 0.0
        timed_out = False
        completed = 0
        for r in range(spec.rounds):
            if time.time() >= deadline or self.aborted:
                timed_out = True
                break
            t0 = time.perf_counter()
            stepped = spec.task.local_step(model, self.rank, r)
            pad = spec.pacing.duration(self.rank, r, n) - (time.perf_counter() - t0)
            if pad > 0:
                time.sleep(pad)
            t1 = time.perf_counter()
            step_s += t1 - t0
            future = asyncio.run_coroutine_threadsafe(self.exchange(r, stepped, deadline), self.loop)
            reduced = future.result(timeout=max(deadline - time.time(), 0.0) + 30.0)
            wait_s += time.perf_counter() - t1
            if reduced is None:
                timed_out = True
                break
            model, completed = reduced.model, r + 1
            if completed % spec.record_every == 0:
                snapshots.append((time.time() - start_at, completed, self.links.bytes_sent, model.copy()))
        elapsed = time.time() - start_at
        if snapshots[-1][1] != completed:  # the final model always has a point
            snapshots.append((elapsed, completed, self.links.bytes_sent, model))
        curve = [(t, r, b, spec.task.loss(m)) for t, r, b, m in snapshots]
        return {
            "rank": self.rank, "rounds": snapshots[-1][1], "elapsed_s": elapsed,
            "bytes_sent": self.links.bytes_sent, "messages_sent": self.links.messages_sent,
            "dropped": self.links.dropped, "wait_s": wait_s, "step_s": step_s,
            "max_staleness": self.max_staleness, "timed_out": timed_out, "start_lag_s": max(lag, 0.0),
            "reduces": list(self.reduces), "curve": curve,
            "final_loss": curve[-1][3], "final_accuracy": spec.task.accuracy(model),
        }


def _handler(address: str) -> Callable[..., None]:
    """The handler ``OP`` of the worker at ``address``."""

    def lci_asap(run: str, src: int, kind: str, r: int, step: int, data: Any = None) -> None:
        target = _RUNS.get((run, address))
        if target is None:
            logger.debug("message for unknown run %s from rank %d dropped", run, src)
            return
        target.deliver(src, Message(Kind(kind), r, data, step))

    return lci_asap


def install(spec: RunSpec, dask_worker: Any) -> int:
    """``client.run`` target: set up this worker for ``spec``; its rank."""
    rank = spec.addresses.index(dask_worker.address)
    dask_worker.handlers.setdefault(OP, _handler(dask_worker.address))
    spec.task.setup(rank, len(spec.addresses))
    _RUNS[(spec.run, dask_worker.address)] = WorkerRun(spec, rank, dask_worker.connection_args)
    return rank


async def open_links(run: str, dask_worker: Any) -> None:
    """``client.run`` target: open this worker's links to the peers it will
    exchange with (out- and in-neighbours: acknowledgements go back), before
    the clock starts, so that connection setup is not counted as training
    and its handshakes do not compete with the first round's models for the
    egress queues of a rate-limited network."""
    target = _RUNS[(run, dask_worker.address)]
    graph, rank = target.spec.graph, target.rank
    await target.links.open(sorted(set(graph.out[rank]) | set(graph.inn[rank])))
    if target.links.failed.is_set():
        raise RuntimeError("; ".join(target.links.errors))


def abort(run: str, dask_worker: Any) -> None:
    """``client.run`` target: stop this worker's part of ``run`` at its next wait."""
    target = _RUNS.get((run, dask_worker.address))
    if target is not None:
        target.abort()


async def uninstall(run: str, dask_worker: Any) -> None:
    """``client.run`` target: close the run's links and forget it."""
    target = _RUNS.pop((run, dask_worker.address), None)
    if target is not None:
        await target.links.close()


def train_task(run: str, start_at: float) -> dict[str, Any]:
    """The long-running task of one worker in run ``run``."""
    worker = get_worker()
    target = _RUNS.get((run, worker.address))
    if target is None:
        raise RuntimeError(f"run {run} is not installed on {worker.address}")
    return target.drive(start_at)
