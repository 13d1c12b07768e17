"""Configuration of the lci:// backend, read from Dask's config system.

All knobs live under ``distributed.comm.lci``; their defaults ship in
``lci.yaml`` next to this module and can be overridden the usual Dask ways
(YAML files, ``dask.config.set`` or ``DASK_DISTRIBUTED__COMM__LCI__*``).
"""

from __future__ import annotations

import importlib.util
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, TypeVar

import dask
import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

PREFIX = "distributed.comm.lci"

PROGRESS_MODES = ("loop", "thread", "poll")
COMPLETION_MODES = ("queue", "sync")


def _load_defaults() -> dict:
    path = os.path.join(os.path.dirname(__file__), "lci.yaml")
    with open(path) as f:
        defaults = yaml.safe_load(f)
    dask.config.update_defaults(defaults)
    return defaults["distributed"]["comm"]["lci"]


DEFAULTS = _load_defaults()


class Kind(ABC):
    """What values an option accepts: parses and validates one, and says
    in words what it accepts (the configuration reference is made of it)."""

    @abstractmethod
    def accepts(self) -> str:
        """The accepted values, in words (Markdown)."""

    @abstractmethod
    def parse(self, key: str, value: Any) -> Any:
        """``value`` of option ``key`` validated; ``ValueError`` naming the key if it is not."""


@dataclass(frozen=True)
class Choice(Kind):
    values: tuple[str, ...]

    def accepts(self) -> str:
        return "one of " + ", ".join(f"`{v}`" for v in self.values)

    def parse(self, key: str, value: Any) -> str:
        if value not in self.values:
            raise ValueError(f"{PREFIX}.{key} must be one of {self.values}, got {value!r}")
        return str(value)


@dataclass(frozen=True)
class Integer(Kind):
    """An integer, at least ``least``; with ``size``, a number of bytes, also
    as a string such as ``"64KiB"``."""

    least: int = 1
    size: bool = False

    def accepts(self) -> str:
        if self.size:
            return f"a size in bytes >= {self.least} (`64KiB`, `1MiB`, or a number)"
        return f"an integer >= {self.least}"

    def parse(self, key: str, value: Any) -> int:
        number = parse_bytes(value) if self.size and isinstance(value, str) else value
        return _at_least(key, int(number), self.least)


@dataclass(frozen=True)
class Duration(Kind):
    """A duration: seconds, or a string such as ``"500us"``."""

    def accepts(self) -> str:
        return "a duration >= 0 (`500us`, `1ms`, or a number of seconds)"

    def parse(self, key: str, value: Any) -> float:
        try:
            seconds = float(parse_timedelta(value, default="s"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{PREFIX}.{key} must be a duration, got {value!r}") from e
        return _at_least(key, seconds, 0)


@dataclass(frozen=True)
class Flag(Kind):
    def accepts(self) -> str:
        return "`true` or `false`"

    def parse(self, key: str, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
        word = str(value).strip().lower()
        if word in words:
            return words[word]
        raise ValueError(f"{PREFIX}.{key} must be true or false, got {value!r}")


@dataclass(frozen=True)
class Providers(Kind):
    def accepts(self) -> str:
        return "a list of provider names: `shm`, `tcp`, `ucx`"

    def parse(self, key: str, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            value = [p.strip() for p in value.strip("[]").split(",")]
        names = tuple(str(name) for name in value)
        for name in names:
            if not name.isidentifier() or importlib.util.find_spec(f"dask_lcicomm.providers.{name}") is None:
                raise ValueError(f"{PREFIX}.{key}: there is no provider called {name!r}")
        if not names:
            raise ValueError(f"{PREFIX}.{key} must name at least one provider")
        return names


@dataclass(frozen=True)
class UcxOptions(Kind):
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


_Number = TypeVar("_Number", int, float)


def _at_least(key: str, value: _Number, least: int) -> _Number:
    if value < least:
        raise ValueError(f"{PREFIX}.{key} must be >= {least}, got {value!r}")
    return value


#: Every option under ``distributed.comm.lci`` and what it accepts; each is a
#: field of :class:`Settings` (``-`` for ``_``), its default in ``lci.yaml``.
OPTIONS: dict[str, Kind] = {
    "progress": Choice(PROGRESS_MODES),
    "progress-threads": Integer(),
    "poll-interval": Duration(),
    "completion": Choice(COMPLETION_MODES),
    "ndevices": Integer(),
    "providers": Providers(),
    "eager-threshold": Integer(least=0, size=True),
    "fragment-size": Integer(size=True),
    "aggregation": Flag(),
    "write-high-water": Integer(size=True),
    "max-message-bytes": Integer(size=True),
    "max-frames": Integer(),
    "max-eager-bytes": Integer(size=True),
    "shm-ring-size": Integer(size=True),
    "shm-pool-size": Integer(least=0, size=True),
    "shm-pool-blocks": Integer(),
    "shm-budget": Integer(least=0, size=True),
    "shm-poll-window": Duration(),
    "shm-release-after": Duration(),
    "ucx-options": UcxOptions(),
}


@dataclass(frozen=True)
class Settings:
    """A validated snapshot of ``distributed.comm.lci``; defaults live in ``lci.yaml``."""

    progress: str
    progress_threads: int
    poll_interval: float
    completion: str
    ndevices: int
    providers: tuple[str, ...]
    eager_threshold: int
    fragment_size: int
    aggregation: bool
    write_high_water: int
    max_message_bytes: int
    max_frames: int
    max_eager_bytes: int
    shm_ring_size: int
    shm_pool_size: int
    shm_pool_blocks: int
    shm_budget: int
    shm_poll_window: float
    shm_release_after: float
    #: (UCX name without the ``UCX_`` prefix, value) pairs, in name order.
    ucx_options: tuple[tuple[str, str], ...]

    @classmethod
    def from_config(cls) -> Settings:
        """Read and validate the current Dask configuration."""
        # Merged over the shipped defaults: a configuration snapshot taken
        # before this package was imported (test harnesses do) lacks them.
        # Keys are normalised to hyphens: a DASK_..._EAGER_THRESHOLD variable
        # read before the defaults were registered arrives as eager_threshold.
        user = dask.config.get(PREFIX, default={})
        c = {**DEFAULTS, **{key.replace("_", "-"): value for key, value in user.items()}}
        return cls(**{key.replace("-", "_"): kind.parse(key, c[key]) for key, kind in OPTIONS.items()})
