"""A device's unfinished sends: taken back oldest first as far as finished,
bulk messages of held parcels as soon as finished."""

from __future__ import annotations

from dask_lcicomm.providers.held_parcels import Held
from dask_lcicomm.providers.sends_in_flight import SendsInFlight


class _Request:
    def __init__(self) -> None:
        self.completed = False


def _sends(n: int, held: Held | None = None) -> list[tuple[_Request, int, bytes, Held | None]]:
    return [(_Request(), i, b"", held) for i in range(n)]


def test_sends_come_back_oldest_first_as_far_as_finished():
    inflight = SendsInFlight()
    sends = _sends(4)
    for send in sends:
        inflight.add(send)
    sends[1][0].completed = sends[2][0].completed = True
    assert inflight.finished() == []
    sends[0][0].completed = True
    assert inflight.finished() == sends[:3]
    assert list(inflight) == sends[3:] and inflight
    sends[3][0].completed = True
    assert inflight.finished() == sends[3:]
    assert not inflight


def test_a_held_parcels_bulk_message_comes_back_as_soon_as_finished():
    inflight = SendsInFlight()
    stream = _sends(1)[0]
    bulk = _sends(2, Held(b"", None))
    for send in (stream, *bulk):
        inflight.add(send)
    bulk[1][0].completed = True
    assert inflight.finished() == [bulk[1]]
    assert list(inflight) == [stream, bulk[0]]
    inflight.clear()
    assert not inflight and inflight.finished() == []
