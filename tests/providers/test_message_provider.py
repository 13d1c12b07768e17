"""The message providers (ucx, ofi) as Dask uses them: one fabric endpoint
per event loop, several event loops in one process."""

from __future__ import annotations

import threading

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster
from eventually import eventually
from ofi_support import needs_ofi
from ucx_support import needs_ucx

from dask_lcicomm import connections


@pytest.mark.parametrize("provider", [needs_ucx("ucx", id="ucx"), needs_ofi("ofi", id="ofi")])
def test_two_event_loops_of_one_process_both_progress(provider):
    """A LocalCluster's loop and a Client's loop in another thread, both on
    the one provider: each loop has its own parcelport and fabric endpoint
    (the deadlock of several loops sharing UCX, dask-cuda#863, cannot happen)."""
    with dask.config.set({"distributed.comm.lci.providers": [provider]}), LocalCluster(
        protocol="lci", host="127.0.0.1", processes=False, n_workers=2, threads_per_worker=1,
        dashboard_address=":0",
    ) as cluster:
        results: dict[str, object] = {}

        def use_from_another_thread() -> None:
            with Client(cluster.scheduler_address, timeout=30) as client:
                x = client.submit(np.arange, 1 << 20, workers=[sorted(cluster.workers)[0]], pure=False)
                results["sum"] = client.submit(np.sum, x).result(timeout=30)

                def scheduler_providers() -> set[str]:
                    found = {c["provider"] for c in client.run_on_scheduler(connections)}
                    assert found == {provider}, found
                    return found

                results["providers"] = eventually(scheduler_providers)

        thread = threading.Thread(target=use_from_another_thread)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the client's loop stopped progressing"
    assert results == {"sum": (1 << 20) * ((1 << 20) - 1) // 2, "providers": {provider}}
