"""Reads from a peer's memory: the kernel's permission, addresses of lent
groups, the copy itself, and the sender's bookkeeping of what it lent."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from dask_lcicomm.parcel import ProtocolError
from dask_lcicomm.providers.base import DeviceLost, SendDone
from dask_lcicomm.providers.shm_reads import (
    READ_HANDLE,
    Lender,
    Loan,
    LoanCompletions,
    address,
    read,
    unreadable,
)


def test_a_process_may_read_itself_and_not_a_process_that_is_gone():
    assert unreadable(os.getpid()) is None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    assert "No such process" in unreadable(gone.pid)
    with pytest.raises(ProcessLookupError, match="the peer that lent 4096 bytes is gone"):
        read(gone.pid, 0, 4096)


def test_a_read_copies_what_lies_at_the_address():
    data = np.arange(3 << 20, dtype=np.uint8)
    view = memoryview(data)
    got = read(os.getpid(), address([view]), data.nbytes)
    assert bytes(got) == data.tobytes()
    data[:] = 0
    assert got[1] == 1, "a read shares no memory with what it read"


def test_a_read_of_unmapped_memory_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="cannot read the 4096 bytes the peer lent at 0x0"):
        read(os.getpid(), 0, 4096)


def test_only_views_back_to_back_have_one_address():
    data = np.zeros(1000, dtype=np.uint8)
    whole = memoryview(data)
    start = address([whole])
    assert address([whole[:400], whole[400:]]) == start
    assert address([whole[:400], whole[500:]]) is None
    assert address([memoryview(b"read-only bytes")]) is not None


class _Flags:
    """Block handles and their flag words, as a pool and a segment keep them."""

    def __init__(self, blocks: int) -> None:
        self.free = list(range(blocks))
        self.read: set[int] = set()

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def lender(self) -> Lender:
        return Lender(self.take, self.free.append, lambda block: block in self.read)


def _group(nbytes: int) -> list[memoryview]:
    return [memoryview(np.ones(nbytes, dtype=np.uint8))]


def test_a_write_completes_once_sent_and_every_group_read():
    flags = _Flags(4)
    lender = flags.lender()
    loan = Loan("token")
    first, second = lender.lend(_group(10), loan), lender.lend(_group(10), loan)
    assert first[0] & READ_HANDLE and second[0] & READ_HANDLE
    assert not lender.sent(loan)
    flags.read.add(first[0] ^ READ_HANDLE)
    assert lender.collect() == []
    flags.read.add(second[0] ^ READ_HANDLE)
    assert lender.collect() == ["token"]
    assert not lender and len(flags.free) == 4


def test_a_write_read_before_it_was_sent_completes_when_sent():
    flags = _Flags(1)
    lender = flags.lender()
    loan = Loan("token")
    handle, _ = lender.lend(_group(10), loan)
    flags.read.add(handle ^ READ_HANDLE)
    assert lender.collect() == []
    assert lender.sent(loan)


def test_nothing_is_lent_without_a_handle_or_an_address():
    flags = _Flags(1)
    lender = flags.lender()
    data = memoryview(np.zeros(100, dtype=np.uint8))
    assert lender.lend([data[:10], data[20:]], None) is None
    assert flags.free == [0], "no handle taken for a group that is not lent"
    assert lender.lend([data], None) is not None
    assert lender.lend([data], None) is None


def test_a_lost_device_fails_sent_writes_still_being_read():
    flags = _Flags(3)
    lender = flags.lender()
    sent, queued = Loan("sent"), Loan("queued")
    lender.lend(_group(10), sent)
    lender.lend(_group(10), queued)
    lender.sent(sent)

    pushed = []

    class Sink:
        push = staticmethod(pushed.append)

    completions = LoanCompletions(Sink(), lambda: lender)
    completions.push(("device", DeviceLost("gone", [queued, "plain"])))
    assert pushed == [("device", DeviceLost("gone", ["queued", "plain", "sent"]))]
    lender.close()
    assert not lender


def test_a_loan_send_is_held_until_read():
    flags = _Flags(1)
    lender = flags.lender()
    loan = Loan("token")
    handle, _ = lender.lend(_group(10), loan)
    pushed = []

    class Sink:
        push = staticmethod(pushed.append)

    completions = LoanCompletions(Sink(), lambda: lender)
    completions.push(("device", SendDone(loan)))
    completions.push(("device", SendDone("plain")))
    assert pushed == [("device", SendDone("plain"))]
    flags.read.add(handle ^ READ_HANDLE)
    assert lender.collect() == ["token"]
