"""Logistic regression by mini-batch SGD on 8 Dask workers, four ways.

The workers exchange models (256 KiB each: 32,768 features) over lci://
directly with each other: bsp (all-to-all averaging every round), bsp-ring
(ring all-reduce), async (reduce whatever arrived) and asap (averaging with
two peers under NOTIFY-ACK). Each mode prints how close it got to the
optimum f* found by a centralised solver, in how long and how many bytes.

    python examples/asap_logreg.py [--scheme tcp] [--rounds 100]

On one machine with no bandwidth limit the comm is cheap, so the time
differences are small; ``python -m benchmarks asap`` runs the same problem
on emulated hosts with limited bandwidth and slow workers.
"""

from __future__ import annotations

import argparse

from distributed import Client, LocalCluster

from dask_lcicomm.asap import MODES, Pacing, SparseLogReg, choose_graph, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="lci")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()

    problem = SparseLogReg(nworkers=args.workers)
    _, f_star = problem.solve()
    print(f"f* = {f_star:.5f} (centralised solver); model {problem.init_model().nbytes // 1024} KiB")
    graph = choose_graph(args.workers, max_degree=2)
    print(f"sparse graph {graph.name}: spectral gap {graph.spectral_gap:.3f}, diameter {graph.diameter:g}")

    with LocalCluster(protocol=args.scheme, n_workers=args.workers, threads_per_worker=1,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        for mode in MODES:
            report = train(client, problem, mode=mode, graph=graph, rounds=args.rounds,
                           pacing=Pacing(compute_s=0.01, factor=4.0, transient=True))
            elapsed = max(w.elapsed_s for w in report.workers)
            print(f"{mode:9s} {report.graph:28s} loss - f* = {report.final_loss - f_star:.5f}  "
                  f"accuracy {report.final_accuracy:.3f}  {elapsed:5.1f} s  "
                  f"{report.bytes_sent / 1e6:7.1f} MB  waited {report.wait_s:4.1f} s/worker  "
                  f"max iteration gap {report.max_iteration_gap()}")


if __name__ == "__main__":
    main()
