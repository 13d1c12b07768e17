"""Simulated hosts: what they change on the machine is put back."""

from __future__ import annotations

import pytest

from dask_lcicomm.testing import netns
from dask_lcicomm.testing.netns import unavailable, virtual_hosts

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"no simulated hosts: {unavailable()}")


def _bounds() -> tuple[int, int]:
    return tuple(int(netns._read(netns._NEIGHBOUR_BOUNDS.format(level))) for level in (2, 3))  # type: ignore[return-value]


def test_the_arp_table_has_room_for_every_pair_of_hosts_while_they_exist():
    before = _bounds()
    with virtual_hosts(3):
        assert _bounds() == (before[0] + 12, before[1] + 24)
    assert _bounds() == before


def test_a_bound_somebody_else_changed_meanwhile_stands():
    before = _bounds()
    path = netns._NEIGHBOUR_BOUNDS.format(3)
    try:
        with virtual_hosts(2):
            netns._write(path, str(before[1] + 5000))
        assert _bounds() == (before[0], before[1] + 5000)
    finally:
        netns._write(path, str(before[1]))
