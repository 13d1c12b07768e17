"""What tests of the ofi provider share: whether it can run here, and the
two ends of an ofi device made in one process.

libfabric's tcp provider binds the interface ``FI_TCP_IFACE`` names: the
tests pin it to loopback, before libfabric first reads it, for this process
and the ones it starts.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from fabric_support import fabric_devices

from dask_lcicomm.providers.message_device import MessageDevice
from dask_lcicomm.providers.registry import get

os.environ["FI_TCP_IFACE"] = "lo"

#: Why the ofi provider cannot run here (no extension, no libfabric provider), or None.
OFI_MISSING = get("ofi").unavailable()


def needs_ofi(*values: Any, id: str) -> Any:
    """A test parameter that is skipped, saying why, where libfabric cannot run."""
    return pytest.param(
        *values, id=id,
        marks=pytest.mark.skipif(OFI_MISSING is not None, reason=f"no ofi provider: {OFI_MISSING}"),
    )


def ofi_devices(loop, ends) -> list[MessageDevice]:
    """Two ends of an ofi device in one process (see :func:`fabric_devices`)."""
    from dask_lcicomm.providers.ofi_fabric import OfiFabric

    return fabric_devices(loop, ends, "ofi", OfiFabric)
