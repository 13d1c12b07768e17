"""The shm provider's options: shipped defaults, overrides, validation."""

from __future__ import annotations

import dask
import pytest
from config_support import read_in_a_fresh_process

from dask_lcicomm.config import Settings
from dask_lcicomm.providers.shm_options import ShmOptions


def test_defaults_come_from_the_shipped_yaml():
    assert ShmOptions.of(Settings.from_config()) == ShmOptions(
        ring_size=4 << 20, pool_size=256 << 20, pool_blocks=1024, budget=256 << 20,
        rendezvous_bytes=1 << 20, poll_window=0.0,
    )


@pytest.mark.parametrize(
    "variable, value, field, expected",
    [
        ("SHM__RING_SIZE", "1MiB", "ring_size", 1 << 20),
        ("SHM__POOL_SIZE", "10000", "pool_size", 10000),
        ("SHM__POOL_BLOCKS", "7", "pool_blocks", 7),
        ("SHM__BUDGET", "1TiB", "budget", 1 << 40),
        ("SHM__RENDEZVOUS_BYTES", "0", "rendezvous_bytes", 0),
        ("SHM__POLL_WINDOW", "250us", "poll_window", 250e-6),
        ("SHM__POLL_WINDOW", "0", "poll_window", 0.0),
    ],
)
def test_environment_variables_override(variable, value, field, expected):
    options = read_in_a_fresh_process("dataclasses.asdict(ShmOptions.of(Settings.from_config()))",
                                      **{variable: value})
    assert options[field] == expected


@pytest.mark.parametrize(
    "key, value",
    [("ring-size", 0), ("pool-size", -1), ("pool-blocks", 0), ("budget", -1), ("rendezvous-bytes", -1),
     ("poll-window", "-1ms")],
)
def test_invalid_values_are_refused_naming_the_option(key, value):
    with dask.config.set({f"distributed.comm.lci.shm.{key}": value}):
        settings = Settings.from_config()
    with pytest.raises(ValueError, match=f"distributed.comm.lci.shm.{key} must be"):
        ShmOptions.of(settings)
