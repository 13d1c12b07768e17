"""Providers found by name; one that cannot be imported is unavailable, not fatal."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dask_lcicomm.providers import registry

#: A fresh interpreter in which the shm provider's C helper was never built:
#: a LocalCluster over lci:// computes on tcp, the reason is logged once, and
#: with shm the only provider a connect fails at once, naming the reason.
_WITHOUT_THE_HELPER = """
import asyncio, json, logging, sys, time
sys.modules["dask_lcicomm.providers._atomics"] = None
import dask
from distributed import Client, LocalCluster
from distributed.comm import connect, listen
from distributed.comm.core import FatalCommClosedError
from dask_lcicomm import connections

records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("dask_lcicomm").addHandler(handler)

with LocalCluster(protocol="lci", n_workers=2, threads_per_worker=1, processes=False,
                  dashboard_address=":0") as cluster, Client(cluster) as client:
    futures = client.map(lambda i: bytes(100_000 * i), range(1, 5))
    total = client.submit(lambda parts: sum(map(len, parts)), futures).result()
    providers = sorted({c["provider"] for cs in client.run(connections).values() for c in cs})

async def only_shm():
    with dask.config.set({"distributed.comm.lci.providers": ["shm"]}):
        listener = listen("lci://127.0.0.1:0", lambda comm: None)
        await listener.start()
        start = time.monotonic()
        try:
            await connect(listener.contact_address, timeout=30)
        except FatalCommClosedError as e:
            return str(e), time.monotonic() - start
        finally:
            listener.stop()
    return "connected", 0.0

error, seconds = asyncio.run(only_shm())
warnings = [r for r in records if "provider shm is unavailable" in r]
print(json.dumps({"total": total, "providers": providers, "warnings": warnings,
                  "error": error, "seconds": seconds}))
"""


def test_an_unknown_name_is_an_error():
    with pytest.raises(ValueError, match="no lci:// provider called 'nonesuch'"):
        registry.get("nonesuch")


def test_a_provider_is_one_object_per_process():
    assert registry.get("tcp") is registry.get("tcp")
    assert registry.get("tcp").unavailable() is None


def test_without_the_compiled_helper_lci_runs_on_tcp_and_says_why():
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_THE_HELPER], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["total"] == 100_000 * (1 + 2 + 3 + 4)
    assert result["providers"] == ["tcp"]
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "C helper dask_lcicomm.providers._atomics" in result["warnings"][0]
    assert "shm: the shm provider needs its C helper" in result["error"]
    assert result["seconds"] < 5
