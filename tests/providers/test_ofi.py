"""The ofi provider where it cannot run: a clear error within 5 s when it is
the only provider listed, a logged fallback otherwise; a peer it cannot
reach likewise. (Its devices are tested with the other providers': the
message-fabric, device, contract, buffer, lifecycle and graph tests.)"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time

import dask
import pytest
from distributed.comm import connect, listen
from distributed.comm.core import FatalCommClosedError
from distributed.utils_test import gen_test
from ofi_support import OFI_MISSING

from dask_lcicomm import providers
from dask_lcicomm.providers import ofi, registry

pytestmark = pytest.mark.skipif(OFI_MISSING is not None, reason=f"no ofi provider: {OFI_MISSING}")


def _forget_reasons() -> None:
    """Each reason is found and logged once per process: forget earlier tests'."""
    ofi._unavailable.cache_clear()
    registry._report_unavailable.cache_clear()


async def _connect_fails(seconds: float, match: str) -> None:
    listener = listen("lci://127.0.0.1:0", lambda comm: None)
    await listener.start()
    start = time.monotonic()
    try:
        with pytest.raises(FatalCommClosedError, match=match):
            await connect(listener.contact_address, timeout=30)
    finally:
        listener.stop()
    assert time.monotonic() - start < seconds


@gen_test(timeout=30)
async def test_a_missing_libfabric_provider_as_the_only_provider_is_an_error_naming_it():
    _forget_reasons()
    try:
        with dask.config.set({"distributed.comm.lci.providers": ["ofi"],
                              "distributed.comm.lci.ofi.provider": "nonesuch"}):
            await _connect_fails(5, "ofi: libfabric opens no endpoint with provider 'nonesuch'")
    finally:
        _forget_reasons()


@gen_test(timeout=30)
async def test_a_missing_libfabric_provider_falls_back_to_tcp_with_a_warning(caplog):
    _forget_reasons()
    accepted: asyncio.Queue = asyncio.Queue()
    try:
        with caplog.at_level(logging.WARNING, "dask_lcicomm"), dask.config.set(
            {"distributed.comm.lci.providers": ["ofi", "tcp"],
             "distributed.comm.lci.ofi.provider": "nonesuch"}
        ):
            async with listen("lci://127.0.0.1:0", accepted.put) as listener:
                comm = await connect(listener.contact_address)
                other = await asyncio.wait_for(accepted.get(), 10)
                assert comm.extra_info["provider"] == "tcp"
                await comm.close()
                await other.close()
        assert "provider ofi is unavailable: libfabric opens no endpoint" in caplog.text
    finally:
        _forget_reasons()


def test_without_the_extension_the_reason_says_how_to_build_it(monkeypatch):
    _forget_reasons()
    monkeypatch.delitem(sys.modules, "dask_lcicomm.providers.ofi_fabric", raising=False)
    monkeypatch.setitem(sys.modules, "dask_lcicomm.providers._ofi", None)
    monkeypatch.delattr(providers, "_ofi", raising=False)
    try:
        reason = ofi.PROVIDER.unavailable()
        assert reason is not None and "libfabric-dev" in reason and "reinstall" in reason
    finally:
        _forget_reasons()


@gen_test(timeout=30)
async def test_a_peer_ofi_cannot_reach_is_an_error_within_the_bound(monkeypatch):
    """The listener's offer names an endpoint that is gone: libfabric fails
    the hello once its connection is refused (or, where nothing refuses it,
    answers "retry" until ``unreachable-after`` has passed), and the connect
    fails naming why."""
    from dask_lcicomm.providers import _ofi
    from dask_lcicomm.providers.ofi_fabric import OfiFabric

    gone = _ofi.Endpoint()
    address = gone.name().hex()
    gone.close()
    open_peer = OfiFabric.open_peer
    monkeypatch.setattr(OfiFabric, "open_peer", lambda self, _: open_peer(self, address))
    with dask.config.set({"distributed.comm.lci.providers": ["ofi"],
                          "distributed.comm.lci.ofi.unreachable-after": "1s"}):
        await _connect_fails(
            5, "ofi: the ofi fabric (lost the peer|took no send to the peer .* cannot reach it)")


def test_an_address_of_another_length_is_refused_before_libfabric_reads_it():
    """A peer's hello carries its address: libfabric would read as many bytes
    as its format has, whatever the buffer holds."""
    from dask_lcicomm.providers import _ofi

    endpoint = _ofi.Endpoint()
    try:
        name = endpoint.name()
        for address in (b"", name[:-1], name + b"\0"):
            with pytest.raises(ValueError, match="-byte address"):
                endpoint.insert(address)
        assert endpoint.insert(name) >= 0
    finally:
        endpoint.close()
    with pytest.raises(ValueError, match="closed"):
        endpoint.fileno()


_SIGNALS_KEPT = """
import os, signal, sys
handled = []
signal.signal(signal.SIGTERM, lambda *_: handled.append("SIGTERM"))
from dask_lcicomm.providers import ofi_fabric, ofi_options
from dask_lcicomm.config import Settings
ofi_fabric.open_endpoint(ofi_options.OfiOptions.of(Settings.from_config())).close()
os.kill(os.getpid(), signal.SIGTERM)
try:
    os.kill(os.getpid(), signal.SIGINT)
    signal.sigtimedwait([], 0.1)
except KeyboardInterrupt:
    handled.append("SIGINT")
print(*handled)
"""


def test_libfabric_leaves_the_signal_handlers_of_the_process_as_they_were():
    """Debian's libfabric links a library (libinfinipath) that installs its
    own SIGTERM and SIGINT handlers as it loads: Dask's graceful close on
    SIGTERM and Python's KeyboardInterrupt must still work after an endpoint
    opened and closed (a fresh process: this one has loaded libfabric)."""
    done = subprocess.run([sys.executable, "-c", _SIGNALS_KEPT], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout.split()) == (0, ["SIGTERM", "SIGINT"]), done.stderr
