"""The rendezvous by reads without a fabric: what a sender lends and takes
back, and the READABLE and READ messages, malformed ones included."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from dask_lcicomm.parcel import ProtocolError
from dask_lcicomm.providers.held_parcels import Held
from dask_lcicomm.providers.message_rendezvous import (
    MAX_ANNOUNCEMENT,
    MAX_BUFFERS,
    Loans,
    parse_read,
    parse_readable,
    read_message,
)


class _Rma:
    """RMA verbs that count registrations; ``refuse`` makes registering fail
    from the given call on."""

    rendezvous_bytes = 1000

    def __init__(self, refuse: int | None = None) -> None:
        self.registered: dict[int, memoryview] = {}
        self.calls = 0
        self.refuse = refuse

    def register(self, buffer):
        self.calls += 1
        if self.refuse is not None and self.calls >= self.refuse:
            raise OSError(12, "fi_mr_reg: cannot allocate memory")
        self.registered[self.calls] = buffer
        return self.calls, 0x1000 * self.calls, 77 + self.calls

    def unregister(self, handle):
        del self.registered[handle]

    def read(self, peer, buffer, address, key):
        raise AssertionError("a sender does not read")


def _array(message: bytes) -> np.ndarray:
    return np.frombuffer(message, np.uint8)


def _views(*sizes: int) -> list[memoryview]:
    return [memoryview(bytes(size)) for size in sizes]


def test_a_group_is_lent_from_the_threshold_on_and_only_over_a_fabric_with_rma():
    assert not Loans(_Rma()).lends(_views(600, 399))
    assert Loans(_Rma()).lends(_views(600, 400))
    assert not Loans(None).lends(_views(1 << 30))
    assert not Loans(_Rma()).lends(_views(*[1] * (MAX_BUFFERS + 1000)))


def test_a_lent_group_is_announced_buffer_by_buffer_and_given_back_once_read():
    rma = _Rma()
    loans, held = Loans(rma), Held(b"parcel", None)
    readable = loans.lend(5, _views(1500, 2500), held)
    assert readable is not None
    assert parse_readable(_array(readable)) == (5, [(0x1000, 78, 1500), (0x2000, 79, 2500)])
    assert held.bulk_out == 1 and len(rma.registered) == 2 and loans
    loans.returned(5)
    assert held.bulk_out == 0 and not rma.registered and not loans
    with pytest.raises(ProtocolError, match="not lent"):
        loans.returned(5)


def test_a_group_too_small_to_lend_is_sent():
    rma = _Rma()
    held = Held(b"parcel", None)
    assert Loans(rma).lend(1, _views(10), held) is None
    assert held.bulk_out == 0 and rma.calls == 0


def test_a_group_the_fabric_cannot_register_is_sent_and_nothing_stays_registered(caplog):
    rma = _Rma(refuse=2)
    held = Held(b"parcel", None)
    loans = Loans(rma)
    assert loans.lend(1, _views(1000, 1000), held) is None
    assert held.bulk_out == 0 and not rma.registered and not loans
    assert "could not register" in caplog.text


def test_closing_takes_every_loan_back():
    rma = _Rma()
    loans = Loans(rma)
    for number in range(3):
        loans.lend(number, _views(1000), Held(b"p", None))
    loans.clear()
    assert not rma.registered and not loans


def test_a_read_message_names_its_group():
    assert parse_read(_array(read_message(2**32 - 1))) == 2**32 - 1


@pytest.mark.parametrize(
    "message",
    [
        b"",
        b"short",
        struct.pack("<II", 1, 0),
        struct.pack("<II", 1, 2) + bytes(24),
        struct.pack("<II", 1, 1) + bytes(25),
        struct.pack("<II", 1, MAX_BUFFERS + 1) + bytes(24 * (MAX_BUFFERS + 1)),
    ],
    ids=["empty", "short", "no buffers", "fewer than it counts", "a byte over", "too many"],
)
def test_a_malformed_readable_announcement_is_a_protocol_error(message):
    assert len(message) <= MAX_ANNOUNCEMENT + 24
    with pytest.raises(ProtocolError):
        parse_readable(_array(message))


@pytest.mark.parametrize("message", [b"", b"abc", b"abcde"])
def test_a_malformed_read_message_is_a_protocol_error(message):
    with pytest.raises(ProtocolError):
        parse_read(_array(message))
