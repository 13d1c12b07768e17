"""Simulated hosts: what they change on the machine is put back."""

from __future__ import annotations

import subprocess
import sys

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


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def test_hosts_a_killed_process_left_behind_are_removed_and_others_are_not():
    code = ("import sys, time\nfrom dask_lcicomm.testing.netns import virtual_hosts\n"
            "with virtual_hosts(2, '10.215.0.0/24') as hosts:\n"
            "    print(' '.join(h.name for h in hosts), flush=True)\n"
            "    time.sleep(120)\n")
    bounds = _bounds()
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        names = child.stdout.readline().split()
    finally:
        child.kill()
        child.wait()
    tag = names[0].split("-")[1]
    foreign = f"other-{tag}-0"
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        assert tag in _links()  # the killed process removed nothing
        netns.remove_left_behind([*names, foreign])
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(name in listed for name in names) and foreign in listed
        assert tag not in _links()
        assert _bounds() == bounds
    finally:
        subprocess.run(["ip", "netns", "delete", foreign], check=False)
