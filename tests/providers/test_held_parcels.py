"""Parcels held back until their bulk messages are out: released in order
per virtual connection, a line never overtaken by its own later parcels."""

from __future__ import annotations

from dask_lcicomm.providers.held_parcels import Held, HeldParcels
from dask_lcicomm.providers.send_queue import Raw


def _held(name: bytes, bulk_out: int, token: object = None) -> Held:
    held = Held(Raw(name), token)
    held.bulk_out = bulk_out
    return held


def test_lines_release_in_order_and_only_from_their_head():
    parcels = HeldParcels()
    first, second, other = _held(b"a1", 1), _held(b"a2", 0), _held(b"b1", 0)
    for vc, held in ((1, first), (1, second), (2, other)):
        parcels.append(vc, held)
    assert parcels and parcels.holds(1) and parcels.nbytes == 6
    # a2 is ready but waits behind a1; b1 goes.
    assert list(parcels.ready()) == [(2, other)]
    assert parcels.holds(1) and not parcels.holds(2) and parcels.nbytes == 4
    first.bulk_out = 0
    assert list(parcels.ready()) == [(1, first), (1, second)]
    assert not parcels and parcels.nbytes == 0


def test_dropping_returns_the_tokens_of_what_never_left():
    parcels = HeldParcels()
    parcels.append(1, _held(b"x", 2, token="t1"))
    parcels.append(1, _held(b"y", 0))
    parcels.append(3, _held(b"z", 1, token="t3"))
    assert parcels.drop() == ["t1", "t3"]
    assert not parcels and parcels.nbytes == 0 and list(parcels.ready()) == []
