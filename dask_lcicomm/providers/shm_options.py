"""The shm provider's options, ``distributed.comm.lci.shm.*`` (defaults and
their meaning in ``lci.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass

from dask_lcicomm.config import Duration, Integer, Section, Settings

SECTION = Section("shm", {
    "ring-size": Integer(size=True),
    "pool-size": Integer(least=0, size=True),
    "pool-blocks": Integer(),
    "budget": Integer(least=0, size=True),
    "rendezvous-bytes": Integer(least=0, size=True),
    "poll-window": Duration(),
})


@dataclass(frozen=True)
class ShmOptions:
    ring_size: int
    pool_size: int
    pool_blocks: int
    budget: int
    rendezvous_bytes: int
    poll_window: float

    @classmethod
    def of(cls, settings: Settings) -> ShmOptions:
        """The section in ``settings``, validated."""
        return cls(**SECTION.parse(settings))
