"""lci:// between simulated hosts: a scheduler and a worker on host A, a
worker on host B, in network namespaces on a private bridge, each host with a
/dev/shm of its own, and a client in the root namespace. Data moves both ways
across the (virtual) network; processes on one host talk over shared memory,
processes on different hosts over the next provider configured: tcp, or ucx
or ofi where it is listed (and installed).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import dask
import pytest
from cli_cluster import CALL_TIMEOUT, Procs, move, start_cluster, workers_at
from distributed import Client
from distributed.comm import connect
from distributed.comm.core import FatalCommClosedError
from eventually import eventually
from ofi_support import needs_ofi
from ucx_support import UCX_MISSING, needs_ucx

from dask_lcicomm import connections
from dask_lcicomm.testing.netns import unavailable, virtual_hosts

_reason = unavailable()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"no simulated hosts: {_reason}")

NBYTES = 6 << 20


@pytest.mark.parametrize(
    "providers",
    [
        pytest.param(["shm", "tcp"], id="shm-tcp"),
        needs_ucx(["shm", "ucx", "tcp"], id="shm-ucx-tcp"),
        needs_ofi(["shm", "ofi", "tcp"], id="shm-ofi-tcp"),
    ],
)
def test_graph_moves_data_both_ways_between_hosts(tmp_path, monkeypatch, providers):
    # The cluster's processes; the client keeps the default providers.
    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__LCI__PROVIDERS", json.dumps(providers))
    # libfabric's tcp provider on each host's own interface, not the loopback
    # the other tests pin it to.
    monkeypatch.delenv("FI_TCP_IFACE", raising=False)
    with virtual_hosts(2, private_shm=True) as (a, b):
        with Procs(tmp_path) as procs:
            address = start_cluster(
                procs, "lci", a.address, [a.address, b.address], netns={h.address: h for h in (a, b)}
            )
            assert address.startswith(f"lci://{a.address}:")
            with Client(address, timeout=CALL_TIMEOUT) as client:
                on_a, on_b = (workers_at(client, "lci", h.address) for h in (a, b))
                assert len(on_a) == len(on_b) == 1, client.scheduler_info()["workers"]
                for src, dst in ((on_a, on_b), (on_b, on_a)):
                    move(client, src, dst, NBYTES)
                eventually(lambda: _check_providers(client, on_a[0], on_b[0], between_hosts=providers[1]))
            procs.check_alive()
        # A process killed before it closed leaves its files (Python's
        # semaphores among them) in its host's /dev/shm.
        assert set(procs.exits.values()) == {0}, f"not closed by SIGTERM: {procs.exits}"
        assert os.listdir(a.shm) == os.listdir(b.shm) == [], "a host's /dev/shm kept files"


def _check_providers(client: Client, worker_a: str, worker_b: str, between_hosts: str) -> None:
    """Every connection inside host A is shm, every one between hosts A and
    B is on ``between_hosts``, the client's (which opens it) on tcp."""
    pids = client.run(os.getpid)
    nannies = client.run(os.getppid)
    scheduler = client.run_on_scheduler(os.getpid)
    host_of = {scheduler: "a", os.getpid(): "root"}
    for worker, host in ((worker_a, "a"), (worker_b, "b")):
        host_of[pids[worker]] = host_of[nannies[worker]] = host
    seen = {}
    for process, found in [
        (scheduler, client.run_on_scheduler(connections)),
        *((pids[w], client.run(connections, workers=[w])[w]) for w in (worker_a, worker_b)),
    ]:
        for connection in found:
            here, there = host_of[process], host_of.get(connection["peer_pid"])
            expected = "shm" if here == there else "tcp" if "root" in (here, there) else between_hosts
            assert connection["provider"] == expected, (here, there, connection)
            seen[here, there] = connection["provider"]
    assert seen[("a", "a")] == "shm"
    assert seen[("a", "b")] == seen[("b", "a")] == between_hosts
    assert seen[("a", "root")] == "tcp"



@pytest.mark.skipif(UCX_MISSING is not None, reason=f"no ucx provider: {UCX_MISSING}")
def test_no_ucx_path_to_a_peer_is_a_clear_error_at_once(tmp_path, monkeypatch):
    """Peers on fabrics that do not meet: UCX in the root namespace offers
    only eth0 and lo (it does not list the bridge the simulated hosts hang
    on), so it has no path to a host's scheduler. UCX says so at once when it
    finds no common transport; otherwise its connection attempt stalls (the
    simulated host cannot answer eth0's address) and the welcome is awaited
    for Dask's connect timeout, here 3 s. Either way, with ucx as the only
    provider the connect fails within 5 s, naming ucx (no retry loop)."""
    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__LCI__PROVIDERS", '["shm", "ucx", "tcp"]')
    with virtual_hosts(1, private_shm=True) as (a,), Procs(tmp_path) as procs:
        address = start_cluster(procs, "lci", a.address, [a.address], netns={a.address: a})

        async def connect_here() -> None:
            with dask.config.set({"distributed.comm.lci.providers": ["ucx"],
                                  "distributed.comm.timeouts.connect": "3s"}):
                await connect(address, timeout=30)

        start = time.monotonic()
        with pytest.raises(FatalCommClosedError, match="ucx: "):
            asyncio.run(connect_here())
        assert time.monotonic() - start < 5
