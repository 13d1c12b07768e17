"""Simulated hosts on one machine: network namespaces on a private bridge.

Each :class:`Host` is a network namespace with its own address on a bridge
that only these namespaces share, so traffic between hosts crosses a real
(virtual) network: veth pairs, a bridge, optionally a bandwidth limit, and
never loopback. Optionally each host also has a ``/dev/shm`` of its own (a
tmpfs that every process of the host mounts over ``/dev/shm`` in a private
mount namespace), as separate machines would. Everything
:func:`virtual_hosts` creates it removes again, also when the body fails.
Needs root and ``ip`` (iproute2); private ``/dev/shm`` also ``unshare``.

The kernel's ARP table is one for all namespaces, and its default bound
(``gc_thresh3``: 1,024 entries) is less than the n * (n - 1) entries of n
hosts that all talk to each other once n reaches 32: beyond it the kernel
logs "neighbor table overflow" and drops packets, SYNs included. So
:func:`virtual_hosts` raises the bounds for as many hosts as it makes, and
puts the previous values back when it removes them.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

_PREFIX = "lci"
_NEIGHBOUR_BOUNDS = "/proc/sys/net/ipv4/neigh/default/gc_thresh{}"


@dataclass(frozen=True)
class Host:
    """One simulated host: a network namespace, its address, and the name of the
    interface that carries it inside the namespace (what ``--interface`` takes)."""

    name: str
    address: str
    shm: str | None = None
    interface: str | None = None

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace (and with its ``/dev/shm``)."""
        if self.shm is None:
            return ["ip", "netns", "exec", self.name, *argv]
        return [
            "ip", "netns", "exec", self.name, "unshare", "--mount", "--propagation", "private",
            "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"', self.shm, *argv,
        ]

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), check=True, **kwargs)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    probe = f"{_PREFIX}-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"cannot create a network namespace: {e.stderr.strip()}"
    _ip("netns", "delete", probe)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def virtual_hosts(
    n: int, subnet: str = "10.213.0.0/24", rate: str | None = None, private_shm: bool = False
) -> Iterator[list[Host]]:
    """``n`` hosts on one private bridge, each rate-limited to ``rate``
    (a ``tc`` rate such as ``"1gbit"``) when given, and each with its own
    ``/dev/shm`` (``Host.shm`` is where it lies in ours) if ``private_shm``.

    The bridge itself takes the subnet's last address, so that the calling
    process (a client, say) reaches every host from the root namespace.
    """
    tag = uuid.uuid4().hex[:6]
    network = ipaddress.ip_network(subnet)
    *addresses, gateway = list(network.hosts())
    if len(addresses) < n:
        raise ValueError(f"{subnet} has room for fewer than {n} hosts")
    addresses = addresses[:n]
    bridge = _bridge(tag)
    with ExitStack() as cleanup:
        _make_neighbour_room(n * (n + 1), cleanup)
        _ip("link", "add", bridge, "type", "bridge")
        cleanup.callback(_ip, "link", "delete", bridge)
        _ip("addr", "add", f"{gateway}/{network.prefixlen}", "dev", bridge)
        _ip("link", "set", bridge, "up")
        hosts = []
        for i, address in enumerate(addresses):
            name, outside, inside = _host_names(tag, i)
            _ip("netns", "add", name)
            cleanup.callback(_ip, "netns", "delete", name)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            cleanup.callback(_delete_link_if_present, outside)
            _ip("link", "set", inside, "netns", name)
            _ip("link", "set", outside, "master", bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", name, "addr", "add", f"{address}/{network.prefixlen}", "dev", inside)
            _ip("-n", name, "link", "set", inside, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            if rate is not None:
                subprocess.run(
                    ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", inside,
                     "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"],
                    check=True, capture_output=True, text=True,
                )
            shm = _private_shm(cleanup) if private_shm else None
            hosts.append(Host(name, str(address), shm, inside))
        yield hosts


def _bridge(tag: str) -> str:
    return f"{_PREFIX}br{tag}"


def _host_names(tag: str, index: int) -> tuple[str, str, str]:
    """A host's namespace, and the outside and inside ends of its veth."""
    return f"{_PREFIX}-{tag}-{index}", f"{_PREFIX}{tag}o{index}", f"{_PREFIX}{tag}i{index}"


def remove_left_behind(namespaces: Iterable[str]) -> None:
    """Remove hosts that :func:`virtual_hosts` made in a process killed
    before it cleaned up: each namespace, its veth and its bridge, and the
    room it made in the ARP table for them (given all hosts of that call).
    Names this module did not make are left alone."""
    removed: dict[str, int] = {}
    for name in namespaces:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != _PREFIX or not parts[2].isdigit():
            continue
        _, tag, index = parts
        if subprocess.run(["ip", "netns", "delete", name], capture_output=True).returncode == 0:
            removed[tag] = removed.get(tag, 0) + 1
        _delete_link_if_present(_host_names(tag, int(index))[1])
        _delete_link_if_present(_bridge(tag))
    for n in removed.values():
        _make_neighbour_room(-n * (n + 1))


def _make_neighbour_room(entries: int, cleanup: ExitStack | None = None) -> None:
    """Let the ARP table hold ``entries`` more than it may now (soft and
    hard bounds, ``gc_thresh2`` and ``gc_thresh3``); fewer, if negative. On
    ``cleanup`` a bound returns to its value before, unless somebody changed
    it meanwhile (a testbed of another process, say): theirs stands."""
    for level in (2, 3):
        path = _NEIGHBOUR_BOUNDS.format(level)
        before = _read(path)
        raised = str(int(before) + entries * (level - 1))
        _write(path, raised)
        if cleanup is not None:
            cleanup.callback(_restore, path, raised, before)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _restore(path: str, raised: str, before: str) -> None:
    if _read(path) == raised:
        _write(path, before)


def gateway_address(subnet: str = "10.213.0.0/24") -> str:
    """The address the bridge of :func:`virtual_hosts` takes in the root
    namespace (the subnet's last host address): where a process outside
    the hosts, a scheduler say, listens to be reached by all of them."""
    return str(list(ipaddress.ip_network(subnet).hosts())[-1])


def _private_shm(cleanup: ExitStack) -> str:
    """A fresh tmpfs, unmounted and removed on cleanup."""
    path = tempfile.mkdtemp(prefix=f"{_PREFIX}-shm-")
    cleanup.callback(os.rmdir, path)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,mode=1777", "tmpfs", path],
                   check=True, capture_output=True, text=True)
    cleanup.callback(subprocess.run, ["umount", "-l", path], check=False, capture_output=True)
    return path


def _delete_link_if_present(name: str) -> None:
    """A veth disappears with its namespace's peer; delete it if it did not."""
    subprocess.run(["ip", "link", "delete", name], capture_output=True)
