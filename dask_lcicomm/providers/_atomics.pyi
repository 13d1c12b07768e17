"""Atomic words, fences and leased buffers over shared memory (see ``_atomics.c``)."""

from typing import final

from _typeshed import ReadableBuffer, WriteableBuffer

@final
class Region:
    """Atomic words and copies over a writable, C-contiguous, 8-byte aligned buffer
    (an mmap of shared memory).

    A word's offset that is not 8-byte aligned raises ``ValueError``; bytes outside
    the region raise ``IndexError``.
    """

    def __init__(self, buffer: WriteableBuffer) -> None: ...
    @property
    def nbytes(self) -> int: ...
    def load(self, offset: int, /) -> int:
        """The 64-bit word at ``offset``, with acquire ordering."""
    def store(self, offset: int, value: int, /) -> None:
        """Write the 64-bit word at ``offset``, with release ordering."""
    def exchange(self, offset: int, value: int, /) -> int:
        """Swap the word at ``offset``, sequentially consistent; returns the old one."""
    def write(self, offset: int, data: ReadableBuffer, /) -> None:
        """Copy a contiguous buffer in (without the GIL when large)."""
    def read_into(self, offset: int, buffer: WriteableBuffer, /) -> None:
        """Fill a writable buffer from the region."""
    def lease(self, offset: int, nbytes: int, flag_offset: int, /) -> Lease:
        """The bytes as a buffer; freeing the lease stores 1 (release) at ``flag_offset``."""
    def discard(self, offset: int, nbytes: int, /) -> None:
        """Give whole pages back to the OS (``MADV_REMOVE``); they read as zeros until
        written again. ``ValueError`` unless page aligned, ``OSError`` if the kernel refuses."""

@final
class Lease:
    """Bytes of a :class:`Region` lent to a reader; made only by :meth:`Region.lease`."""

    # The C buffer protocol, as PEP 688 spells it (so any bytes-like parameter takes a lease).
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __len__(self) -> int: ...

def map_shared(fd: int, nbytes: int, /) -> Region:
    """Map the first ``nbytes`` of ``fd`` shared and writable; the region keeps no
    descriptor and unmaps when it and its leases are freed."""

def fence() -> None:
    """A sequentially consistent memory fence."""
