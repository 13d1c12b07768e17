"""What tests of the ucx provider share: whether it can run here, and the
two ends of a ucx device made in one process."""

from __future__ import annotations

import socket
import time
from typing import Any, NamedTuple

import pytest

from dask_lcicomm.providers import ucx

#: Why the ucx provider cannot run here (ucxx missing, no fabric), or None.
UCX_MISSING = ucx.unavailable()

if UCX_MISSING is None:
    # UCX's first worker starts what UCX keeps for the life of the process
    # (a thread and five descriptors here): made now, before any test takes
    # its baseline of what the process holds.
    ucx._worker()


def needs_ucx(*values: Any, id: str) -> Any:
    """A test parameter that is skipped, saying why, where UCX cannot run."""
    return pytest.param(
        *values, id=id,
        marks=pytest.mark.skipif(UCX_MISSING is not None, reason=f"no ucx provider: {UCX_MISSING}"),
    )


class UcxTransport(NamedTuple):
    """One end of a ucx device: its worker, endpoint and side socket."""

    worker: Any
    endpoint: Any
    sock: socket.socket


def ucx_transports(socks: list[socket.socket], timeout: float = 10.0) -> list[UcxTransport]:
    """Two ends of a ucx device in one process, each with a worker of its own."""
    workers = [ucx._worker(), ucx._worker()]
    accepted: list[Any] = []
    listener = ucx._ucx().UCXListener.create(
        workers[0], 0, lambda endpoint, *args: accepted.append(endpoint), deliver_endpoint=True
    )
    connecting = workers[1].create_endpoint_from_hostname("127.0.0.1", listener.port, True)
    deadline = time.monotonic() + timeout
    while not accepted:
        assert time.monotonic() < deadline, "no UCX endpoint connected"
        for worker in workers:
            worker.progress()
        time.sleep(0.001)
    endpoint = accepted.pop()
    # The listener keeps its callback, which keeps ``accepted``: break that
    # cycle through UCX, which the garbage collector cannot see.
    del listener
    return [
        UcxTransport(workers[0], endpoint, socks[0]),
        UcxTransport(workers[1], connecting, socks[1]),
    ]
