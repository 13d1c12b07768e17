"""The ucx provider's options: shipped defaults, overrides, validation; no
UCX needed."""

from __future__ import annotations

import dask
import pytest
from config_support import read_in_a_fresh_process

from dask_lcicomm.config import Settings
from dask_lcicomm.providers.ucx_options import UcxOptions

SHIPPED = [["TCP_CONN_NB", "y"], ["TCP_RX_SEG_SIZE", "256k"], ["TCP_TX_SEG_SIZE", "256k"],
           ["TLS", "^posix,sysv"]]


def test_defaults_come_from_the_shipped_yaml():
    assert UcxOptions.of(Settings.from_config()).options == tuple(tuple(pair) for pair in SHIPPED)


@pytest.mark.parametrize(
    "variable, value, expected",
    [
        # Merged into the shipped options, by name.
        ("UCX__OPTIONS__TCP_TX_SEG_SIZE", "64k", [*SHIPPED[:2], ["TCP_TX_SEG_SIZE", "64k"], SHIPPED[3]]),
        ("UCX__OPTIONS", '{"tls": "tcp", "ADAPTIVE_PROGRESS": False}',
         [["ADAPTIVE_PROGRESS", "n"], *SHIPPED[:3], ["TLS", "tcp"]]),
    ],
)
def test_environment_variables_override(variable, value, expected):
    options = read_in_a_fresh_process("UcxOptions.of(Settings.from_config()).options", **{variable: value})
    assert options == expected


@pytest.mark.parametrize(
    "value, message",
    [
        ("TLS=tcp", "must be a mapping"),
        ({"TLS tcp": "x"}, "is not a UCX option"),
        ({"TLS": ["tcp"]}, "is not a UCX option"),
        ({"tls": "tcp", "UCX_TLS": "sm"}, "sets TLS twice"),
    ],
)
def test_invalid_options_are_refused(value, message):
    # Set whole, not merged into the shipped mapping: a string replaces it.
    with dask.config.set({"distributed.comm.lci.ucx": {"options": value}}):
        settings = Settings.from_config()
    with pytest.raises(ValueError, match=rf"distributed\.comm\.lci\.ucx\.options.*{message}"):
        UcxOptions.of(settings)


def test_an_environment_variable_wins_over_a_configured_ucx_option(monkeypatch):
    """A ``UCX_<NAME>`` variable is the user's word for this run: the
    configured option of that name is not given to the context, where it
    would override the variable."""
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "64k")
    with dask.config.set({"distributed.comm.lci.ucx": {"options": {"tcp-tx-seg-size": "1m", "tls": "tcp"}}}):
        options = UcxOptions.of(Settings.from_config()).context_options()
    assert options == {"TLS": "tcp"}
