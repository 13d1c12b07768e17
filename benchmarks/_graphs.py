"""The graphs of ``python -m benchmarks dask``, run in the cluster child:
each times only its own part (data it merely needs is made untimed), moves
big data piece by piece, and checks its result."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from time import perf_counter
from typing import Any

import numpy as np
from distributed import wait

from benchmarks._cluster import workers
from benchmarks._comm_peers import Measurement

MiB = 2**20


@dataclass(frozen=True)
class GraphSpec:
    """One graph at one size (see :class:`benchmarks.dask.Graph`)."""

    name: str
    size: int
    piece: int
    timeout_s: float


def _timed(compute: Callable[[], Any]) -> float:
    start = perf_counter()
    compute()
    return perf_counter() - start


def _random_bytes(nbytes: int) -> np.ndarray:
    """Data no backend can compress (a random MiB repeated: far beyond lz4's
    64 KiB window), made in ~60% of the time fully random GiBs would take
    (untimed, but it lengthens every round)."""
    block = np.random.default_rng().integers(0, 256, min(nbytes, MiB), dtype=np.uint8)
    return np.resize(block, nbytes)


def _piecewise(client: Any, spec: GraphSpec, use: Callable[[Any, Any, str], Any]) -> Measurement:
    """Time ``use(client, piece, other_worker)`` on each piece made on the
    first worker, released before the next (256 MiB pieces: ~1 GiB alive)."""
    source, other = workers(client)[:2]
    count, seconds = 0, 0.0
    for _ in range(spec.size // spec.piece):
        made = client.submit(_random_bytes, spec.piece, workers=[source],
                             allow_other_workers=False, pure=False)
        wait(made)
        seconds += _timed(partial(use, client, made, other))
        del made
        count += 1
    return Measurement(count, seconds)


def _sum_on(client: Any, piece: Any, worker: str) -> Any:
    return client.submit(np.sum, piece, workers=[worker], allow_other_workers=False,
                         pure=False).result()


def _gather(client: Any, piece: Any, worker: str) -> Any:
    return client.gather(piece)


def measure_move(client: Any, spec: GraphSpec) -> Measurement:
    return _piecewise(client, spec, _sum_on)


def measure_gather(client: Any, spec: GraphSpec) -> Measurement:
    return _piecewise(client, spec, _gather)


def measure_array(client: Any, spec: GraphSpec) -> Measurement:
    """``(x + x.T).sum()``: the transpose makes chunks cross workers."""
    import dask.array as da

    x = da.random.random((spec.size, spec.size), chunks=spec.piece)
    return Measurement(1, _timed(lambda: client.compute((x + x.T).sum()).result()))


def _leaf(index: int) -> int:
    return index


def measure_tree(client: Any, spec: GraphSpec) -> Measurement:
    """Sums of ``spec.piece`` delayed values, level by level, down to one:
    thousands of tiny tasks, so scheduler and worker messages dominate."""
    import dask

    level = [dask.delayed(_leaf)(i) for i in range(spec.size)]
    while len(level) > 1:
        level = [dask.delayed(sum)(level[i:i + spec.piece])
                 for i in range(0, len(level), spec.piece)]
    (total,) = level
    expected = spec.size * (spec.size - 1) // 2
    return Measurement(1, _timed(lambda: _check(client.compute(total).result(), expected)))


def _random_frame(seed: int, rows: int) -> Any:
    """One partition: pandas made on the worker, so that the frame is not
    shipped inside the graph (a 1M-row graph is 15 MiB through the scheduler)."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    return pd.DataFrame({"key": rng.integers(0, 1000, rows), "value": rng.random(rows)})


def measure_shuffle(client: Any, spec: GraphSpec) -> Measurement:
    """Shuffle on ``key`` (P2P on a cluster) and count rows per partition:
    ``len`` alone would be optimised into skipping the shuffle."""
    import dask.dataframe as dd

    _quiet_shuffle_log()
    data = client.persist(dd.from_map(_random_frame, range(spec.size // spec.piece),
                                      rows=spec.piece))
    wait(data)
    rows = data.shuffle("key").map_partitions(len).sum()
    return Measurement(1, _timed(lambda: _check(client.compute(rows).result(), spec.size)))


def _quiet_shuffle_log() -> None:
    """The scheduler here logs a WARNING per P2P shuffle: routine, and noise."""
    logging.getLogger("distributed.shuffle").setLevel(logging.ERROR)


def _check(got: Any, expected: Any) -> None:
    """A wrong result must not pass for a fast one."""
    if got != expected:
        raise AssertionError(f"wrong result: {got!r}, expected {expected!r}")


def measure_rechunk(client: Any, spec: GraphSpec, method: str) -> Measurement:
    """Column blocks to row blocks: all-to-all, half of it between workers."""
    import dask.array as da

    _quiet_shuffle_log()
    columns = client.persist(da.random.random((spec.size, spec.size),
                                              chunks=(spec.size, spec.piece)))
    wait(columns)
    expected = client.compute(columns.sum()).result()
    rows = columns.rechunk((spec.piece, spec.size), method=method)
    start = perf_counter()
    rows = client.persist(rows)
    wait(rows)
    seconds = perf_counter() - start
    del columns
    _check_close(client.compute(rows.sum()).result(), expected)
    return Measurement(1, seconds)


#: Points per stencil cell: a fine-grained task's whole payload (1 KiB).
STENCIL_POINTS = 128


def _cell(index: int) -> np.ndarray:
    return np.full(STENCIL_POINTS, float(index))


def _stencil(left: np.ndarray, middle: np.ndarray, right: np.ndarray) -> np.ndarray:
    """One step of one cell: a 3-point average over its ring neighbours."""
    return (left + 2 * middle + right) / 4


def measure_amt(client: Any, spec: GraphSpec) -> Measurement:
    """HPX's 1d_stencil: ``piece`` cells on a ring for ``size`` steps, a task
    per cell and step, cell ``i`` on worker ``i % 2``: every dependency
    crosses workers."""
    steps, cells = spec.size, spec.piece
    pinned = workers(client)

    def submit(function: Callable[..., Any], cell: int, *args: Any) -> Any:
        return client.submit(function, *args, workers=[pinned[cell % len(pinned)]],
                             allow_other_workers=False, pure=False)

    start = perf_counter()
    row = [submit(_cell, i, i) for i in range(cells)]
    for _ in range(steps):
        row = [submit(_stencil, i, row[i - 1], row[i], row[(i + 1) % cells])
               for i in range(cells)]
    result = client.gather(row)
    seconds = perf_counter() - start
    _check_close(np.stack(result), _stencil_reference(steps, cells))
    return Measurement(steps * cells, seconds)


def _stencil_reference(steps: int, cells: int) -> np.ndarray:
    grid = np.stack([_cell(i) for i in range(cells)])
    for _ in range(steps):
        grid = _stencil(np.roll(grid, 1, axis=0), grid, np.roll(grid, -1, axis=0))
    return grid


def _check_close(got: Any, expected: Any) -> None:
    """:func:`_check` for floating-point results summed in another order."""
    if not np.allclose(got, expected):
        raise AssertionError(f"wrong result: {got!r}, expected {expected!r}")
