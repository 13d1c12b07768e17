"""Configuration of the lci:// backend, read from Dask's config system.

All knobs live under ``distributed.comm.lci``; their defaults ship in
``lci.yaml`` next to this module and can be overridden the usual Dask ways
(YAML files, ``dask.config.set`` or ``DASK_DISTRIBUTED__COMM__LCI__*``).
"""

from __future__ import annotations

import importlib.util
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
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
        except (TypeError, ValueError, KeyError) as e:  # KeyError: an unknown unit
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
        return "a list of provider names: `shm`, `tcp`, `ucx`, `ofi`"

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
    "release-after": Duration(),
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
    release_after: float
    #: Each provider's section (``distributed.comm.lci.<provider>``) as
    #: configured, merged over its defaults; the provider validates it
    #: (:class:`Section`).
    sections: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False)

    @classmethod
    def from_config(cls) -> Settings:
        """Read and validate the current Dask configuration."""
        # Merged over the shipped defaults: a configuration snapshot taken
        # before this package was imported (test harnesses do) lacks them.
        # Keys are normalised to hyphens: a DASK_..._EAGER_THRESHOLD variable
        # read before the defaults were registered arrives as eager_threshold.
        user = _hyphenated(dask.config.get(PREFIX, default={}))
        for old, new in RENAMED.items():
            section, _, key = old.rpartition(".")
            scope = user.get(section) if section else user
            if isinstance(scope, Mapping) and key in scope:
                raise ValueError(f"{PREFIX}.{old} is now {PREFIX}.{new}")
        c = {**DEFAULTS, **user}
        sections = {name: _section(name, user.get(name, {})) for name in SECTIONS}
        return cls(**{key.replace("-", "_"): kind.parse(key, c[key]) for key, kind in OPTIONS.items()},
                   sections=sections)


def _hyphenated(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with ``-`` for ``_`` in its keys, at every level: an
    environment variable read before the defaults were registered arrives as
    ``eager_threshold``, and a section's keys may too."""
    return {key.replace("_", "-"): _hyphenated(value) if isinstance(value, Mapping) else value
            for key, value in config.items()}


def _section(name: str, user: Any) -> dict[str, Any]:
    """Section ``name`` as configured, over its defaults option by option."""
    if not isinstance(user, Mapping):
        raise ValueError(f"{PREFIX}.{name} must be a mapping of options, got {user!r}")
    return {**DEFAULTS[name], **user}


#: The sections of ``lci.yaml``: one per provider with options of its own.
SECTIONS = tuple(key for key, value in DEFAULTS.items() if isinstance(value, dict))

#: Options that moved: into their provider's section, or out of it.
RENAMED = {
    **{f"shm-{key}": f"shm.{key}" for key in DEFAULTS["shm"]},
    "ucx-options": "ucx.options",
    "shm-release-after": "release-after",
    "shm.release-after": "release-after",
}


@dataclass(frozen=True)
class Section:
    """The options of one provider, ``distributed.comm.lci.<name>.*``: the
    provider declares and validates them, so this module knows no provider."""

    name: str
    options: Mapping[str, Kind]

    def parse(self, settings: Settings) -> dict[str, Any]:
        """The section's values in ``settings``, validated, by field name
        (``-`` as ``_``); ``ValueError`` naming the option if one is not
        valid or not known."""
        raw = settings.sections.get(self.name, {})
        unknown = sorted(set(raw) - set(self.options))
        if unknown:
            raise ValueError(f"{PREFIX}.{self.name} has no option {', '.join(unknown)}; "
                             f"it has {', '.join(self.options)}")
        return {key.replace("-", "_"): kind.parse(f"{self.name}.{key}", raw[key])
                for key, kind in self.options.items()}
