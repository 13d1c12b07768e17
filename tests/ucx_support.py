"""What tests of the ucx provider share: whether it can run here, and the
two ends of a ucx device made in one process."""

from __future__ import annotations

from typing import Any

import pytest

from dask_lcicomm.providers import ucx_context, ucx_device, ucx_worker
from dask_lcicomm.providers.base import DeviceLost

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


def ucx_devices(loop, ends) -> list[ucx_device.UcxDevice]:
    """Two ends of a ucx device in one process, each on the worker of its
    own end's engine (``end.engine``, ``end.options``), welcomed by hand."""
    workers = [
        end.engine.shared("ucx", lambda end=end: ucx_worker.UcxWorker(loop, end.engine))
        for end in ends
    ]
    devices = []
    for i, (end, worker) in enumerate(zip(ends, workers, strict=True)):
        with worker.lock:
            endpoint = worker.endpoint(workers[1 - i].address)
            devices.append(ucx_device.UcxDevice(
                worker, endpoint, 0, end.options, f"lci://{'ab'[i]}:1", f"lci://{'ba'[i]}:1"
            ))
    devices[0]._peer_route, devices[1]._peer_route = devices[1].route, devices[0].route
    return devices


def lost(events):
    """The DeviceLost events among ``events``."""
    return [e for e in events if isinstance(e, DeviceLost)]


def raw_send(sender, data: bytes, route: int, kind: int, number: int, endpoint=None) -> None:
    """Send ``data`` with the given tag on ``sender``'s endpoint (or on
    ``endpoint`` of its worker), as a peer that does not follow the protocol
    would."""
    worker = sender.device.source
    with worker.lock:
        request = (endpoint or sender.device._endpoint).tag_send(
            ucx_context.array(data), ucx_context.tag(route, kind, number)
        )
        if not request.completed:
            worker._orphans.append((request, data))
