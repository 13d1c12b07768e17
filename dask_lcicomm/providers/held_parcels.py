"""Parcels held back until the bulk messages they name have reached the
peer, in order per virtual connection: a parcel with large bulk groups joins
its device's stream only then, so that it never holds up the small parcels
of other virtual connections (see :mod:`.message_device`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from dask_lcicomm.providers.send_queue import Unit


class Held:
    """One parcel held back, and how many of its bulk messages are still out."""

    __slots__ = ("unit", "token", "bulk_out")

    def __init__(self, unit: Unit, token: Any) -> None:
        self.unit = unit
        self.token = token
        #: Bulk messages of this parcel not yet finished sending.
        self.bulk_out = 0


class HeldParcels(dict[int, deque[Held]]):
    """The lines of held parcels, by virtual connection (a dict: whether any
    is held is asked at every post, and a dict answers without a call into
    Python)."""

    def __init__(self) -> None:
        super().__init__()
        #: Bytes of the parcels held.
        self.nbytes = 0

    def holds(self, vc: int) -> bool:
        """Whether a parcel of ``vc`` is held: later ones must queue behind it."""
        return vc in self

    def append(self, vc: int, held: Held) -> None:
        self.setdefault(vc, deque()).append(held)
        self.nbytes += held.unit.nbytes

    def ready(self) -> Iterator[tuple[int, Held]]:
        """Take the parcels at the head of each line whose bulk messages are
        all out, in line order."""
        for vc, line in list(self.items()):
            while line and line[0].bulk_out == 0:
                held = line.popleft()
                self.nbytes -= held.unit.nbytes
                yield vc, held
            if not line:
                del self[vc]

    def drop(self) -> list[Any]:
        """Drop every held parcel; the tokens of those that had one."""
        tokens = [held.token for line in self.values() for held in line if held.token is not None]
        self.clear()
        self.nbytes = 0
        return tokens
