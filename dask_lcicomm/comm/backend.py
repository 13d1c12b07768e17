"""The lci:// backend, registered with Dask through the entry point."""

from __future__ import annotations

from typing import Any

from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.registry import Backend
from distributed.utils import ensure_ip, get_ip

from dask_lcicomm.comm.connector import LCIConnector
from dask_lcicomm.comm.listener import LCIListener


class LCIBackend(Backend):
    def get_connector(self) -> LCIConnector:
        return LCIConnector()

    def get_listener(
        self, loc: str, handle_comm: Any, deserialize: bool, **connection_args: Any
    ) -> LCIListener:
        return LCIListener(loc, handle_comm, deserialize, **connection_args)

    def get_address_host(self, loc: str) -> str:
        return parse_host_port(loc)[0]

    def get_address_host_port(self, loc: str) -> tuple[str, int]:
        return parse_host_port(loc)

    def resolve_address(self, loc: str) -> str:
        host, port = parse_host_port(loc)
        return unparse_host_port(ensure_ip(host), port)

    def get_local_address_for(self, loc: str) -> str:
        host, _ = parse_host_port(loc)
        return unparse_host_port(get_ip(ensure_ip(host)), None)
