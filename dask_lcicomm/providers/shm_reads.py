"""Large bulk groups read by the receiver straight from the sender's memory
(LCI's rendezvous, by cross-memory attach: ``process_vm_readv``).

A group that finds no pool block (pool full, or the process's shared-memory
budget spent, see :mod:`.shm_budget`) would otherwise go through the ring: a
copy in by the sender and a copy out by the receiver, a ring's worth at a
time. Read in place it is one copy, by the receiver into private memory, as
``tcp://`` receives it, and no shared memory stays committed while the
receiver keeps the objects.

The sender lends the group's own buffers (back to back in its memory, as
the shards of one object are): the PLACED record names their address and a
block handle with :data:`READ_HANDLE` set, whose flag word in the
receiver's segment says when the read is done. The sender keeps the buffers,
and the write stays incomplete, until that flag comes back: like
``tcp://``, a finished write no longer reads the caller's memory. The
receiver checks the size (the parcel's size table was checked against its
limits), allocates, reads, stores the flag and rings the sender's doorbell.
It reads into memory it read frames into before, once Dask freed them
(:mod:`.frame_memory`), not into new memory.

Only a receiver that found in the handshake that the kernel lets it read
its peer (:func:`unreadable`: same user, and a ptrace policy that allows
it) is lent to.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dask_lcicomm.parcel import ProtocolError
from dask_lcicomm.providers.base import CompletionSink, DeviceLost, SendDone
from dask_lcicomm.providers.frame_memory import FrameMemory

#: Set in a PLACED record's handle: the offset is an address in the sender.
READ_HANDLE = 1 << 32


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _process_vm_readv() -> Any:
    try:
        function = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (AttributeError, OSError):
        return None
    function.restype = ctypes.c_ssize_t
    function.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                         ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    return function


_readv = _process_vm_readv()


def unreadable(pid: int) -> str | None:
    """Why this process cannot read the memory of process ``pid``, or None.

    Reading one byte at address 0, never mapped, fails with EFAULT once the
    kernel has allowed the access at all."""
    if _readv is None:
        return "process_vm_readv needs Linux"
    byte = ctypes.create_string_buffer(1)
    local, remote = _Iovec(ctypes.addressof(byte), 1), _Iovec(0, 1)
    if _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) >= 0:
        return None
    code = ctypes.get_errno()
    return None if code == errno.EFAULT else f"process_vm_readv: {os.strerror(code)}"


def address(views: Sequence[memoryview]) -> int | None:
    """Where ``views`` lie in our memory, if back to back; else None."""
    start = end = None
    for view in views:
        at = np.frombuffer(view, dtype=np.uint8).ctypes.data
        if end is not None and at != end:
            return None
        start = at if start is None else start
        end = at + view.nbytes
    return start


def read(pid: int, at: int, nbytes: int, memory: FrameMemory | None = None) -> memoryview:
    """``nbytes`` at address ``at`` of process ``pid``, in a region of
    ``memory`` (else in a new buffer).

    :class:`ProcessLookupError` if the peer is gone, :class:`ProtocolError`
    if it lent what we cannot read."""
    assert _readv is not None
    buffer: Any
    if memory is None:
        buffer = np.empty(nbytes, dtype=np.uint8)
        base = buffer.ctypes.data
    else:
        buffer, base = memory.take(nbytes)
    done = 0
    while done < nbytes:
        local, remote = _Iovec(base + done, nbytes - done), _Iovec(at + done, nbytes - done)
        n = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            code = ctypes.get_errno() if n < 0 else 0
            if code == errno.ESRCH:
                raise ProcessLookupError(code, f"the peer that lent {nbytes} bytes is gone")
            reason = os.strerror(code) if code else "nothing read"
            raise ProtocolError(f"cannot read the {nbytes} bytes the peer lent at {at:#x}: {reason}")
        done += n
    return memoryview(buffer)


class Loan:
    """A write's token while groups of its parcel are lent: the write
    completes once its parcel is sent and every group has been read."""

    __slots__ = ("token", "unread", "sent")

    def __init__(self, token: Any) -> None:
        self.token = token
        self.unread = 0
        self.sent = False


class Lender:
    """A sender's groups lent to its peer for reading, by block handle;
    thread-safe (the writer lends, progress collects).

    ``take_handle()`` claims a free handle (or None), ``give_handle(block)``
    frees it, ``returned(block)`` reads its flag."""

    def __init__(
        self,
        take_handle: Callable[[], int | None],
        give_handle: Callable[[int], None],
        returned: Callable[[int], bool],
    ) -> None:
        self._take_handle = take_handle
        self._give_handle = give_handle
        self._returned = returned
        self._lock = threading.Lock()
        self._lent: dict[int, tuple[Sequence[memoryview], Loan | None]] = {}

    def __bool__(self) -> bool:
        return bool(self._lent)

    def lend(self, views: Sequence[memoryview], loan: Loan | None) -> tuple[int, int] | None:
        """``(handle, address)`` for the PLACED record of ``views``, kept
        until read; None if they cannot be lent (not back to back, no handle)."""
        at = address(views)
        if at is None:
            return None
        with self._lock:
            block = self._take_handle()
            if block is None:
                return None
            self._lent[block] = (views, loan)
            if loan is not None:
                loan.unread += 1
        return block | READ_HANDLE, at

    def collect(self) -> list[Any]:
        """Let go of the groups the peer has read; the tokens now complete."""
        done = []
        with self._lock:
            for block in [block for block in self._lent if self._returned(block)]:
                _, loan = self._lent.pop(block)
                self._give_handle(block)
                if loan is not None:
                    loan.unread -= 1
                    if loan.sent and not loan.unread:
                        done.append(loan.token)
        return done

    def sent(self, loan: Loan) -> bool:
        """``loan``'s parcel is sent: whether its write completes now."""
        with self._lock:
            loan.sent = True
            return not loan.unread

    def unfinished(self) -> list[Any]:
        """The tokens of sent parcels still being read (the device is lost)."""
        with self._lock:
            loans = {id(loan): loan for _, loan in self._lent.values()
                     if loan is not None and loan.sent}
        return [loan.token for loan in loans.values()]

    def close(self) -> None:
        """The device is released: the buffers are ours again."""
        with self._lock:
            self._lent.clear()


class LoanCompletions:
    """A lending device's completion sink: the write of a parcel with lent
    groups completes once they are read, not when the parcel is sent; a
    lost device fails the writes still being read too. ``lender()`` is the
    device's lender, None once the device let go of its shared memory (the
    lender's flag words live there: this sink must not keep them mapped)."""

    def __init__(self, sink: CompletionSink, lender: Callable[[], Lender | None]) -> None:
        self._sink = sink
        self._lender = lender

    def push(self, item: tuple[Any, Any]) -> None:
        event = item[1]
        kind = type(event)
        if kind is SendDone and type(event.token) is Loan:
            lender = self._lender()
            if lender is not None and not lender.sent(event.token):
                return
            item = (item[0], SendDone(event.token.token))
        elif kind is DeviceLost:
            lender = self._lender()
            tokens = [token.token if type(token) is Loan else token for token in event.tokens]
            if lender is not None:
                tokens += lender.unfinished()
            item = (item[0], DeviceLost(event.reason, tokens, event.violation))
        self._sink.push(item)
