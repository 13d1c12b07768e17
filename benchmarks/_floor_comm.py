"""``floor://``: the least a Dask comm can do, as the benchmarks' reference.

Asyncio streams over TCP on loopback carry a frame table and the frames that
Dask's ``to_frames`` made; the reader hands the frames, slices of one buffer,
to ``from_frames``. Nothing else: no tornado, no sharded or per-object
receive buffers, no TLS, no limits beyond a sanity bound. Whatever a real
comm's round trip costs above this one's, its own layers add; what this one
costs is serialization, the event loop and the kernel (wake-ups included) of
two processes on this machine.

Importing this module registers the scheme in the process (the benchmark
peers import it through :mod:`benchmarks._comm_peers`). It is a measuring
instrument, never a comm to run Dask on.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import Comm, CommClosedError, Connector, Listener
from distributed.comm.registry import backends
from distributed.comm.tcp import BaseTCPBackend
from distributed.comm.utils import from_frames, to_frames

__all__ = ["SCHEME", "FloorComm"]

SCHEME = "floor"
_COUNT = struct.Struct("<Q")
#: Sanity bounds on what a peer announces (the peers are our own processes).
_MAX_FRAMES = 1 << 20
_MAX_BYTES = 1 << 34
#: Seconds an accepted peer has for Dask's handshake.
_HANDSHAKE_S = 30.0


class FloorComm(Comm):
    """A Dask comm as thin as one can be over asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 local: str, peer: str, deserialize: bool = True) -> None:
        super().__init__(deserialize=deserialize)
        self._reader = reader
        self._writer = writer
        self._local_addr = local
        self._peer_addr = peer
        self._closed = False

    @property
    def local_address(self) -> str:
        return self._local_addr

    @property
    def peer_address(self) -> str:
        return self._peer_addr

    def closed(self) -> bool:
        return self._closed

    async def read(self, deserializers: Any = None) -> Any:
        reader = self._reader
        try:
            (count,) = _COUNT.unpack(await reader.readexactly(_COUNT.size))
            if count > _MAX_FRAMES:
                raise ValueError(f"{count} frames announced")
            sizes = struct.unpack(f"<{count}Q", await reader.readexactly(8 * count))
            total = sum(sizes)
            if total > _MAX_BYTES:
                raise ValueError(f"{total} bytes announced")
            data = memoryview(await reader.readexactly(total))
        except (asyncio.IncompleteReadError, OSError, ValueError) as e:
            self.abort()
            raise CommClosedError(f"{self!r}: {e}") from e
        frames, position = [], 0
        for size in sizes:
            frames.append(data[position:position + size])
            position += size
        return await from_frames(frames, deserialize=self.deserialize,
                                 deserializers=deserializers, allow_offload=self.allow_offload)

    async def write(self, msg: Any, serializers: Any = None, on_error: str = "message") -> int:
        if self._closed:
            raise CommClosedError(f"{self!r}: write on a closed comm")
        frames = await to_frames(
            msg, allow_offload=self.allow_offload, serializers=serializers, on_error=on_error,
            context={"sender": self.local_info, "recipient": self.remote_info,
                     **self.handshake_options},
        )
        sizes = [memoryview(frame).nbytes for frame in frames]
        self._writer.write(struct.pack(f"<Q{len(sizes)}Q", len(sizes), *sizes))
        # Empty frames (an empty array's data) are left out: since 3.12 the
        # selector transport's writelines keeps a trailing empty chunk in its
        # buffer forever, so the socket spins writable and close never ends.
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
            try:
                await self._writer.wait_closed()
            except OSError:
                pass

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.transport.abort()


def _address(sockname: tuple[Any, ...]) -> str:
    return f"{SCHEME}://{unparse_host_port(sockname[0], sockname[1])}"


class FloorConnector(Connector):
    async def connect(self, address: str, deserialize: bool = True, **kwargs: Any) -> Comm:
        host, port = parse_host_port(address)
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as e:
            raise CommClosedError(f"connect to {SCHEME}://{address}: {e}") from e
        sock = writer.get_extra_info("socket")
        return FloorComm(reader, writer, _address(sock.getsockname()),
                         f"{SCHEME}://{address}", deserialize)


class FloorListener(Listener):
    def __init__(self, loc: str, comm_handler: Any, deserialize: bool = True,
                 **connection_args: Any) -> None:
        host, self._port = parse_host_port(loc, 0)
        self._host = host or "127.0.0.1"
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self._server: asyncio.Server | None = None
        self._bound: tuple[Any, ...] = (self._host, self._port)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self._host, self._port)
        self._bound = self._server.sockets[0].getsockname()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        comm = FloorComm(reader, writer, _address(sock.getsockname()),
                         _address(sock.getpeername()), self.deserialize)
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

    @property
    def contact_address(self) -> str:
        return self.listen_address


class FloorBackend(BaseTCPBackend):
    _connector_class = FloorConnector
    _listener_class = FloorListener


backends.setdefault(SCHEME, FloorBackend())
