"""Integration tests: real Dask workloads running over the ``lci://`` comm.

Every connection in these tests (client <-> scheduler, scheduler <-> worker,
worker <-> worker, nanny <-> worker) goes through the comm backend selected
by ``PROTOCOL``.  The tests only listen on / contact loopback (127.0.0.1).

To check the test logic itself against Dask's reference backend, replace
``PROTOCOL = "lci"`` by ``"tcp"``; the tests contain nothing lci-specific
beyond the address scheme.
"""

from __future__ import annotations

import collections
import contextlib
import operator
import os
import signal
import time

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster, wait
from distributed.utils_test import gen_cluster
from eventually import eventually
from ofi_support import needs_ofi
from ucx_support import needs_ucx

from dask_lcicomm import connections

PROTOCOL = "lci"

HOST = "127.0.0.1"
# Upper bound for any single blocking call of a test (a computation, a wait
# for workers, ...).  Tests fail instead of hanging when the comm misbehaves.
TIMEOUT = 120
# gen_cluster bound for the whole (async) test body.
GEN_TIMEOUT = 90

MiB = 2**20

# Keep every connection attempt short so that a broken comm fails fast.
CLUSTER_CONFIG = {
    "distributed.comm.timeouts.connect": "20s",
    "distributed.scheduler.work-stealing": True,
}


def _prefix() -> str:
    return f"{PROTOCOL}://"


# ---------------------------------------------------------------------------
# helpers executed on workers (module level: pickled by reference; spawned
# LocalCluster worker processes inherit sys.path and can import this module)
# ---------------------------------------------------------------------------


def inc(x):
    return x + 1


def add(x, y):
    return x + y


def make_array(nbytes, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 255, size=nbytes, dtype=np.uint8)


def checksum(a):
    return int(np.asarray(a, dtype=np.uint64).sum()), a.nbytes


def slow_square(i, delay):
    time.sleep(delay)
    return i * i


def total(*values):
    return sum(values)


def _transfers(dask_worker):
    """Number of incoming worker->worker transfers this worker performed."""
    return len(dask_worker.transfer_incoming_log)


# ---------------------------------------------------------------------------
# gen_cluster: in-process scheduler + 2 workers, all listening on PROTOCOL
# ---------------------------------------------------------------------------


gen_lci_cluster = gen_cluster(
    client=True,
    nthreads=[(HOST, 1)] * 2,
    scheduler_kwargs={"protocol": PROTOCOL},
    worker_kwargs={"protocol": PROTOCOL},
    config=CLUSTER_CONFIG,
    timeout=GEN_TIMEOUT,
)


@gen_lci_cluster
async def test_gen_cluster_submit_gather(c, s, a, b):
    assert s.address.startswith(_prefix()), s.address
    assert a.address.startswith(_prefix()), a.address
    assert b.address.startswith(_prefix()), b.address
    assert c.scheduler.address.startswith(_prefix())

    fut = c.submit(inc, 41)
    assert await fut == 42

    futures = c.map(inc, range(50))
    results = await c.gather(futures)
    assert results == [i + 1 for i in range(50)]

    # a small reduction tree over the mapped results
    s1 = c.submit(sum, futures[:25])
    s2 = c.submit(sum, futures[25:])
    assert await c.submit(add, s1, s2) == sum(range(1, 51))

    # an explicit RPC to the scheduler over the comm
    info = await c.scheduler.identity()
    assert info["address"] == s.address
    assert len(info["workers"]) == 2
    assert all(addr.startswith(_prefix()) for addr in info["workers"])


@gen_lci_cluster
async def test_gen_cluster_result_moves_between_workers(c, s, a, b):
    # small (eager/piggybacked) and large (fragmented, zero-copy) payloads
    for nbytes, seed in [(1000, 1), (3 * MiB + 7, 2)]:
        x = c.submit(make_array, nbytes, seed, workers=[a.address], pure=False)
        await wait(x)
        assert x.key in a.data and x.key not in b.data

        y = c.submit(checksum, x, workers=[b.address], allow_other_workers=False)
        result = await y
        expected = checksum(make_array(nbytes, seed))
        assert result == expected

        # the value was fetched by b from a over the comm
        assert y.key in b.data
        assert x.key in b.data
        np.testing.assert_array_equal(b.data[x.key], a.data[x.key])
        assert any(
            x.key in entry.get("keys", {}) for entry in b.transfer_incoming_log
        ), list(b.transfer_incoming_log)
        del x, y

    # chains alternating between the two workers
    fut = c.submit(inc, 0, workers=[a.address])
    for i in range(10):
        worker = b if i % 2 == 0 else a
        fut = c.submit(inc, fut, workers=[worker.address], allow_other_workers=False)
    assert await fut == 11


@pytest.mark.parametrize(
    "nbytes",
    [0, 1, 64 * 1024 - 1, 64 * 1024 + 1, 8 * MiB + 3, 24 * MiB],
)
@gen_lci_cluster
async def test_gen_cluster_scatter_gather_numpy(c, s, a, b, nbytes):
    rng = np.random.default_rng(nbytes)
    arr = rng.integers(0, 2**31, size=nbytes // 8, dtype=np.int64)
    tail = rng.integers(0, 255, size=nbytes % 8, dtype=np.uint8)

    [fut_arr, fut_tail] = await c.scatter([arr, tail], workers=[a.address])
    assert fut_arr.key in a.data

    # gather through the scheduler and directly from the worker
    back = await c.gather(fut_arr, direct=False)
    np.testing.assert_array_equal(back, arr)
    back = await c.gather(fut_arr, direct=True)
    np.testing.assert_array_equal(back, arr)
    back_tail = await c.gather(fut_tail)
    np.testing.assert_array_equal(back_tail, tail)

    # move it to the other worker, then back to the client from there
    moved = c.submit(np.copy, fut_arr, workers=[b.address], allow_other_workers=False)
    np.testing.assert_array_equal(await moved, arr)
    assert fut_arr.key in b.data

    # replicate and broadcast-scatter
    await c.replicate([fut_arr])
    who_has = await c.who_has([fut_arr])
    assert set(who_has[fut_arr.key]) == {a.address, b.address}

    [bcast] = await c.scatter([arr], broadcast=True, hash=False)
    assert bcast.key != fut_arr.key
    assert bcast.key in a.data and bcast.key in b.data
    np.testing.assert_array_equal(a.data[bcast.key], arr)
    np.testing.assert_array_equal(b.data[bcast.key], arr)


# ---------------------------------------------------------------------------
# LocalCluster, with worker processes (nannies) and with in-process workers
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _local_cluster(processes: bool, lci_config: dict | None = None):
    """A LocalCluster of two one-thread workers on PROTOCOL, and its client."""
    with dask.config.set({**CLUSTER_CONFIG, **(lci_config or {})}), LocalCluster(
        protocol=PROTOCOL,
        host=HOST,
        processes=processes,
        n_workers=2,
        threads_per_worker=1,
        dashboard_address=":0",
        scheduler_kwargs={"dashboard": False},
    ) as cluster, Client(cluster, timeout=TIMEOUT) as client:
        client.wait_for_workers(2, timeout=TIMEOUT)
        yield cluster, client


_THREAD_PROGRESS = {"distributed.comm.lci.progress": "thread", "distributed.comm.lci.ndevices": 2}
_UCX = {"distributed.comm.lci.providers": ["ucx"]}
_OFI = {"distributed.comm.lci.providers": ["ofi"]}
#: A message fabric inside the process (tests/fabric_support.py).
_MEMORY = {"distributed.comm.lci.providers": ["memory"]}


@pytest.fixture(
    params=[
        pytest.param((True, None), id="processes"),
        pytest.param((False, None), id="threads"),
        pytest.param((False, _THREAD_PROGRESS), id="threads-progress-thread"),
        needs_ucx((True, _UCX), id="processes-ucx"),
        needs_ucx((False, {**_UCX, **_THREAD_PROGRESS}), id="threads-progress-thread-ucx"),
        pytest.param((False, {**_MEMORY, **_THREAD_PROGRESS}), id="threads-progress-thread-memory"),
        needs_ofi((True, _OFI), id="processes-ofi"),
    ],
)
def lci_client(request):
    """Worker processes, and in-process workers with the default and with
    thread progress over two devices (in one process every comm and channel
    shares one parcelport, which is where races between comms show); and
    both over UCX alone, and in-process workers over the in-process message
    fabric alone (no channel may fall back to TCP)."""
    processes, lci_config = request.param
    with _local_cluster(processes=processes, lci_config=lci_config) as (cluster, client):
        if lci_config and "distributed.comm.lci.providers" in lci_config:
            expected = set(lci_config["distributed.comm.lci.providers"])
            eventually(lambda: _assert_providers(client, expected))
        yield cluster, client


def _assert_providers(client, expected):
    """Every device of every worker and of the scheduler is on ``expected``."""
    links = client.run_on_scheduler(connections)
    for worker_links in client.run(connections).values():
        links.extend(worker_links)
    assert links and {link["provider"] for link in links} == expected, links


def _assert_lci_cluster(cluster, client):
    assert cluster.scheduler_address.startswith(_prefix()), cluster.scheduler_address
    workers = client.scheduler_info()["workers"]
    assert len(workers) == 2
    assert all(addr.startswith(_prefix()) for addr in workers), list(workers)


def _total_transfers(client):
    return sum(client.run(_transfers, wait=True).values())


# from_array embeds the 30 MiB numpy array in the graph: a deliberately large
# client -> scheduler -> worker message.
@pytest.mark.filterwarnings("ignore:Sending large graph:UserWarning")
def test_local_cluster_array(lci_client):
    cluster, client = lci_client
    _assert_lci_cluster(cluster, client)
    import dask.array as da

    rng = np.random.default_rng(0)
    xn = rng.random((2000, 2000))
    x = da.from_array(xn, chunks=(500, 500))
    # x.T pairs chunk (i, j) with chunk (j, i): tasks need data held elsewhere
    y = (x + x.T).sum()
    result = client.compute(y).result(timeout=TIMEOUT)
    assert result == pytest.approx((xn + xn.T).sum(), rel=1e-12)

    # an array computation returning a multi-MiB array
    z = (x + x.T)[::2, ::2] * 2
    zn = client.compute(z).result(timeout=TIMEOUT)
    np.testing.assert_allclose(zn, ((xn + xn.T)[::2, ::2]) * 2)

    # matrix product: all-to-all movement of blocks
    m = client.compute(x[:1000, :1000] @ x.T[:1000, :1000]).result(timeout=TIMEOUT)
    np.testing.assert_allclose(m, xn[:1000, :1000] @ xn.T[:1000, :1000])

    assert _total_transfers(client) > 0


def _make_df(n=20_000, nkeys=97, seed=0):
    import pandas as pd

    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "key": rng.integers(0, nkeys, size=n),
            "value": rng.random(n),
            "count": rng.integers(0, 100, size=n),
            "text": rng.choice(["a", "bb", "ccc", "dddd"], size=n),
        }
    )


@pytest.mark.parametrize("shuffle_method", ["tasks", "p2p"])
def test_local_cluster_dataframe_shuffle(lci_client, shuffle_method):
    cluster, client = lci_client
    _assert_lci_cluster(cluster, client)
    import dask.dataframe as dd
    import pandas as pd

    pdf = _make_df()
    ddf = dd.from_pandas(pdf, npartitions=8)

    shuffled = ddf.shuffle("key", npartitions=6, shuffle_method=shuffle_method)
    # one list of distinct keys per output partition
    parts_keys = client.compute(
        shuffled.map_partitions(
            lambda p: pd.Series([sorted(p["key"].unique().tolist())]),
            meta=(None, "object"),
        )
    ).result(timeout=TIMEOUT)
    seen = collections.Counter(k for keys in parts_keys for k in keys)
    # every key lives in exactly one output partition
    assert seen and max(seen.values()) == 1, seen.most_common(3)
    assert set(seen) == set(pdf["key"].unique())

    result = client.compute(shuffled).result(timeout=TIMEOUT)
    cols = ["key", "value", "count", "text"]
    assert len(result) == len(pdf)

    def canonical(df):
        # dask may convert object strings to (pyarrow-backed) string dtypes
        df = df.astype({"text": object})
        return df.sort_values(cols).reset_index(drop=True)

    pd.testing.assert_frame_equal(canonical(result), canonical(pdf))

    # groupby aggregation with several output partitions (shuffle-based)
    agg = ddf.groupby("key").agg(
        {"value": "sum", "count": "max"}, split_out=4, shuffle_method=shuffle_method
    )
    got = client.compute(agg).result(timeout=TIMEOUT).sort_index()
    expected = pdf.groupby("key").agg({"value": "sum", "count": "max"}).sort_index()
    pd.testing.assert_frame_equal(got, expected, check_exact=False, rtol=1e-9)

    assert _total_transfers(client) > 0


def test_local_cluster_bag(lci_client):
    cluster, client = lci_client
    _assert_lci_cluster(cluster, client)
    import dask.bag as db

    rng = np.random.default_rng(1)
    words = [str(w) for w in rng.choice(["lci", "dask", "hpx", "parcel", "put"], 5000)]
    nums = list(range(10_000))

    freq = db.from_sequence(words, npartitions=10).frequencies()
    got = dict(client.compute(freq).result(timeout=TIMEOUT))
    assert got == dict(collections.Counter(words))

    folded = db.from_sequence(nums, npartitions=10).foldby(
        lambda n: n % 7, operator.add, 0, operator.add, 0
    )
    got = dict(client.compute(folded).result(timeout=TIMEOUT))
    expected = collections.defaultdict(int)
    for n in nums:
        expected[n % 7] += n
    assert got == dict(expected)

    # groupby on a bag is a (task based) shuffle
    grouped = (
        db.from_sequence(nums, npartitions=8)
        .groupby(lambda n: n % 5, shuffle="tasks")
        .map(lambda kv: (kv[0], sorted(kv[1])))
    )
    got = dict(client.compute(grouped).result(timeout=TIMEOUT))
    assert got == {k: [n for n in nums if n % 5 == k] for k in range(5)}


# ---------------------------------------------------------------------------
# A worker process SIGKILLed in the middle of a graph
# ---------------------------------------------------------------------------


def test_worker_sigkill_mid_graph():
    n_tasks, delay = 60, 0.1
    with _local_cluster(processes=True) as (cluster, client):
        assert cluster.scheduler_address.startswith(_prefix())
        pids = client.run(os.getpid, wait=True)
        assert len(pids) == 2

        squares = client.map(slow_square, range(n_tasks), delay=delay, pure=False)
        # pairwise partial sums, so that results travel between workers
        pairs = [
            client.submit(add, squares[i], squares[i + 1], pure=False)
            for i in range(0, n_tasks, 2)
        ]
        final = client.submit(total, *pairs, pure=False)

        # wait until the victim holds finished results but the graph is
        # not done, so that the kill loses data and interrupts work
        victim_addr = sorted(pids)[0]
        deadline = time.monotonic() + TIMEOUT
        while True:
            who_has = client.who_has(squares)
            on_victim = [k for k, ws in who_has.items() if victim_addr in ws]
            if len(on_victim) >= 3:
                break
            assert not final.done(), "graph finished before the kill"
            assert time.monotonic() < deadline, "tasks never reached the victim"
            time.sleep(0.02)
        assert not final.done()

        os.kill(pids[victim_addr], signal.SIGKILL)

        expected = sum(i * i for i in range(n_tasks))
        assert final.result(timeout=TIMEOUT) == expected
        assert client.gather(squares) == [i * i for i in range(n_tasks)]

        # the nanny restarted the worker process, on a new lci address
        client.wait_for_workers(2, timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while True:
            new_pids = client.run(os.getpid, wait=True)
            if len(new_pids) == 2:
                break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert pids[victim_addr] not in new_pids.values()
        assert all(a.startswith(_prefix()) for a in new_pids)

        # and the repaired cluster still computes across workers
        again = client.map(inc, range(20), pure=False)
        assert client.submit(total, *again).result(timeout=TIMEOUT) == sum(
            range(1, 21)
        )
