"""The message-fabric verbs over UCX: one UCX worker per progress engine,
one UCX endpoint per peer (see :mod:`.message_fabric` for what is done with
them), tagged sends and the worker's queue of unexpected messages."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from dask_lcicomm.providers.base import Progress
from dask_lcicomm.providers.message_fabric import MessageFabric
from dask_lcicomm.providers.message_verbs import Request
from dask_lcicomm.providers.ucx_context import any_tag, array, bindings, new_worker, setup_errors


class UcxWorker(MessageFabric):
    """A UCX worker in blocking-progress mode: it sleeps on its descriptor."""

    provider = "ucx"

    def __init__(self, loop: asyncio.AbstractEventLoop, progress: Progress) -> None:
        super().__init__(loop, progress)
        self.worker = new_worker()
        self.address = self.worker.address.tobytes().hex()
        self._tags = any_tag()
        self._tag = bindings().UCXXTag

    def fileno(self) -> int:
        return int(self.worker.epoll_file_descriptor)

    def open_peer(self, address: str) -> Any:
        return self.worker.create_endpoint_from_worker_address(
            bindings().UCXAddress.create_from_buffer(bytes.fromhex(address)), True
        )

    def watch_peer(self, peer: Any, failed: Callable[[], None]) -> None:
        peer.set_close_callback(lambda *args: failed())

    def close_peer(self, peer: Any) -> None:
        peer.remove_close_callback()
        # Cancels what is left of its sends.
        peer.close_blocking()

    def send(self, peer: Any, tag: int, message: Any) -> Request:
        return peer.tag_send(array(message), self._tag(tag))

    def take(self) -> tuple[int, int, Any, Any] | None:
        probe = self.worker.tag_probe(*self._tags, remove=True)
        if not probe.matched:
            return None
        return probe.sender_tag.value, probe.length, probe, None

    def receive(self, message: Any, buffer: np.ndarray) -> Request:
        return self.worker.tag_recv_with_handle(array(buffer), message)

    def poke(self) -> None:
        self.worker.progress()

    def arm(self) -> bool:
        return bool(self.worker.arm())

    def cancel_all(self) -> None:
        self.worker.cancel_inflight_requests()
        self.worker = None

    @staticmethod
    def setup_errors() -> tuple[type[BaseException], ...]:
        return setup_errors()
