"""Run a Dask computation over lci:// and compare it with tcp://.

Starts a LocalCluster of two worker processes for each scheme, runs the same
communication-heavy graphs on both, checks the answers and prints the times
side by side, alternating schemes so that both see the same machine.
"""

from __future__ import annotations

import argparse
import time

import dask
import dask.array as da
import numpy as np
from distributed import Client, LocalCluster


def _graphs(client: Client) -> dict[str, float]:
    """Run each graph once; return its wall time in seconds."""
    times = {}

    start = time.perf_counter()
    x = da.random.RandomState(0).random_sample((4000, 4000), chunks=(1000, 1000))
    total = client.compute((x + x.T).sum()).result()
    times["(x + x.T).sum(), 128 MB array"] = time.perf_counter() - start
    assert np.isclose(total, 2 * x.sum().compute(scheduler="sync"))

    start = time.perf_counter()
    a, b = client.scheduler_info()["workers"]
    big = client.submit(np.ones, 16 << 20, dtype="u1", workers=[a], pure=False)
    moved = client.submit(np.sum, big, workers=[b], pure=False).result()
    times["move 16 MiB between workers"] = time.perf_counter() - start
    assert moved == 16 << 20

    start = time.perf_counter()
    leaves = [dask.delayed(int)(i) for i in range(1000)]
    while len(leaves) > 1:
        leaves = [dask.delayed(sum)(leaves[i : i + 8]) for i in range(0, len(leaves), 8)]
    result = client.compute(leaves[0]).result()
    times["tree reduction, 1,150 small tasks"] = time.perf_counter() - start
    assert result == sum(range(1000))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per scheme")
    args = parser.parse_args()

    results: dict[str, list[dict[str, float]]] = {"lci": [], "tcp": []}
    for round_ in range(args.rounds):
        for scheme in results:
            with LocalCluster(
                protocol=scheme,
                n_workers=2,
                threads_per_worker=1,
                processes=True,
                dashboard_address=":0",
            ) as cluster, Client(cluster) as client:
                assert cluster.scheduler_address.startswith(f"{scheme}://")
                results[scheme].append(_graphs(client))
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)

    print(f"\nscheduler and 2 workers over lci:// and tcp://, median of {args.rounds} rounds")
    print(f"{'graph':38} {'lci (s)':>9} {'tcp (s)':>9} {'tcp/lci':>8}")
    for graph in results["lci"][0]:
        lci = float(np.median([r[graph] for r in results["lci"]]))
        tcp = float(np.median([r[graph] for r in results["tcp"]]))
        print(f"{graph:38} {lci:9.3f} {tcp:9.3f} {tcp / lci:7.2f}x")


if __name__ == "__main__":
    main()
