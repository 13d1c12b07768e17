"""What a cluster's comms leave in memory during and after a P2P shuffle and rechunk (docs/benchmarks.md)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import psutil

from benchmarks import _runner
from benchmarks._contenders import Configuration
from benchmarks._procs import run_in_child
from benchmarks._sampler import Sampler, proc_bytes, pss
from benchmarks.comm import variant
from benchmarks.report import markdown_table

CONFIGS = {c.label: c for c in (
    Configuration.of_scheme("tcp"), Configuration.of_scheme("lci"),
    variant("lci-keep", {"release-after": 0}),  # idle shared memory kept
    variant("lci-unbounded", {"shm.budget": "1TiB"}),  # every process lends as much as its pools hold
)}
MiB = 1 << 20
SAMPLE_S, AFTER_S = 0.2, 3.0
_AFTER, _RELEASED = f"{AFTER_S:.0f} s after", f"{AFTER_S:.0f} s after the input is released"
_MIB_ROWS = {"peak_shmem": "Shmem at the peak", "after_shmem": f"Shmem {_AFTER}",
             "peak_pss": "summed PSS at the peak", "after_pss": f"summed PSS {_AFTER}",
             "released_shmem": f"Shmem {_RELEASED}", "released_pss": f"summed PSS {_RELEASED}"}


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
    off = {f"distributed.worker.memory.{key}": False for key in ("target", "spill", "pause", "terminate")}
    with dask.config.set({} if limits == "default" else off), LocalCluster(
        protocol=scheme, n_workers=workers, threads_per_worker=1,
        memory_limit=0 if limits == "off" else "auto", dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        pids = set(client.run(os.getpid).values())
        df = dd.from_pandas(frame, npartitions=64).persist()
        client.wait_for_workers(workers)
        len(df)
        del frame
        me = psutil.Process()  # the driver, and every process under it
        with Sampler(lambda: (proc_bytes("/proc/meminfo", "Shmem:"),
                              pss(p.pid for p in [me, *me.children(recursive=True)])), SAMPLE_S) as sampler:
            time.sleep(1.0)
            start = time.monotonic()
            shuffled = len(df.shuffle("k", shuffle_method="p2p").persist())
            middle = time.monotonic()
            array = da.random.RandomState(0).random((160000, 800), chunks=(160000, 25))
            total = float(array.rechunk((5000, 800), method="p2p").sum().compute())
            end = time.monotonic()
            time.sleep(AFTER_S)
            after = sampler.samples[-1]
            # The input, sent in the client's graph, stays with the workers (and the scheduler, to
            # recompute it) and over lci in the shared memory it was received in: let it go too.
            client.cancel(df)
            del df
            time.sleep(AFTER_S)
            released = sampler.samples[-1]
        if shuffled != rows or not 0.49 < total / array.size < 0.51:
            raise RuntimeError(f"wrong results: {shuffled} rows, mean {total / array.size}")
        # What Dask's memory management did: spills, pauses and restarts of the workers.
        spills = client.run(lambda dask_worker: getattr(dask_worker.data, "cumulative_metrics", {}).get(
            ("disk-write", "count"), 0))
        pauses = sum(1 for events in client.get_events().values() for _, event in events
                     if isinstance(event, dict) and event.get("action") == "worker-status-change"
                     and event.get("status") == "paused")
        peak_shmem, peak_pss = sampler.peak(start, end)
        return {"shuffle_s": middle - start, "rechunk_s": end - middle,
                "peak_shmem": peak_shmem, "peak_pss": peak_pss, "after_shmem": after[1],
                "after_pss": after[2], "released_shmem": released[1], "released_pss": released[2],
                "spills": int(sum(spills.values())), "pauses": pauses,
                "restarts": len(set(client.run(os.getpid).values()) - pids),
                "workers": len(client.scheduler_info()["workers"])}


def _table(results: dict[str, list[dict[str, Any]]]) -> str:
    cells: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("shuffle + rechunk, s", lambda r: f"{r['shuffle_s']:.1f} + {r['rechunk_s']:.1f}"),
        *((f"{label}, MiB", lambda r, key=key: f"{r[key] / MiB:,.0f}") for key, label in _MIB_ROWS.items()),
        ("spills / pauses / restarts", lambda r: f"{r['spills']} / {r['pauses']} / {r['restarts']}")]
    return markdown_table(["", *results], ([label, *(", ".join(map(cell, rs)) for rs in results.values())]
                                          for label, cell in cells))


def main(argv: list[str] | None = None) -> int:
    parser = _runner.tool_parser("cluster_memory", __doc__, CONFIGS, ("tcp", "lci", "lci-keep"))
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--rows", type=int, default=16_000_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--memory-limits", choices=("off", "default"), default="off")
    parser.add_argument("--timeout", type=float, default=900.0, help="per configuration, s")
    args = parser.parse_args(argv)
    configs = [CONFIGS[name] for name in args.configs]
    results: dict[str, list[dict[str, Any]]] = {c.label: [] for c in configs}
    for index, c in _runner.alternated(configs, args.rounds):
        _runner.progress(f"round {index + 1}: {c.label}")
        results[c.label].append(run_in_child(
            measure, c.scheme, args.workers, args.rows, args.memory_limits, name=c.label,
            dask_config=c.overrides, timeout_s=args.timeout))
    print(_table(results))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"} | {"configs": ",".join(args.configs)}
        _runner.write_json(args.json, {"args": settings, "results": results}, 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
