"""The graphs both commands run on a cluster. ``workloads``': small versions, our own, of tests
the Dask maintainers watch for regressions (coiled/benchmarks ``tests/benchmarks/``), sized for a
2-core machine, each a function ``(client, size, timed)``: it persists its data untimed, runs what
the source test times inside ``with timed():`` and raises :class:`WrongResult` for a wrong result;
``size`` 1.0 is a full run. ``dask``'s: each ``(client, spec)`` times its own part of the graph
into a :class:`Measurement` and checks its result."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from time import perf_counter
from typing import Any

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
from distributed import wait

from benchmarks._cluster import workers
from benchmarks._comm_peers import Measurement

MiB = 2**20
Timed = Callable[[], AbstractContextManager[None]]


class WrongResult(AssertionError):
    """A workload computed something other than what it should have."""


@dataclass(frozen=True)
class Workload:
    name: str
    source: str  # the coiled/benchmarks test it is modelled on
    run: Callable[[Any, float, Timed], None]


def check(ok: bool, what: str) -> None:
    if not ok:
        raise WrongResult(what)


def _scaled(n: int, size: float, power: float = 1.0) -> int:
    """``n`` for a data volume scaled by ``size`` along ``1 / power`` axes."""
    return max(2, round(n * size ** (1 / power)))


def _identity(x: Any) -> Any:
    return x


def _persisted(*collections: Any) -> list[Any]:
    persisted = [c.persist() for c in collections]
    wait(persisted)
    return persisted


def array_sum(client: Any, size: float, timed: Timed) -> None:
    rows = _scaled(100_000, size)
    (x,) = _persisted(da.random.RandomState(1).random((rows, 160), chunks=(rows, 1)))
    with timed():
        sums = x.sum(axis=1).compute()
    check(math.isclose(sums.sum(), x.sum().compute(), rel_tol=1e-9), "row sums")


def sum_residuals(client: Any, size: float, timed: Timed) -> None:
    n = _scaled(240, size, power=3)
    (a,) = _persisted(da.random.RandomState(2).randint(0, 256, (n, n, n), chunks=max(n // 4, 1)))
    with timed():
        total = (a - a.mean(axis=0)).sum().compute()
    check(abs(total) < 1e-6 * a.size, f"residuals sum to {total}, not 0")


def vorticity(client: Any, size: float, timed: Timed) -> None:
    """Fields padded periodically and rechunked back, as xGCM pads."""
    n, layers = 500, _scaled(40, size)
    state = da.random.RandomState(3)
    u, v = _persisted(*(state.random((n, n, layers), chunks=(n, n, 1)) for _ in range(2)))
    dx, dy = _persisted(*(state.random((n + 1, n), chunks=-1) for _ in range(2)))

    def padded(field: Any) -> Any:
        return da.pad(field, ((0, 1), (0, 0), (0, 0)), mode="wrap").rechunk((n + 1, n, 1))

    with timed():
        per_layer = (dx[..., None] * padded(u) - dy[..., None] * padded(v)).sum(axis=(0, 1))
        per_layer = per_layer.compute()
    u0, v0, gx, gy = client.compute([u[:, :, 0], v[:, :, 0], dx, dy], sync=True)
    first = (gx * np.concatenate([u0, u0[:1]]) - gy * np.concatenate([v0, v0[:1]])).sum()
    check(math.isclose(per_layer[0], first, rel_tol=1e-9), "vorticity of the first layer")


def map_overlap(client: Any, size: float, timed: Timed) -> None:
    """A small sample of many small chunks: the graph the client builds and sends is the work."""
    n = _scaled(6000, size, power=2)
    x = da.random.RandomState(4).random((n, n), chunks=(50, 50))
    middle = slice(n // 2, n // 2 + 10)
    with timed():
        sample = x.map_overlap(_identity, depth=1)[middle, middle].compute()
    check(np.array_equal(sample, x[middle, middle].compute()), "map_overlap sample")


def anom_mean(client: Any, size: float, timed: Timed) -> None:
    """xarray's ``groupby("day")`` anomaly without flox, written in dask.array."""
    days = 16
    rows = days * _scaled(20, size)
    (arr,) = _persisted(da.random.RandomState(5).random((rows, 65_536), chunks=(1, -1)))
    day = np.arange(rows) % days
    with timed():
        climatology = da.stack([arr[d::days].mean(axis=0) for d in range(days)])
        anomaly = (arr - climatology[day]).mean(axis=0).compute()
    check(float(np.abs(anomaly).max()) < 1e-9, "anomalies do not average to 0")


def swap_axes(client: Any, size: float, timed: Timed, method: str) -> None:
    n = _scaled(5000, size, power=2)
    piece = max(n // 25, 1)
    (x,) = _persisted(da.random.RandomState(6).random((n, n), chunks=(n, piece)))
    with timed():
        total = x.rechunk((piece, n), method=method).sum().compute()
    check(math.isclose(total, x.sum().compute(), rel_tol=1e-9), "rechunked sum")


def _timeseries(start: str, days: float, seed: int, partition: str = "12h") -> Any:
    end = pd.Timestamp(start) + pd.Timedelta(days=days)
    return dask.datasets.timeseries(start=start, end=end, freq="600ms", partition_freq=partition,
                                    seed=seed, dtypes={f"c{i}": float for i in range(16)})


def align(client: Any, size: float, timed: Timed) -> None:
    """As upstream, the frames are made in the timed graph. Several partitions each: aligning a
    frame of one partition fails in Dask 2026.8 (a task of the repartition is missing)."""
    days = max(size * 6, 2.0)
    first = _timeseries("2020-01-01", days, 7)
    second = _timeseries("2010-01-01", days / 2, 8, partition="8h")
    with timed():
        means = (second - first).mean().compute()
    check(len(means) == 16 and bool(means.isna().all()), "disjoint ranges must give NaN")


def _keyed_part(index: int, rows: int, stride: int, modulus: int) -> Any:
    """Key ``stride * row % modulus``: a permutation of the rows when the two are coprime."""
    numbers = np.arange(index * rows, (index + 1) * rows, dtype=np.int64)
    frame = pd.DataFrame(np.random.default_rng(index).random((rows, 8)),
                         columns=[f"c{i}" for i in range(8)])
    frame["key"] = numbers * stride % modulus
    return frame


def _keyed(parts: int, rows: int, stride: int, modulus: int) -> Any:
    return dd.from_map(_keyed_part, range(parts), rows=rows, stride=stride, modulus=modulus)


def join_p2p(client: Any, size: float, timed: Timed) -> None:
    parts = 16
    rows = _scaled(2_000_000, size) // parts
    left, right = _persisted(_keyed(parts, rows, 7_919, parts * rows),
                             _keyed(parts // 2, rows, 2 * 7_919, parts * rows))
    with timed():
        joined = left.merge(right, on="key", how="inner", shuffle_method="p2p")
        count = joined.map_partitions(_identity).size.compute()
    check(count == len(right) * 17, f"join gave {count} cells")  # each right key matches one row


def set_index(client: Any, size: float, timed: Timed) -> None:
    parts = 16
    (frame,) = _persisted(_keyed(parts, _scaled(2_000_000, size) // parts, 1, 2**62))
    with timed():
        rows = len(frame.set_index("c0", shuffle_method="p2p").map_partitions(_identity).persist())
    check(rows == len(frame), "set_index lost rows")


def shuffle_p2p(client: Any, size: float, timed: Timed) -> None:
    (frame,) = _persisted(_timeseries("2020-01-01", max(size * 8, 0.5), 9))
    with timed():
        cells = frame.shuffle("c0", shuffle_method="p2p").map_partitions(_identity).size.compute()
    check(cells == frame.size.compute(), "shuffle lost cells")


def _h2o_part(index: int, rows: int, groups: int, ids: int) -> Any:
    """The h2o groupby table: ids 1, 2, 4, 5 take ``groups`` values, ids 3 and 6 ``ids``."""
    rng = np.random.default_rng(100 + index)
    low, high = rng.integers(1, groups + 1, (2, rows))
    many = rng.integers(1, ids + 1, rows)
    return pd.DataFrame({
        "id1": pd.array([f"id{i:03d}" for i in low]), "id2": pd.array([f"id{i:03d}" for i in high]),
        "id3": pd.array([f"id{i:010d}" for i in many]),
        "id4": low.astype(np.int32), "id5": high.astype(np.int32), "id6": many.astype(np.int32),
        "v1": rng.integers(1, 6, rows, dtype=np.int32), "v2": rng.integers(1, 16, rows, dtype=np.int32),
        "v3": np.round(rng.random(rows) * 100, 6),
    })


def h2o_groupby(client: Any, size: float, timed: Timed) -> None:
    parts, groups = 8, 100
    rows = _scaled(1_000_000, size) // parts
    (x,) = _persisted(dd.from_map(_h2o_part, range(parts), rows=rows, groups=groups,
                                  ids=max(rows * parts // groups, 1)))
    by = {"dropna": False, "observed": True}
    with timed():
        q1 = x.groupby("id1", **by).agg({"v1": "sum"}).compute()
        x.groupby(["id1", "id2"], **by).agg({"v1": "sum"}).compute()
        q3 = x.groupby("id3", **by).agg({"v1": "sum", "v3": "mean"}).compute()
        x.groupby("id4", **by).agg({"v1": "mean", "v2": "mean", "v3": "mean"}).compute()
        x.groupby("id6", **by).agg({"v1": "sum", "v2": "sum", "v3": "sum"}).compute()
        x.groupby(["id4", "id5"], **by).agg({"v3": ["median", "std"]}, shuffle_method="p2p").compute()
        q7 = x.groupby("id3", **by).agg({"v1": "max", "v2": "min"}).compute()
        q7["range_v1_v2"] = q7["v1"] - q7["v2"]
    check(int(q1["v1"].sum()) == int(x["v1"].sum().compute()), "q1 lost rows")
    check(len(q7) == len(q3), "q3 and q7 found different groups of id3")


def _second(root: bytes, i: int) -> int:
    return i


def work_stealing(client: Any, size: float, timed: Timed) -> None:
    n = _scaled(2000, size)
    root = dask.delayed(bytes)(2**20)  # fetched by every worker
    tasks = [dask.delayed(_second)(root, i) for i in range(n)]
    with timed():
        results = client.gather(client.compute(tasks))
    check(results == list(range(n)), "work-stealing results")


def futures(client: Any, size: float, timed: Timed, n: int, one_by_one: bool) -> None:
    """``n`` futures of trivial tasks: submitted and awaited one by one, or mapped at once."""
    n = _scaled(n, size)
    with timed():
        if one_by_one:
            results = [client.submit(_identity, i, pure=False).result() for i in range(n)]
        else:
            results = client.gather(client.map(_identity, range(n), pure=False))
    check(results == list(range(n)), "futures' results")


_SWAP_AXES = "test_rechunk.py::test_swap_axes_in_memory"
WORKLOADS = (
    Workload("array-sum", "test_array.py::test_basic_sum", array_sum),
    Workload("sum-residuals", "test_zarr.py::test_sum_residuals", sum_residuals),
    Workload("vorticity", "test_array.py::test_vorticity", vorticity),
    Workload("map-overlap", "test_array.py::test_map_overlap_sample", map_overlap),
    Workload("anom-mean", "test_xarray.py::test_anom_mean", anom_mean),
    Workload("rechunk-p2p", _SWAP_AXES, partial(swap_axes, method="p2p")),
    Workload("rechunk-tasks", _SWAP_AXES, partial(swap_axes, method="tasks")),
    Workload("align", "test_dataframe.py::test_dataframe_align", align),
    Workload("join-p2p", "test_join.py::test_join_big", join_p2p),
    Workload("set-index", "test_join.py::test_set_index", set_index),
    Workload("shuffle-p2p", "test_dataframe.py::test_shuffle", shuffle_p2p),
    Workload("h2o-groupby", "test_h2o.py::test_q1..test_q7", h2o_groupby),
    Workload("work-stealing",
             "test_work_stealing.py::test_trivial_workload_should_not_cause_work_stealing",
             work_stealing),
    Workload("submit-result", "test_futures.py::test_single_future",
             partial(futures, n=200, one_by_one=True)),
    Workload("large-map", "test_futures.py::test_large_map", partial(futures, n=3000, one_by_one=False)),
)
BY_NAME = {w.name: w for w in WORKLOADS}


@dataclass(frozen=True)
class GraphSpec:
    """One of ``dask``'s graphs at one size: what the cluster child is asked to run."""

    name: str
    size: int
    piece: int
    timeout_s: float


def _computed(client: Any, collection: Any, expected: Any, close: bool = False) -> Measurement:
    """Time computing ``collection``, then check its result (``close``: floats summed in
    another order)."""
    start = perf_counter()
    got = client.compute(collection).result()
    seconds = perf_counter() - start
    check(bool(np.allclose(got, expected)) if close else got == expected,
          f"{got!r}, expected {expected!r}")
    return Measurement(1, seconds)


def _on(client: Any, worker: str, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` as a task that runs on ``worker`` and nowhere else."""
    return client.submit(function, *args, workers=[worker], allow_other_workers=False, pure=False)


def _random_bytes(nbytes: int) -> np.ndarray:
    """Data no backend can compress (a random MiB repeated: beyond lz4's 64 KiB window), made
    in ~60% of the time fully random GiBs would take (untimed, but it lengthens every round)."""
    block = np.random.default_rng().integers(0, 256, min(nbytes, MiB), dtype=np.uint8)
    return np.resize(block, nbytes)


def measure_piecewise(client: Any, spec: GraphSpec, to_client: bool) -> Measurement:
    """Time moving each piece made on the first worker to the client, or to the other worker
    (np.sum there); each is released before the next (256 MiB pieces: ~1 GiB alive)."""
    source, other = workers(client)[:2]
    seconds = 0.0
    for _ in range(spec.size // spec.piece):
        made = _on(client, source, _random_bytes, spec.piece)
        wait(made)
        start = perf_counter()
        if to_client:
            client.gather(made)
        else:
            _on(client, other, np.sum, made).result()
        seconds += perf_counter() - start
        del made
    return Measurement(spec.size // spec.piece, seconds)


def measure_rechunk(client: Any, spec: GraphSpec, method: str) -> Measurement:
    """Column blocks to row blocks: all-to-all, half of it between workers."""
    (columns,) = _persisted(da.random.random((spec.size, spec.size), chunks=(spec.size, spec.piece)))
    expected = client.compute(columns.sum()).result()
    rows = columns.rechunk((spec.piece, spec.size), method=method)
    start = perf_counter()
    (rows,) = _persisted(rows)
    seconds = perf_counter() - start
    del columns
    check(bool(np.allclose(client.compute(rows.sum()).result(), expected)), "rechunked sum")
    return Measurement(1, seconds)


def measure_array(client: Any, spec: GraphSpec) -> Measurement:
    """``(x + x.T).sum()``: the transpose makes chunks cross workers."""
    x = da.random.random((spec.size, spec.size), chunks=spec.piece)
    return _computed(client, (x + x.T).sum(), 2 * client.compute(x.sum()).result(), close=True)


def _random_frame(seed: int, rows: int) -> Any:
    """One partition, made on the worker: not shipped in the graph (1M rows: 15 MiB of it)."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"key": rng.integers(0, 1000, rows), "value": rng.random(rows)})


def measure_shuffle(client: Any, spec: GraphSpec) -> Measurement:
    """Shuffle on ``key`` (P2P on a cluster) and count rows per partition:
    ``len`` alone would be optimised into skipping the shuffle."""
    (data,) = _persisted(dd.from_map(_random_frame, range(spec.size // spec.piece), rows=spec.piece))
    return _computed(client, data.shuffle("key").map_partitions(len).sum(), spec.size)


def measure_tree(client: Any, spec: GraphSpec) -> Measurement:
    """Delayed sums of ``piece`` values, level by level: tiny tasks, so messages dominate."""
    level = [dask.delayed(int)(i) for i in range(spec.size)]  # a task per leaf
    while len(level) > 1:
        level = [dask.delayed(sum)(level[i:i + spec.piece])
                 for i in range(0, len(level), spec.piece)]
    return _computed(client, level[0], spec.size * (spec.size - 1) // 2)


def _stencil(left: np.ndarray, middle: np.ndarray, right: np.ndarray) -> np.ndarray:
    """One step of one cell: a 3-point average over its ring neighbours."""
    return (left + 2 * middle + right) / 4


def measure_amt(client: Any, spec: GraphSpec) -> Measurement:
    """HPX's 1d_stencil: ``piece`` cells on a ring for ``size`` steps, a task per cell and
    step, cell ``i`` on worker ``i % 2``: every dependency crosses workers."""
    steps, cells, points = spec.size, spec.piece, 128  # 1 KiB a cell: a task's whole payload
    pinned = workers(client)
    home = [pinned[i % len(pinned)] for i in range(cells)]
    start = perf_counter()
    row = [_on(client, home[i], np.full, points, float(i)) for i in range(cells)]
    for _ in range(steps):
        row = [_on(client, home[i], _stencil, row[i - 1], row[i], row[(i + 1) % cells])
               for i in range(cells)]
    result = client.gather(row)
    seconds = perf_counter() - start
    grid = np.stack([np.full(points, float(i)) for i in range(cells)])
    for _ in range(steps):
        grid = _stencil(np.roll(grid, 1, axis=0), grid, np.roll(grid, -1, axis=0))
    check(bool(np.allclose(np.stack(result), grid)), "stencil grid")
    return Measurement(steps * cells, seconds)
