"""The ``dask scheduler`` / ``dask worker`` command line tools over ``lci://``.

A scheduler and two workers (each with its nanny) run as separate
subprocesses, exactly as a user would start them, and clients connect to the
scheduler by its ``lci://`` address.  Only loopback (127.0.0.1) is used.

To check the test logic against Dask's reference backend, replace
``PROTOCOL = "lci"`` by ``"tcp"``.
"""

from __future__ import annotations

import functools
import operator

import pytest
from cli_cluster import CALL_TIMEOUT, STARTUP_TIMEOUT, Procs, start_cluster
from distributed import Client
from distributed.comm import parse_address, parse_host_port

PROTOCOL = "lci"

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory):
    """Scheduler + 2 workers started with the ``dask`` CLI on PROTOCOL."""
    procs = Procs(tmp_path_factory.mktemp("lci_cli"))
    try:
        address = start_cluster(procs, PROTOCOL, HOST, [HOST, HOST])
        yield {
            "address": address,
            "scheduler_file": str(procs.logdir / "scheduler.json"),
            "procs": procs,
        }
    finally:
        procs.stop()


# Only functions importable in the worker subprocesses: this test module is
# not on their sys.path, so functions defined here could not be unpickled.
inc = functools.partial(operator.add, 1)
double = functools.partial(operator.mul, 2)


def _check_workers(client, n=2):
    workers = client.scheduler_info()["workers"]
    assert len(workers) == n, list(workers)
    assert all(a.startswith(f"{PROTOCOL}://") for a in workers), list(workers)
    assert {w["name"] for w in workers.values()} == {f"cli-worker-{i}" for i in range(n)}
    return sorted(workers)


def _small_computation(client):
    a, b = _check_workers(client)
    futures = client.map(inc, range(100))
    assert client.gather(futures) == list(range(1, 101))
    total = client.submit(sum, futures)
    assert total.result(timeout=CALL_TIMEOUT) == sum(range(1, 101))

    # a result computed on one worker is consumed on the other
    x = client.submit(inc, 10, workers=[a], pure=False)
    y = client.submit(double, x, workers=[b], allow_other_workers=False, pure=False)
    assert y.result(timeout=CALL_TIMEOUT) == 22
    assert set(client.who_has([y])[y.key]) == {b}


def test_cli_scheduler_and_workers(cli_cluster):
    procs = cli_cluster["procs"]
    try:
        with Client(cli_cluster["address"], timeout=CALL_TIMEOUT) as client:
            assert client.scheduler.address.startswith(f"{PROTOCOL}://")
            client.wait_for_workers(2, timeout=STARTUP_TIMEOUT)
            _small_computation(client)

            import dask.array as da
            import numpy as np

            x = da.arange(1_000_000, chunks=100_000)
            assert client.compute(x.sum()).result(timeout=CALL_TIMEOUT) == np.arange(
                1_000_000
            ).sum()
    except BaseException:
        print(procs.logs())
        raise
    procs.check_alive()


def test_cli_client_direct_address(cli_cluster):
    procs = cli_cluster["procs"]
    # rebuild "lci://HOST:PORT" by hand, as a user would type it
    scheme, loc = parse_address(cli_cluster["address"])
    assert scheme == PROTOCOL
    host, port = parse_host_port(loc)
    assert host == HOST and port > 0
    address = f"{PROTOCOL}://{HOST}:{port}"
    try:
        with Client(address, timeout=CALL_TIMEOUT) as client:
            assert client.scheduler.address == address
            _small_computation(client)
        # and via the scheduler file
        with Client(
            scheduler_file=cli_cluster["scheduler_file"], timeout=CALL_TIMEOUT
        ) as client:
            assert client.scheduler.address == address
            _small_computation(client)
    except BaseException:
        print(procs.logs())
        raise
    procs.check_alive()
