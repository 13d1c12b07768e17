"""``floor://``: Dask's ``to_frames``/``from_frames`` over bare asyncio streams, the least a Dask
comm does, so that a comm's time above it is its own layers'. Registered on import; never run Dask on it."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from itertools import accumulate, pairwise
from operator import attrgetter
from typing import Any

from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import Comm, CommClosedError, Connector, Listener
from distributed.comm.registry import backends
from distributed.comm.tcp import BaseTCPBackend
from distributed.comm.utils import from_frames, to_frames

SCHEME = "floor"
#: Bounds on what a peer announces, checked before anything is allocated for it.
_MAX_FRAMES, _MAX_BYTES = 1 << 20, 1 << 34
_HANDSHAKE_S = 30.0  # that an accepted peer has for Dask's handshake


def _address(sockname: tuple[Any, ...]) -> str:
    return f"{SCHEME}://{unparse_host_port(sockname[0], sockname[1])}"


class FloorComm(Comm):
    """A frame count, the frames' sizes, then the frames, read into one buffer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 deserialize: bool = True, peer: str | None = None) -> None:
        super().__init__(deserialize=deserialize)
        self._reader, self._writer, self._closed = reader, writer, False
        sock = writer.get_extra_info("socket")
        self._local_addr, self._peer_addr = _address(sock.getsockname()), peer or _address(sock.getpeername())

    local_address = property(attrgetter("_local_addr"))
    peer_address = property(attrgetter("_peer_addr"))

    def closed(self) -> bool:
        return self._closed

    async def read(self, deserializers: Any = None) -> Any:
        try:
            (count,) = struct.unpack("<Q", await self._reader.readexactly(8))
            if count > _MAX_FRAMES:
                raise ValueError(f"{count} frames announced")
            sizes = struct.unpack(f"<{count}Q", await self._reader.readexactly(8 * count))
            if sum(sizes) > _MAX_BYTES:
                raise ValueError(f"{sum(sizes)} bytes announced")
            data = memoryview(await self._reader.readexactly(sum(sizes)))
        except (asyncio.IncompleteReadError, OSError, ValueError) as e:
            self.abort()
            raise CommClosedError(f"{self!r}: {e}") from e
        frames = [data[start:end] for start, end in pairwise(accumulate(sizes, initial=0))]
        return await from_frames(frames, deserialize=self.deserialize,
                                 deserializers=deserializers, allow_offload=self.allow_offload)

    async def write(self, msg: Any, serializers: Any = None, on_error: str = "message") -> int:
        if self._closed:
            raise CommClosedError(f"{self!r}: write on a closed comm")
        frames = await to_frames(
            msg, allow_offload=self.allow_offload, serializers=serializers, on_error=on_error,
            context={"sender": self.local_info, "recipient": self.remote_info, **self.handshake_options},
        )
        sizes = [memoryview(frame).nbytes for frame in frames]
        self._writer.write(struct.pack(f"<Q{len(sizes)}Q", len(sizes), *sizes))
        # Empty frames are left out: since 3.12 the selector transport keeps a trailing empty
        # chunk of writelines buffered forever, so the socket spins writable and close never ends.
        self._writer.writelines([frame for frame, size in zip(frames, sizes, strict=True) if size])
        try:
            await self._writer.drain()
        except OSError as e:
            self.abort()
            raise CommClosedError(f"{self!r}: {e}") from e
        return sum(sizes)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.transport.abort()


class FloorConnector(Connector):
    async def connect(self, address: str, deserialize: bool = True, **kwargs: Any) -> Comm:
        try:
            reader, writer = await asyncio.open_connection(*parse_host_port(address))
        except OSError as e:
            raise CommClosedError(f"connect to {SCHEME}://{address}: {e}") from e
        return FloorComm(reader, writer, deserialize, peer=f"{SCHEME}://{address}")


class FloorListener(Listener):
    def __init__(self, loc: str, comm_handler: Any, deserialize: bool = True,
                 **connection_args: Any) -> None:
        host, port = parse_host_port(loc, 0)
        self._bound: tuple[Any, ...] = (host or "127.0.0.1", port)
        self.comm_handler, self.deserialize = comm_handler, deserialize
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, *self._bound)
        self._bound = self._server.sockets[0].getsockname()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        comm = FloorComm(reader, writer, self.deserialize)
        try:
            await asyncio.wait_for(self.on_connection(comm), _HANDSHAKE_S)
        except (CommClosedError, asyncio.TimeoutError):
            comm.abort()
            return
        await self.comm_handler(comm)

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    @property
    def listen_address(self) -> str:
        return _address(self._bound)

    contact_address = listen_address


class FloorBackend(BaseTCPBackend):
    _connector_class = FloorConnector
    _listener_class = FloorListener


backends.setdefault(SCHEME, FloorBackend())
