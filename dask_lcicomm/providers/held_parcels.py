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


class HeldParcels:
    """The lines of held parcels, one per virtual connection."""

    def __init__(self) -> None:
        self._lines: dict[int, deque[Held]] = {}
        #: Bytes of the parcels held.
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self._lines)

    def holds(self, vc: int) -> bool:
        """Whether a parcel of ``vc`` is held: later ones must queue behind it."""
        return vc in self._lines

    def append(self, vc: int, held: Held) -> None:
        self._lines.setdefault(vc, deque()).append(held)
        self.nbytes += held.unit.nbytes

    def ready(self) -> Iterator[tuple[int, Held]]:
        """Take the parcels at the head of each line whose bulk messages are
        all out, in line order."""
        for vc, line in list(self._lines.items()):
            while line and line[0].bulk_out == 0:
                held = line.popleft()
                self.nbytes -= held.unit.nbytes
                yield vc, held
            if not line:
                del self._lines[vc]

    def clear(self) -> list[Any]:
        """Drop every held parcel; the tokens of those that had one."""
        tokens = [held.token for line in self._lines.values() for held in line if held.token is not None]
        self._lines.clear()
        self.nbytes = 0
        return tokens
