"""lci:// does not encrypt; refuse where Dask's configuration demands it."""

from __future__ import annotations

from typing import Any


def check_encryption(address: str, connection_args: dict[str, Any]) -> None:
    """Raise as ``tcp://`` does when encryption is required."""
    if connection_args.get("require_encryption"):
        raise RuntimeError(
            "encryption required by Dask configuration, "
            f"refusing communication from/to 'lci://{address}': lci:// is not encrypted, use tls://"
        )
