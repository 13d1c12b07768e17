"""Configuration of the lci:// backend, read from Dask's config system.

All knobs live under ``distributed.comm.lci``; their defaults ship in
``lci.yaml`` next to this module and can be overridden the usual Dask ways
(YAML files, ``dask.config.set`` or ``DASK_DISTRIBUTED__COMM__LCI__*``).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, TypeVar

import dask
import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

from dask_lcicomm.providers.shm_segment import round_up

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


def _choice(key: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{PREFIX}.{key} must be one of {allowed}, got {value!r}")
    return str(value)


def _provider(name: str) -> str:
    """A name of a provider module (see :mod:`dask_lcicomm.providers.registry`)."""
    if not name.isidentifier() or importlib.util.find_spec(f"dask_lcicomm.providers.{name}") is None:
        raise ValueError(f"{PREFIX}.providers: there is no provider called {name!r}")
    return name


def _positive(key: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"{PREFIX}.{key} must be >= 1, got {value!r}")
    return value


def _seconds(key: str, config: dict[str, Any]) -> float:
    """A duration (``"500us"``, ``"1ms"``, or a number of seconds)."""
    try:
        return float(parse_timedelta(config[key], default="s"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{PREFIX}.{key} must be a duration, got {config[key]!r}") from e


_Number = TypeVar("_Number", int, float)


def _non_negative(key: str, value: _Number) -> _Number:
    if value < 0:
        raise ValueError(f"{PREFIX}.{key} must be >= 0, got {value!r}")
    return value


def _flag(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
    if str(value).strip().lower() in words:
        return words[str(value).strip().lower()]
    raise ValueError(f"{PREFIX}.{key} must be true or false, got {value!r}")


def _ucx_options(value: object) -> tuple[tuple[str, str], ...]:
    """UCX's option names (upper case, ``_`` for ``-``, ``UCX_`` dropped)
    with values as strings. Names that differ only in spelling are refused:
    Dask merges configuration sources by name up to ``-``/``_`` but not case,
    so which of them came last is unknown here."""
    if not isinstance(value, dict):
        raise ValueError(f"{PREFIX}.ucx-options must be a mapping of UCX options, got {value!r}")
    options: dict[str, str] = {}
    spelled: dict[str, str] = {}
    for name, setting in value.items():
        key = str(name).upper().replace("-", "_").removeprefix("UCX_")
        if not key.replace("_", "").isalnum() or not isinstance(setting, (str, int, float)):
            raise ValueError(f"{PREFIX}.ucx-options: {name!r}: {setting!r} is not a UCX option")
        if key in spelled:
            raise ValueError(f"{PREFIX}.ucx-options sets {key} twice: as {spelled[key]!r} and {name!r}")
        spelled[key] = str(name)
        options[key] = ("y" if setting else "n") if isinstance(setting, bool) else str(setting)
    return tuple(sorted(options.items()))


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
    shm_poll_window: float
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

        def nbytes(key: str) -> int:
            return int(parse_bytes(c[key]) if isinstance(c[key], str) else c[key])

        providers = c["providers"]
        if isinstance(providers, str):
            providers = [p.strip() for p in providers.strip("[]").split(",")]
        providers = tuple(_provider(str(p)) for p in providers)
        if not providers:
            raise ValueError(f"{PREFIX}.providers must name at least one provider")
        return cls(
            progress=_choice("progress", c["progress"], PROGRESS_MODES),
            progress_threads=_positive("progress-threads", int(c["progress-threads"])),
            poll_interval=_seconds("poll-interval", c),
            completion=_choice("completion", c["completion"], COMPLETION_MODES),
            ndevices=_positive("ndevices", int(c["ndevices"])),
            providers=providers,
            eager_threshold=_non_negative("eager-threshold", nbytes("eager-threshold")),
            fragment_size=_positive("fragment-size", nbytes("fragment-size")),
            aggregation=_flag("aggregation", c["aggregation"]),
            write_high_water=_positive("write-high-water", nbytes("write-high-water")),
            max_message_bytes=nbytes("max-message-bytes"),
            max_frames=_positive("max-frames", int(c["max-frames"])),
            max_eager_bytes=_positive("max-eager-bytes", nbytes("max-eager-bytes")),
            shm_ring_size=round_up(_positive("shm-ring-size", nbytes("shm-ring-size"))),
            shm_pool_size=round_up(_non_negative("shm-pool-size", nbytes("shm-pool-size"))),
            shm_pool_blocks=_positive("shm-pool-blocks", int(c["shm-pool-blocks"])),
            shm_poll_window=_non_negative("shm-poll-window", _seconds("shm-poll-window", c)),
            ucx_options=_ucx_options(c["ucx-options"]),
        )
