"""The ofi provider's options, ``distributed.comm.lci.ofi.*`` (defaults and
their meaning in ``lci.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dask_lcicomm.config import PREFIX, Duration, Integer, Kind, Section, Settings


@dataclass(frozen=True)
class Name(Kind):
    """A name handed to libfabric as it is, or null for libfabric's choice."""

    def accepts(self) -> str:
        return "a name, or `null` for libfabric's choice"

    def parse(self, key: str, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip() or "\0" in value:
            raise ValueError(f"{PREFIX}.{key} must be a name or null, got {value!r}")
        return value.strip()


SECTION = Section("ofi", {
    "provider": Name(),
    "node": Name(),
    "probe-interval": Duration(),
    "unreachable-after": Duration(),
    "rendezvous-bytes": Integer(least=0, size=True),
})


@dataclass(frozen=True)
class OfiOptions:
    provider: str | None
    node: str | None
    probe_interval: float
    unreachable_after: float
    rendezvous_bytes: int

    @classmethod
    def of(cls, settings: Settings) -> OfiOptions:
        """The section in ``settings``, validated."""
        return cls(**SECTION.parse(settings))
