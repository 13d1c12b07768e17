"""Configuration: shipped defaults, Dask overrides, environment variables, validation."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from pathlib import Path

import dask
import pytest
from config_support import read_in_a_fresh_process

from dask_lcicomm.config import DEFAULTS, OPTIONS, SECTIONS, Settings
from dask_lcicomm.providers import registry


def test_defaults_come_from_the_shipped_yaml():
    settings = Settings.from_config()
    assert settings.progress == dask.config.get("distributed.comm.lci.progress") == "loop"
    assert settings.eager_threshold == 64 * 1024
    assert settings.providers == ("shm", "tcp")
    assert settings.release_after == 1.0
    assert set(settings.sections) == set(SECTIONS) == {"shm", "ucx", "ofi"}


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
        ("RELEASE_AFTER", "0", "release_after", 0.0),
        ("PROVIDERS", "[tcp]", "providers", ["tcp"]),
        ("PROVIDERS", "tcp,shm", "providers", ["tcp", "shm"]),
    ],
)
def test_environment_variables_override(variable, value, field, expected):
    settings = read_in_a_fresh_process("dataclasses.asdict(Settings.from_config())", **{variable: value})
    assert settings[field] == expected


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("progress", "busy", "progress"),
        ("completion", "maybe", "completion"),
        ("providers", ["carrier-pigeon"], "providers"),
        ("providers", [], "at least one provider"),
        ("ndevices", 0, "ndevices"),
        ("eager-threshold", -1, "eager-threshold"),
        ("fragment-size", 0, "fragment-size"),
        ("aggregation", "sometimes", "aggregation"),
        ("release-after", "soon", "release-after"),
    ],
)
def test_invalid_values_are_refused(key, value, message):
    with dask.config.set({f"distributed.comm.lci.{key}": value}), pytest.raises(ValueError, match=message):
        Settings.from_config()


@pytest.mark.parametrize(("old", "new"), [("shm-ring-size", "shm.ring-size"),
                                          ("shm-release-after", "release-after"),
                                          ("shm.release-after", "release-after"),
                                          ("ucx-options", "ucx.options")])
def test_an_option_that_moved_says_where(old, new):
    with dask.config.set({f"distributed.comm.lci.{old}": "1"}), pytest.raises(
        ValueError, match=f"distributed.comm.lci.{old} is now distributed.comm.lci.{new}"
    ):
        Settings.from_config()


def test_every_shipped_option_is_declared_once_as_a_setting_or_a_section():
    assert [key for key in DEFAULTS if key not in SECTIONS] == list(OPTIONS)
    fields = [f.name for f in dataclasses.fields(Settings)]
    assert fields == [key.replace("-", "_") for key in OPTIONS] + ["sections"]


@pytest.mark.parametrize("name", SECTIONS)
def test_every_section_is_declared_by_its_provider(name):
    """The provider of each section validates exactly the shipped options."""
    section = registry.get(name).section
    assert section is not None and section.name == name
    assert list(section.options) == list(DEFAULTS[name])
    assert set(section.parse(Settings.from_config())) == {key.replace("-", "_") for key in DEFAULTS[name]}


def test_a_section_refuses_an_option_it_does_not_have():
    """A misspelt option is an error, not a silent default."""
    with dask.config.set({"distributed.comm.lci.shm.rign-size": "1MiB"}):
        settings = Settings.from_config()
    with pytest.raises(ValueError, match=r"distributed\.comm\.lci\.shm has no option rign-size; it has ring"):
        registry.checked(settings)


def test_the_listed_providers_options_are_checked_before_anything_opens():
    with dask.config.set({"distributed.comm.lci.shm.ring-size": 0}):
        with pytest.raises(ValueError, match=r"distributed\.comm\.lci\.shm\.ring-size must be >= 1"):
            registry.checked(Settings.from_config())
        # Not listed, not checked: its options cannot matter.
        with dask.config.set({"distributed.comm.lci.providers": ["tcp"]}):
            assert registry.checked(Settings.from_config()).providers == ("tcp",)


def test_the_providers_option_names_every_provider_there_is():
    """What the configuration reference says ``providers`` accepts is what exists."""
    package = Path(registry.__file__).parent
    names = {m.name for m in pkgutil.iter_modules([str(package)])
             if hasattr(importlib.import_module(f"dask_lcicomm.providers.{m.name}"), "PROVIDER")}
    assert names == set(re.findall(r"`(\w+)`", OPTIONS["providers"].accepts()))
