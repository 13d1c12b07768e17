"""LCIConnector: opens lci:// comms."""

from __future__ import annotations

from typing import Any

from distributed.comm.addressing import parse_host_port
from distributed.comm.core import Connector

from dask_lcicomm.comm.comm import LCIComm
from dask_lcicomm.comm.security import check_encryption
from dask_lcicomm.parcelport import Parcelport


class LCIConnector(Connector):
    async def connect(self, address: str, deserialize: bool = True, **connection_args: Any) -> LCIComm:
        """Open a virtual connection; ``OSError`` when the peer is unreachable."""
        check_encryption(address, connection_args)
        host, port = parse_host_port(address)
        vconn = await Parcelport.current().connect(host, port)
        return LCIComm(vconn, deserialize)
