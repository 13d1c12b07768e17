"""The shm provider's handshake: proving that a peer shares our host.

A listener listens on an *abstract* Unix socket (no file; reachable only from
the same network namespace) named after its TCP address, so that a peer on
this host finds it by the address it connects to, with no TCP connection
first (:func:`names_for`); it also advertises the name in its greeting over
TCP. The peer connects to it, checks with ``SO_PEERCRED`` that the process
there runs as our user (and, after a greeting, is the one that greeted it),
and the two exchange segments with ``SCM_RIGHTS``; mapping them proves that
the memory is shared. Any failure on the way means "not the same host"
(:class:`ProviderUnavailable`) and the channel stays on TCP, with the reason
logged. Each grant also says whether its sender can read the other's memory
(:mod:`.shm_reads`), when asked to.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import logging
import os
import socket
import struct
import uuid
from dataclasses import dataclass
from typing import Any

from dask_lcicomm.providers.registry import ProviderUnavailable
from dask_lcicomm.providers.shm_reads import unreadable
from dask_lcicomm.providers.shm_segment import ASLEEP, Layout, SegmentError, attach, create

logger = logging.getLogger(__name__)

_SETUP_BYTES = 4096
_MAX_ADDRESS = 512
#: What a listener bound to every address of its host is named after.
_ANY_HOST = "*"


@dataclass
class ShmLink:
    """A connected socket and both segments of a device, ready to use."""

    sock: socket.socket
    tx: Any
    tx_layout: Layout
    rx: Any
    rx_layout: Layout
    local_address: str
    peer_address: str
    peer_pid: int
    #: We can read the peer's memory, and told it so.
    reads: bool = False
    #: The peer can read ours: large groups may be lent to it.
    peer_reads: bool = False


def listen(backlog: int, host: str | None = None, port: int = 0) -> tuple[socket.socket, str]:
    """A listening abstract Unix socket and the name peers connect to: the
    name :func:`names_for` gives peers for the listener bound to
    ``host:port``, unless that is unknown or another process holds it; then a
    unique name, which only the greeting tells."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        name = _bind_named(sock, host, port)
        if name is None:
            name = f"dask-lcicomm-{os.getpid()}-{uuid.uuid4().hex}"
            sock.bind("\0" + name)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock, name


def _bind_named(sock: socket.socket, host: str | None, port: int) -> str | None:
    """Bind ``sock`` to the name of the listener at ``host:port``, or None."""
    if not port or host is None:
        return None
    try:
        bound = ipaddress.ip_address(host)
    except ValueError:
        return None
    name = _name(_ANY_HOST if bound.is_unspecified else bound.compressed, port)
    try:
        sock.bind("\0" + name)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        return None
    return name


def names_for(host: str, port: int) -> tuple[str, ...]:
    """The names a listener at ``host:port`` on this host listens on, the
    most specific first; none when ``host`` is not an address of this host
    (a host name included: resolving it could block)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return ()
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as probe:
        try:
            # Only an address of this host's network namespace can be bound.
            probe.bind((address.compressed, 0))
        except OSError:
            return ()
    return _name(address.compressed, port), _name(_ANY_HOST, port)


def _name(host: str, port: int) -> str:
    return f"dask-lcicomm-{host}-{port}"


async def connect(
    names: tuple[str, ...], peer_pid: Any, layout: Layout, local_address: str, peer_address: str,
    timeout: float, reads: bool = False,
) -> ShmLink:
    """Attach to the first listener of ``names`` there is, which must be
    process ``peer_pid`` unless that is None (no greeting came yet); offer to
    read its memory if ``reads`` and the kernel allows it."""
    try:
        return await asyncio.wait_for(
            _connect(names, peer_pid, layout, local_address, peer_address, reads), timeout
        )
    except (OSError, ValueError, asyncio.TimeoutError) as e:
        raise ProviderUnavailable(f"{type(e).__name__}: {e}") from e


async def _connected(names: tuple[str, ...]) -> socket.socket:
    """A socket connected to the first of ``names`` that a listener holds."""
    error: OSError = ConnectionRefusedError(errno.ECONNREFUSED, "no name to connect to")
    for name in names:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, "\0" + name)
            return sock
        except OSError as e:
            sock.close()
            error = e
        except BaseException:
            sock.close()
            raise
    raise error


async def _connect(
    names: tuple[str, ...], peer_pid: Any, layout: Layout, local: str, peer: str, reads: bool,
) -> ShmLink:
    sock = await _connected(names)
    try:
        pid = _check_peer(sock)
        if peer_pid is not None and pid != peer_pid:
            raise ProviderUnavailable(
                f"the shared-memory socket belongs to pid {pid}, the greeting came from {peer_pid}"
            )
        reads = reads and _can_read(pid)
        rx = _grant(sock, layout, {"local": local, "peer": peer, "reads": reads})
        info, tx, tx_layout = await _receive_grant(sock)
    except BaseException:
        sock.close()
        raise
    return ShmLink(sock, tx, tx_layout, rx, layout, local, peer, pid, reads, info.get("reads") is True)


async def accept(sock: socket.socket, layout: Layout, timeout: float, reads: bool = False) -> ShmLink:
    """Answer a peer that connected to our abstract socket."""
    try:
        return await asyncio.wait_for(_accept(sock, layout, reads), timeout)
    except (OSError, ValueError, asyncio.TimeoutError) as e:
        raise ProviderUnavailable(f"{type(e).__name__}: {e}") from e


async def _accept(sock: socket.socket, layout: Layout, reads: bool) -> ShmLink:
    pid = _check_peer(sock)
    info, tx, tx_layout = await _receive_grant(sock)
    local, peer = _address(info.get("peer")), _address(info.get("local"))
    reads = reads and _can_read(pid)
    rx = _grant(sock, layout, {"reads": reads})
    return ShmLink(sock, tx, tx_layout, rx, layout, local, peer, pid, reads, info.get("reads") is True)


def _can_read(pid: int) -> bool:
    """Whether the kernel lets us read process ``pid`` (why not is logged)."""
    reason = unreadable(pid)
    if reason is not None:
        logger.info("large frames from pid %d go through the ring: %s", pid, reason)
    return reason is None


def _address(address: object) -> str:
    """An lci:// address from a peer's grant, checked."""
    if not (isinstance(address, str) and address.startswith("lci://") and len(address) <= _MAX_ADDRESS):
        raise SegmentError(f"malformed address in segment grant: {address!r}")
    return address


def _check_peer(sock: socket.socket) -> int:
    """The peer's pid, if it runs as our user."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if uid != os.getuid():
        raise ProviderUnavailable(f"peer pid {pid} runs as uid {uid}, not {os.getuid()}")
    return pid


def _grant(sock: socket.socket, layout: Layout, extra: dict[str, Any]) -> Any:
    """Create our receiving segment and grant it to the peer."""
    fd, region = create(layout)
    try:
        # We are not watching the ring until a doorbell rings: say so.
        region.store(ASLEEP, 1)
        message = json.dumps({"segment": layout.describe(), **extra}).encode()
        socket.send_fds(sock, [message], [fd])
    finally:
        os.close(fd)
    return region


async def _receive_grant(sock: socket.socket) -> tuple[dict[str, Any], Any, Layout]:
    """Wait for the peer's segment and map it."""
    await _readable(sock)
    message, fds, flags, _ = socket.recv_fds(sock, _SETUP_BYTES, 1)
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise SegmentError("segment grant was truncated")
        if not message:
            raise SegmentError("peer closed before granting a segment")
        if len(fds) != 1:
            raise SegmentError(f"segment grant carried {len(fds)} descriptors")
        info = json.loads(message)
        if not isinstance(info, dict):
            raise SegmentError("malformed segment grant")
        layout = Layout.from_description(info.get("segment"))
        region = attach(fds[0], layout)
    finally:
        for fd in fds:
            os.close(fd)
    return info, region, layout


async def _readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: None if ready.done() else ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())
