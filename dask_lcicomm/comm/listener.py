"""LCIListener: accepts lci:// comms."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from typing import Any

from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import BaseListener, CommClosedError
from distributed.comm.utils import ensure_concrete_host

from dask_lcicomm.comm.comm import LCIComm
from dask_lcicomm.comm.security import check_encryption
from dask_lcicomm.link import Listening
from dask_lcicomm.parcelport import SCHEME, Parcelport
from dask_lcicomm.vconn import VirtualConnection

logger = logging.getLogger(__name__)


class LCIListener(BaseListener):
    """Registers with the parcelport, which accepts peers on a TCP port and
    offers them its other providers; comms reach the handler as the virtual
    connections peers open."""

    prefix = SCHEME

    def __init__(
        self,
        address: str,
        comm_handler: Callable[[LCIComm], Any],
        deserialize: bool = True,
        allow_offload: bool = True,
        default_host: str | None = None,
        default_port: int = 0,
        **connection_args: Any,
    ) -> None:
        super().__init__()
        check_encryption(address, connection_args)
        self.ip, self.port = parse_host_port(address, default_port)
        self.default_host = default_host
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self._parcelport: Parcelport | None = None
        self._listening: Listening | None = None
        self._bound: tuple[str, int] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._parcelport = Parcelport.current()
        self._listening = self._parcelport.listen(self.ip or None, self.port, self._accept)
        self._bound = self._listening.address

    def _accept(self, vconn: VirtualConnection) -> None:
        comm = LCIComm(vconn, self.deserialize)
        comm.allow_offload = self.allow_offload
        task = asyncio.get_running_loop().create_task(self._handle(comm))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, comm: LCIComm) -> None:
        if self._listening is None:
            # Stopped after the peer opened this comm but before we got to it:
            # as tcp:// closes such a stream, the handler never sees it.
            comm.abort()
            return
        try:
            await self.on_connection(comm)
        except CommClosedError:
            logger.info("connection from %s closed before handshake completed", comm.peer_address)
            return
        result = self.comm_handler(comm)
        if inspect.isawaitable(result):
            await result

    def stop(self) -> None:
        """Stop accepting; comms already handed over carry on (Dask's
        ``abort_handshaking_comms`` is there for those still in the handshake)."""
        listening, self._listening = self._listening, None
        if listening is not None:
            assert self._parcelport is not None
            self._parcelport.stop_listening(listening)

    def get_host_port(self) -> tuple[str, int]:
        if self._bound is None:
            raise ValueError("invalid operation on non-started LCIListener")
        return self._bound

    @property
    def listen_address(self) -> str:
        return self.prefix + unparse_host_port(*self.get_host_port())

    @property
    def contact_address(self) -> str:
        host, port = self.get_host_port()
        host = ensure_concrete_host(host, default_host=self.default_host)
        return self.prefix + unparse_host_port(host, port)
