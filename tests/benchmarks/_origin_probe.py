"""Cluster-child answer for the baseline test: where the cluster's process
and each of its workers imported ``dask_lcicomm`` from.

A module of its own, importing next to nothing, because the cluster child
and its workers have to import it (and whatever it imports) to run it.
"""

from __future__ import annotations

from typing import Any


def package_file() -> str:
    """This process's ``dask_lcicomm.__file__``."""
    import dask_lcicomm

    return str(dask_lcicomm.__file__)


def answer_origins(client: Any, request: Any) -> tuple[str, dict[str, str]]:
    """``("origins", {"cluster": file, <worker address>: file, ...})``."""
    return ("origins", {"cluster": package_file(), **client.run(package_file)})
