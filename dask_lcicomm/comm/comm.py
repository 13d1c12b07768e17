"""LCIComm: one Dask comm, serialising over a virtual connection."""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, ClassVar

import dask.config
from dask.utils import parse_bytes
from distributed.comm.core import Comm, CommClosedError
from distributed.comm.utils import from_frames, to_frames

from dask_lcicomm.vconn import VirtualConnection

logger = logging.getLogger(__name__)


def _drop(loop: asyncio.AbstractEventLoop, vconn: VirtualConnection, peer: str) -> None:
    """Abort a comm that was dropped without being closed, as tcp:// closes a
    dangling stream. The garbage collector may run this on any thread, in
    the middle of anything: the abort itself happens on the comm's loop."""
    logger.info("closing dangling lci comm to %s", peer)
    try:
        loop.call_soon_threadsafe(vconn.abort)
    except RuntimeError:
        pass  # the loop is closed: its parcelport is gone with it


class LCIComm(Comm):
    """A Dask comm multiplexed with others over one link.

    Any error or cancellation in ``read`` or ``write`` aborts the comm, as
    Dask's contract asks; a comm nobody closed is aborted when it is
    garbage-collected, so that the peer sees it closed and its share of the
    link is freed.
    """

    #: Larger frames are sent as shards of this size, as tcp:// does.
    max_shard_size: ClassVar[int] = parse_bytes(dask.config.get("distributed.comm.shard"))

    def __init__(self, vconn: VirtualConnection, deserialize: bool = True) -> None:
        super().__init__(deserialize=deserialize)
        self._vconn = vconn
        self._local_addr = vconn.local_address
        self._peer_addr = vconn.peer_address
        self._finalizer = weakref.finalize(
            self, _drop, asyncio.get_running_loop(), vconn, self._peer_addr
        )
        self._finalizer.atexit = False

    @property
    def local_address(self) -> str:
        return self._local_addr

    @property
    def peer_address(self) -> str:
        return self._peer_addr

    @property
    def extra_info(self) -> dict[str, Any]:
        return self._vconn.info

    def closed(self) -> bool:
        return self._vconn.closed

    async def read(self, deserializers: Any = None) -> Any:
        try:
            frames = await self._vconn.receive()
        except BaseException:
            self.abort()
            raise
        try:
            return await from_frames(
                frames,
                deserialize=self.deserialize,
                deserializers=deserializers,
                allow_offload=self.allow_offload,
            )
        except EOFError as e:
            self.abort()
            raise CommClosedError(f"{self!r}: aborted on truncated data") from e

    async def write(self, msg: Any, serializers: Any = None, on_error: str = "message") -> int:
        if self._vconn.closed:
            self.abort()
            raise CommClosedError(f"{self!r}: write on a closed comm")
        frames = await to_frames(
            msg,
            allow_offload=self.allow_offload,
            serializers=serializers,
            on_error=on_error,
            context={"sender": self.local_info, "recipient": self.remote_info, **self.handshake_options},
            frame_split_size=self.max_shard_size,
        )
        try:
            return await self._vconn.send(frames)
        except BaseException:
            self.abort()
            raise

    async def close(self) -> None:
        """Close after the messages already written have been sent."""
        self._finalizer.detach()
        await self._vconn.close()

    def abort(self) -> None:
        self._finalizer.detach()
        self._vconn.abort()
