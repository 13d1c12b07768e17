"""The process's UCX context: its options and what they keep out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from ucx_support import UCX_MISSING

pytestmark = pytest.mark.skipif(UCX_MISSING is not None, reason=f"no ucx provider: {UCX_MISSING}")


def _printed_by_a_fresh_process(code: str, env: dict[str, str]) -> str:
    """What ``code`` prints in a new interpreter: UCX reads its options once
    per process, when it is first used, so each case needs a process of its own."""
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
        timeout=60,
    ).stdout


def test_an_option_ucx_refuses_is_named_in_why_ucx_is_unavailable():
    """The provider is unavailable, and the reason names the options."""
    env = {**os.environ, "DASK_DISTRIBUTED__COMM__LCI__UCX__OPTIONS": '{"no-such-option": "1"}'}
    reason = _printed_by_a_fresh_process(
        "from dask_lcicomm.providers import ucx_context; print(ucx_context.unavailable())", env
    )
    assert "UCX cannot open the fabric with options" in reason and "NO_SUCH_OPTION" in reason, reason


_SHARED_MAPPINGS = (
    "from dask_lcicomm.providers import ucx_context\n"
    "workers = [ucx_context.new_worker() for _ in range(3)]\n"
    "maps = open('/proc/self/maps').read().splitlines()\n"
    "print(sum(line.endswith('(deleted)') or '/dev/shm/' in line for line in maps))\n"
)


@pytest.mark.parametrize("tls", [None, "all"])
def test_the_shipped_options_keep_shared_memory_out_of_ucx_workers(tls):
    """Peers on one host use the shm provider, so the shipped options leave
    out UCX's shared-memory transports, which map FIFOs into every device's
    worker; ``UCX_TLS=all`` brings them back."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    if tls is not None:
        env["UCX_TLS"] = tls
    shared = _printed_by_a_fresh_process(_SHARED_MAPPINGS, env)
    assert (int(shared) == 0) == (tls is None), shared
