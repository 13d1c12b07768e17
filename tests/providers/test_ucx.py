"""The ucx provider as Dask uses it: event loops of one process, offers.
The cases every provider shares are in test_processes.py and tests/comm."""

from __future__ import annotations

import threading
import time

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster
from distributed.utils_test import gen_test
from eventually import eventually
from ucx_support import UCX_MISSING

from dask_lcicomm import connections
from dask_lcicomm.config import Settings
from dask_lcicomm.providers import ucx
from dask_lcicomm.providers.registry import PeerOffer, ProviderUnavailable

pytestmark = pytest.mark.skipif(UCX_MISSING is not None, reason=f"no ucx provider: {UCX_MISSING}")


def test_two_event_loops_of_one_process_both_progress():
    """A LocalCluster's loop and a Client's loop in another thread, both on
    UCX alone: each loop has its own parcelport and UCX workers (the
    deadlock of several loops sharing UCX, dask-cuda#863, cannot happen)."""
    with dask.config.set({"distributed.comm.lci.providers": ["ucx"]}), LocalCluster(
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
                    assert found == {"ucx"}, found
                    return found

                results["providers"] = eventually(scheduler_providers)

        thread = threading.Thread(target=use_from_another_thread)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the client's loop stopped progressing"
    assert results == {"sum": (1 << 20) * ((1 << 20) - 1) // 2, "providers": {"ucx"}}


@pytest.mark.parametrize("offer", ["x", None, [1, 2], ["not hex", 1], ["00", "1"]])
@gen_test(timeout=30)
async def test_a_malformed_offer_is_refused_as_unavailable(bare_end, offer):
    with pytest.raises(ProviderUnavailable):
        await ucx.PROVIDER.connect(PeerOffer("", 0, None, None, offer), Settings.from_config(),
                                   bare_end().options)


@pytest.mark.parametrize("gone", ["listener", "worker"])
@gen_test(timeout=30)
async def test_an_offer_nobody_answers_is_refused_within_the_connect_timeout(bare_end, gone):
    """A listener that stopped ignores the hello; a worker that is gone
    cannot be reached: either way the peer is refused, within Dask's
    connect timeout."""
    near, far = bare_end(), bare_end()
    settings = Settings.from_config()
    listening = ucx.PROVIDER.listen("127.0.0.1", 0, settings, far.options, lambda d: None)
    kept = ucx.PROVIDER.listen("127.0.0.1", 0, settings, far.options, lambda d: None)
    if gone == "worker":
        kept.close()
    listening.close()
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        started = time.monotonic()
        with pytest.raises(ProviderUnavailable):
            await ucx.PROVIDER.connect(PeerOffer("", 0, None, None, listening.offer), settings,
                                       near.options)
        assert time.monotonic() - started < 5
    if gone == "listener":
        kept.close()
