"""A Dask graph over lci:// in one MPI job, launched by dask-mpi::

    mpirun -n 4 python examples/dask_mpi_lci.py --interface ib0

Rank 0 runs the scheduler, rank 1 the client code below, every other rank a
worker; each listens on the address of the named interface. The client moves
an array from one worker to another, prints one JSON line describing the
cluster, and on its exit dask-mpi shuts the scheduler and workers down, so
the whole job ends with status 0.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from dask_mpi import initialize
from distributed import Client

NBYTES = 4 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description="A Dask graph over lci:// launched by dask-mpi")
    parser.add_argument("--interface", default=None, help="network interface to listen on, e.g. ib0")
    parser.add_argument("--dashboard-address", default=":8787", help="scheduler dashboard; :0 = any port")
    parser.add_argument("--timeout", type=float, default=60, help="seconds to wait for workers and results")
    args = parser.parse_args()

    # Only rank 1 returns; the others serve until the client shuts them down.
    initialize(
        protocol="lci", interface=args.interface, nthreads=1, dashboard_address=args.dashboard_address
    )

    from mpi4py import MPI

    nworkers = MPI.COMM_WORLD.Get_size() - 2
    with Client(timeout=args.timeout) as client:
        client.wait_for_workers(nworkers, timeout=args.timeout)
        workers = sorted(client.scheduler_info()["workers"])
        src, dst = workers[0], workers[-1]
        x = client.submit(np.full, NBYTES, 3, dtype="u1", workers=[src], pure=False)
        total = client.submit(np.sum, x, workers=[dst], allow_other_workers=False)
        print(json.dumps({
            "scheduler": client.scheduler.address,
            "workers": workers,
            "sum": int(total.result(timeout=args.timeout)),
            "expected": 3 * NBYTES,
        }), flush=True)


if __name__ == "__main__":
    main()
