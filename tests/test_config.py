"""Configuration: shipped defaults, Dask overrides, environment variables, validation."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import dask
import pytest

from dask_lcicomm.config import DEFAULTS, OPTIONS, Settings
from dask_lcicomm.providers import registry

_PRINT_SETTINGS = (
    "import dataclasses, json; from dask_lcicomm.config import Settings; "
    "print(json.dumps(dataclasses.asdict(Settings.from_config())))"
)


def test_defaults_come_from_the_shipped_yaml():
    settings = Settings.from_config()
    assert settings.progress == dask.config.get("distributed.comm.lci.progress") == "loop"
    assert settings.eager_threshold == 64 * 1024
    assert settings.providers == ("shm", "tcp")
    shm = (settings.shm_ring_size, settings.shm_pool_size, settings.shm_pool_blocks, settings.shm_budget)
    assert shm == (4 << 20, 256 << 20, 1024, 256 << 20)
    assert settings.ucx_options == (
        ("TCP_CONN_NB", "y"), ("TCP_RX_SEG_SIZE", "256k"), ("TCP_TX_SEG_SIZE", "256k"),
        ("TLS", "^posix,sysv"),
    )


def test_dask_config_overrides():
    with dask.config.set(
        {"distributed.comm.lci.ndevices": 3, "distributed.comm.lci.eager-threshold": "1KiB"}
    ):
        settings = Settings.from_config()
    assert (settings.ndevices, settings.eager_threshold) == (3, 1024)


@pytest.mark.parametrize(
    "variable, value, field, expected",
    [
        ("PROGRESS", "thread", "progress", "thread"),
        ("PROGRESS_THREADS", "3", "progress_threads", 3),
        ("EAGER_THRESHOLD", "0", "eager_threshold", 0),
        ("FRAGMENT_SIZE", "4MiB", "fragment_size", 4 << 20),
        ("MAX_MESSAGE_BYTES", "1GiB", "max_message_bytes", 1 << 30),
        ("AGGREGATION", "false", "aggregation", False),
        ("PROVIDERS", "[tcp]", "providers", ["tcp"]),
        ("PROVIDERS", "tcp,shm", "providers", ["tcp", "shm"]),
        ("SHM_RING_SIZE", "1MiB", "shm_ring_size", 1 << 20),
        ("SHM_POOL_SIZE", "10000", "shm_pool_size", 10000),
        ("SHM_POOL_BLOCKS", "7", "shm_pool_blocks", 7),
        ("SHM_BUDGET", "1TiB", "shm_budget", 1 << 40),
        ("SHM_POLL_WINDOW", "250us", "shm_poll_window", 250e-6),
        ("SHM_POLL_WINDOW", "0", "shm_poll_window", 0.0),
        # Merged into the shipped options, by name.
        (
            "UCX_OPTIONS__TCP_TX_SEG_SIZE", "64k", "ucx_options",
            [["TCP_CONN_NB", "y"], ["TCP_RX_SEG_SIZE", "256k"], ["TCP_TX_SEG_SIZE", "64k"],
             ["TLS", "^posix,sysv"]],
        ),
        (
            "UCX_OPTIONS", '{"tls": "tcp", "ADAPTIVE_PROGRESS": False}', "ucx_options",
            [["ADAPTIVE_PROGRESS", "n"], ["TCP_CONN_NB", "y"], ["TCP_RX_SEG_SIZE", "256k"],
             ["TCP_TX_SEG_SIZE", "256k"], ["TLS", "tcp"]],
        ),
    ],
)
def test_environment_variables_override(variable, value, field, expected):
    env = {**os.environ, f"DASK_DISTRIBUTED__COMM__LCI__{variable}": value}
    out = subprocess.run(
        [sys.executable, "-c", _PRINT_SETTINGS], env=env, capture_output=True, text=True,
        check=True, timeout=60,
    ).stdout
    assert json.loads(out)[field] == expected


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("progress", "busy", "progress"),
        ("completion", "maybe", "completion"),
        ("providers", ["carrier-pigeon"], "providers"),
        ("providers", [], "at least one provider"),
        ("shm-ring-size", 0, "shm-ring-size"),
        ("shm-pool-size", -1, "shm-pool-size"),
        ("shm-pool-blocks", 0, "shm-pool-blocks"),
        ("shm-budget", -1, "shm-budget"),
        ("shm-poll-window", "-1ms", "shm-poll-window"),
        ("ndevices", 0, "ndevices"),
        ("eager-threshold", -1, "eager-threshold"),
        ("fragment-size", 0, "fragment-size"),
        ("aggregation", "sometimes", "aggregation"),
        ("ucx-options", "TLS=tcp", "ucx-options must be a mapping"),
        ("ucx-options", {"TLS tcp": "x"}, "is not a UCX option"),
        ("ucx-options", {"TLS": ["tcp"]}, "is not a UCX option"),
        ("ucx-options", {"tls": "tcp", "UCX_TLS": "sm"}, "sets TLS twice"),
    ],
)
def test_invalid_values_are_refused(key, value, message):
    with dask.config.set({f"distributed.comm.lci.{key}": value}), pytest.raises(ValueError, match=message):
        Settings.from_config()


def test_every_shipped_option_is_declared_once_as_a_setting():
    assert list(DEFAULTS) == list(OPTIONS)
    assert [f.name for f in dataclasses.fields(Settings)] == [key.replace("-", "_") for key in OPTIONS]


def test_the_providers_option_names_every_provider_there_is():
    """What the configuration reference says ``providers`` accepts is what exists."""
    package = Path(registry.__file__).parent
    names = {m.name for m in pkgutil.iter_modules([str(package)])
             if hasattr(importlib.import_module(f"dask_lcicomm.providers.{m.name}"), "PROVIDER")}
    assert names == set(re.findall(r"`(\w+)`", OPTIONS["providers"].accepts()))
