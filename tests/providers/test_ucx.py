"""The ucx provider's offers: malformed ones, and ones nobody answers.
The cases every provider shares are in test_processes.py, test_message_provider.py and tests/comm."""

from __future__ import annotations

import time

import dask
import pytest
from distributed.utils_test import gen_test
from ucx_support import UCX_MISSING

from dask_lcicomm.config import Settings
from dask_lcicomm.providers import ucx
from dask_lcicomm.providers.registry import PeerOffer, ProviderUnavailable

pytestmark = pytest.mark.skipif(UCX_MISSING is not None, reason=f"no ucx provider: {UCX_MISSING}")


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
