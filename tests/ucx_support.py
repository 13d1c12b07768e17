"""What tests of the ucx provider share: whether it can run here, and the
two ends of a ucx device made in one process."""

from __future__ import annotations

from typing import Any

import pytest
from fabric_support import fabric_devices

from dask_lcicomm.providers import ucx_context, ucx_worker
from dask_lcicomm.providers.message_device import MessageDevice

#: Why the ucx provider cannot run here (ucxx missing, no fabric), or None.
UCX_MISSING = ucx_context.unavailable()

if UCX_MISSING is None:
    # UCX's first worker starts what UCX keeps for the life of the process
    # (a thread and five descriptors here): made now, before any test takes
    # its baseline of what the process holds.
    ucx_context.new_worker()


def needs_ucx(*values: Any, id: str) -> Any:
    """A test parameter that is skipped, saying why, where UCX cannot run."""
    return pytest.param(
        *values, id=id,
        marks=pytest.mark.skipif(UCX_MISSING is not None, reason=f"no ucx provider: {UCX_MISSING}"),
    )


def ucx_devices(loop, ends) -> list[MessageDevice]:
    """Two ends of a ucx device in one process (see :func:`fabric_devices`)."""
    return fabric_devices(loop, ends, "ucx", ucx_worker.UcxWorker)
