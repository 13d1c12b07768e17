"""Child-process target for the variants test: report the lci settings the
backend would use in that process.

A module of its own, importing next to nothing, because every ``spawn``-ed
child has to import it (and whatever it imports) before running it.
"""

from __future__ import annotations

from dataclasses import asdict
from multiprocessing.connection import Connection


def report_settings(conn: Connection) -> None:
    """Send ``Settings.from_config()`` as a dict, or the error as a string."""
    try:
        from dask_lcicomm.config import Settings

        conn.send(("settings", asdict(Settings.from_config())))
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
