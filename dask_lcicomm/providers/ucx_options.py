"""The ucx provider's options, ``distributed.comm.lci.ucx.*`` (defaults and
their meaning in ``lci.yaml``): for now the options of its UCX context."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dask_lcicomm.config import PREFIX, Kind, Section, Settings


@dataclass(frozen=True)
class UcxContextOptions(Kind):
    """UCX's option names (upper case, ``_`` for ``-``, ``UCX_`` dropped)
    with values as strings. Names that differ only in spelling are refused:
    Dask merges configuration sources by name up to ``-``/``_`` but not case,
    so which of them came last is unknown here."""

    def accepts(self) -> str:
        return "a mapping of UCX option names (without `UCX_`) to values"

    def parse(self, key: str, value: Any) -> tuple[tuple[str, str], ...]:
        if not isinstance(value, dict):
            raise ValueError(f"{PREFIX}.{key} must be a mapping of UCX options, got {value!r}")
        options: dict[str, str] = {}
        spelled: dict[str, str] = {}
        for name, setting in value.items():
            option = str(name).upper().replace("-", "_").removeprefix("UCX_")
            if not option.replace("_", "").isalnum() or not isinstance(setting, (str, int, float)):
                raise ValueError(f"{PREFIX}.{key}: {name!r}: {setting!r} is not a UCX option")
            if option in spelled:
                raise ValueError(f"{PREFIX}.{key} sets {option} twice: as {spelled[option]!r} and {name!r}")
            spelled[option] = str(name)
            options[option] = ("y" if setting else "n") if isinstance(setting, bool) else str(setting)
        return tuple(sorted(options.items()))


SECTION = Section("ucx", {"options": UcxContextOptions()})


@dataclass(frozen=True)
class UcxOptions:
    #: (UCX name without the ``UCX_`` prefix, value) pairs, in name order.
    options: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, settings: Settings) -> UcxOptions:
        """The section in ``settings``, validated."""
        return cls(**SECTION.parse(settings))

    def context_options(self) -> dict[str, str]:
        """The options to give UCX's context: all but those a ``UCX_<NAME>``
        environment variable sets, which they would override."""
        return {name: value for name, value in self.options if f"UCX_{name}" not in os.environ}
