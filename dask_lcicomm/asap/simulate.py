"""A discrete-event driver for the exchange state machines: no network, no
threads, virtual time.

Workers alternate a local step (taking ``compute_time``) and their mode's
exchange; every message takes ``delay`` to arrive, in order per link when
``fifo``. The simulation checks what the real runtime cannot observe
exactly: the spread of completed rounds across all workers at every
instant, and whether anyone is left waiting forever (a deadlock shows as
workers that did not finish once no event is left). Every run is bounded by
``max_events``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dask_lcicomm.asap.protocol import Exchange, Message, Reduced, Send

Step = Callable[[int, int, np.ndarray], np.ndarray]  # (rank, round, model) -> model


@dataclass
class SimResult:
    models: list[np.ndarray]
    rounds: list[int]  # rounds each worker completed
    finished: bool  # every worker completed every round
    max_gap: int  # largest spread of completed rounds at any instant
    max_staleness: int  # largest round difference inside one reduce
    time: float  # virtual time when the last worker finished (or stalled)
    messages: int


def simulate(
    exchanges: Sequence[Exchange],
    models: Sequence[np.ndarray],
    rounds: int,
    *,
    step: Step | None = None,
    compute_time: Callable[[int, int], float] = lambda rank, round: 1.0,
    delay: Callable[[int, int, Message], float] = lambda src, dst, message: 0.1,
    fifo: bool = True,
    max_events: int = 1_000_000,
) -> SimResult:
    """Run ``rounds`` rounds on every worker; ``step`` is the local update
    (identity if None)."""
    n = len(exchanges)
    models = list(models)
    completed = [0] * n
    order = itertools.count()
    events: list[tuple[float, int, str, tuple]] = []
    link_free: dict[tuple[int, int], float] = {}
    result = SimResult(models, completed, False, 0, 0, 0.0, 0)

    def schedule(t: float, what: str, payload: tuple) -> None:
        heapq.heappush(events, (t, next(order), what, payload))

    def act(now: float, rank: int, actions: list) -> None:
        for action in actions:
            if isinstance(action, Send):
                arrival = now + delay(rank, action.dst, action.message)
                if fifo:
                    arrival = max(arrival, link_free.get((rank, action.dst), 0.0))
                    link_free[(rank, action.dst)] = arrival
                result.messages += 1
                schedule(arrival, "deliver", (rank, action.dst, action.message))
            elif isinstance(action, Reduced):
                if action.round != completed[rank]:
                    raise AssertionError(f"rank {rank} reduced round {action.round}, "
                                         f"expected {completed[rank]}")
                models[rank] = action.model
                completed[rank] += 1
                result.max_staleness = max(result.max_staleness, action.staleness)
                spread = max(completed) - min(completed)
                result.max_gap = max(result.max_gap, spread)
                if completed[rank] < rounds:
                    schedule(now + compute_time(rank, completed[rank]), "stepped", (rank,))

    for rank in range(n):
        schedule(compute_time(rank, 0), "stepped", (rank,))
    for _ in range(max_events):
        if not events:
            break
        now, _, what, payload = heapq.heappop(events)
        result.time = now
        if what == "stepped":
            (rank,) = payload
            r = completed[rank]
            model = step(rank, r, models[rank]) if step is not None else models[rank]
            act(now, rank, exchanges[rank].start_round(r, model))
        else:
            src, dst, message = payload
            act(now, dst, exchanges[dst].receive(src, message))
    else:
        raise RuntimeError(f"simulation did not end within {max_events} events")
    result.finished = all(c == rounds for c in completed)
    return result
