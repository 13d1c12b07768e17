"""Fixtures for the tests of the Dask side of lci://."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _backend_registered():
    """Fail fast, rather than let Dask retry until its deadline, when the
    lci backend cannot even be loaded."""
    from distributed.comm.registry import get_backend

    try:
        get_backend("lci")
    except Exception as e:
        pytest.fail(f"comm backend 'lci' unavailable: {e!r}")
