"""Simulated hosts on one machine: network namespaces on a private bridge.

Each :class:`Host` is a network namespace with its own address on a bridge
that only these namespaces share, so traffic between hosts crosses a real
(virtual) network: veth pairs, a bridge, optionally a bandwidth limit, and
never loopback. Everything :func:`virtual_hosts` creates it removes again,
also when the body fails. Needs root and ``ip`` (iproute2).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

_PREFIX = "lci"


@dataclass(frozen=True)
class Host:
    """One simulated host: a network namespace and its address."""

    name: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

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
    n: int, subnet: str = "10.213.0.0/24", rate: str | None = None
) -> Iterator[list[Host]]:
    """``n`` hosts on one private bridge, each rate-limited to ``rate``
    (a ``tc`` rate such as ``"1gbit"``) when given.

    The bridge itself takes the subnet's last address, so that the calling
    process (a client, say) reaches every host from the root namespace.
    """
    tag = uuid.uuid4().hex[:6]
    network = ipaddress.ip_network(subnet)
    *addresses, gateway = list(network.hosts())
    if len(addresses) < n:
        raise ValueError(f"{subnet} has room for fewer than {n} hosts")
    addresses = addresses[:n]
    bridge = f"{_PREFIX}br{tag}"
    with ExitStack() as cleanup:
        _ip("link", "add", bridge, "type", "bridge")
        cleanup.callback(_ip, "link", "delete", bridge)
        _ip("addr", "add", f"{gateway}/{network.prefixlen}", "dev", bridge)
        _ip("link", "set", bridge, "up")
        hosts = []
        for i, address in enumerate(addresses):
            name = f"{_PREFIX}-{tag}-{i}"
            outside, inside = f"{_PREFIX}{tag}o{i}", f"{_PREFIX}{tag}i{i}"
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
            hosts.append(Host(name, str(address)))
        yield hosts


def _delete_link_if_present(name: str) -> None:
    """A veth disappears with its namespace's peer; delete it if it did not."""
    subprocess.run(["ip", "link", "delete", name], capture_output=True)
