"""What a cluster's comms leave in memory: a P2P shuffle and a P2P rechunk on
many workers of one host, with shared memory and the processes' PSS sampled.

``python -m benchmarks.cluster_memory [--workers 16] [--rows 16M] [--rounds 1]
[--memory-limits off|default] [--configs tcp,lci,lci-keep,lci-unbounded] [--json OUT]``

Each configuration runs in a fresh interpreter of its own (the workers
inherit its environment), in alternating order per round:

* ``tcp`` and ``lci``: Dask's comm and ours, as configured by default;
* ``lci-keep``: lci with ``shm.release-after: 0``, idle shared memory kept
  until the devices close (as before it was given back);
* ``lci-unbounded``: lci with an ``shm.budget`` of 1 TiB, so that every
  process lends as much as its pools hold (as before the budget).

The work: ``dd.from_pandas`` of ``--rows`` rows (``c0``..``c7`` float64, key
``k`` int64 in [0, 1e6), 64 partitions) persisted first, then timed:
``len(df.shuffle("k", shuffle_method="p2p").persist())`` and a p2p rechunk of
a (160000, 800) array from (160000, 25) chunks to (5000, 800), summed. Every
0.2 s a thread reads ``Shmem`` from ``/proc/meminfo`` and sums the PSS of the
driver and every process under it; the table has the peaks during the work
and the values 3 s after it, then 3 s after the input is released too (the
client sends it inside its graph; the workers keep it, and over lci it lives
where it was received: in shared memory). With ``--memory-limits off`` Dask's memory
management is off (no target, spill, pause or terminate: nothing reacts to
what the comms hold); with ``default`` the workers have Dask's default
limits, and the table counts the spills, pauses and restarts they caused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._sampler import Sampler

MiB = 1 << 20
CONFIGS: dict[str, tuple[str, dict[str, str]]] = {
    "tcp": ("tcp", {}),
    "lci": ("lci", {}),
    "lci-keep": ("lci", {"DASK_DISTRIBUTED__COMM__LCI__SHM__RELEASE_AFTER": "0"}),
    "lci-unbounded": ("lci", {"DASK_DISTRIBUTED__COMM__LCI__SHM__BUDGET": "1TiB"}),
}
SAMPLE_S = 0.2
AFTER_S = 3.0


def _shmem() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Shmem in /proc/meminfo")


def _summed_pss() -> int:
    import psutil

    me = psutil.Process()
    total = 0
    for process in [me, *me.children(recursive=True)]:
        try:
            total += process.memory_full_info().pss
        except psutil.Error:
            pass  # gone between listing and reading
    return total


def _memory_config(limits: str) -> dict[str, Any]:
    if limits == "default":
        return {}
    return {f"distributed.worker.memory.{key}": False
            for key in ("target", "spill", "pause", "terminate")}


def _reactions(client: Any) -> dict[str, int]:
    """Spills, pauses and restarts of the workers so far."""

    def spilled(dask_worker: Any) -> float:
        metrics = getattr(dask_worker.data, "cumulative_metrics", {})
        return float(metrics.get(("disk-write", "count"), 0))

    pauses = sum(1 for events in client.get_events().values() for _, event in events
                 if isinstance(event, dict) and event.get("action") == "worker-status-change"
                 and event.get("status") == "paused")
    return {"spills": int(sum(client.run(spilled).values())), "pauses": pauses,
            "workers": len(client.scheduler_info()["workers"])}


def measure(scheme: str, workers: int, rows: int, limits: str) -> dict[str, Any]:
    """One configuration, in this process: the cluster, the work, the samples."""
    import dask
    import dask.array as da
    import dask.dataframe as dd
    import numpy as np
    import pandas as pd
    from distributed import Client, LocalCluster

    rng = np.random.default_rng(0)
    frame = pd.DataFrame({f"c{i}": rng.random(rows) for i in range(8)})
    frame["k"] = rng.integers(0, 1_000_000, rows)
    memory_limit: Any = 0 if limits == "off" else "auto"
    with dask.config.set(_memory_config(limits)), LocalCluster(
        protocol=scheme, n_workers=workers, threads_per_worker=1, memory_limit=memory_limit,
        dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        pids = set(client.run(os.getpid).values())
        df = dd.from_pandas(frame, npartitions=64).persist()
        client.wait_for_workers(workers)
        len(df)
        del frame
        with Sampler(lambda: (_shmem(), _summed_pss()), SAMPLE_S) as sampler:
            time.sleep(1.0)
            start = time.monotonic()
            shuffled = len(df.shuffle("k", shuffle_method="p2p").persist())
            middle = time.monotonic()
            array = da.random.RandomState(0).random((160000, 800), chunks=(160000, 25))
            total = float(array.rechunk((5000, 800), method="p2p").sum().compute())
            end = time.monotonic()
            time.sleep(AFTER_S)
            after = sampler.samples[-1]
            # What stays is the input the client sent in its graph, kept by
            # the workers (and the scheduler, to recompute): let it go too.
            client.cancel(df)
            del df
            time.sleep(AFTER_S)
            released = sampler.samples[-1]
        if shuffled != rows or not 0.49 < total / array.size < 0.51:
            raise RuntimeError(f"wrong results: {shuffled} rows, mean {total / array.size}")
        reactions = _reactions(client)
        reactions["restarts"] = len(set(client.run(os.getpid).values()) - pids)
        peak_shmem, peak_pss = sampler.peak(start, end)
        return {"shuffle_s": middle - start, "rechunk_s": end - middle,
                "peak_shmem": peak_shmem, "peak_pss": peak_pss,
                "after_shmem": after[1], "after_pss": after[2],
                "released_shmem": released[1], "released_pss": released[2], **reactions}


def _run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    scheme, env = CONFIGS[name]
    command = [sys.executable, "-m", "benchmarks.cluster_memory", "--one", scheme,
               "--workers", str(args.workers), "--rows", str(args.rows),
               "--memory-limits", args.memory_limits]
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=args.timeout, check=False)
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(results: dict[str, list[dict[str, Any]]]) -> str:
    rows = [("shuffle + rechunk, s", lambda r: f"{r['shuffle_s']:.1f} + {r['rechunk_s']:.1f}"),
            ("Shmem at the peak, MiB", lambda r: f"{r['peak_shmem'] / MiB:,.0f}"),
            (f"Shmem {AFTER_S:.0f} s after, MiB", lambda r: f"{r['after_shmem'] / MiB:,.0f}"),
            ("summed PSS at the peak, MiB", lambda r: f"{r['peak_pss'] / MiB:,.0f}"),
            (f"summed PSS {AFTER_S:.0f} s after, MiB", lambda r: f"{r['after_pss'] / MiB:,.0f}"),
            (f"Shmem {AFTER_S:.0f} s after the input is released, MiB",
             lambda r: f"{r['released_shmem'] / MiB:,.0f}"),
            (f"summed PSS {AFTER_S:.0f} s after the input is released, MiB",
             lambda r: f"{r['released_pss'] / MiB:,.0f}"),
            ("spills / pauses / restarts",
             lambda r: f"{r['spills']} / {r['pauses']} / {r['restarts']}")]
    names = list(results)
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, cell in rows:
        cells = [", ".join(cell(r) for r in results[name]) for name in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster_memory",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--rows", type=int, default=16_000_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--memory-limits", choices=("off", "default"), default="off")
    parser.add_argument("--configs", default="tcp,lci,lci-keep")
    parser.add_argument("--timeout", type=float, default=900.0, help="per configuration, s")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.workers, args.rows, args.memory_limits)))
        return 0
    names = [name.strip() for name in args.configs.split(",")]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {list(CONFIGS)}")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            print(f"round {round_index + 1}: {name}", file=sys.stderr, flush=True)
            results[name].append(_run_config(name, args))
    print(_table(results))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                  if k not in ("json", "one")},
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
