"""Benchmarks for dask-lcicomm, run from the repository root.

``python -m benchmarks comm --help`` compares Dask comm backends (``lci://``
against ``tcp://`` and ``ucxx://`` where installed) side by side in one run,
so that the numbers share the same machine state and can be compared
directly: the LCI paper's ping-pong, flood and nchains on Dask's Comm API.
``python -m benchmarks variants --help`` does the same for variants of
``lci://`` that each switch one knob, against the default ``lci`` and ``tcp``;
``python -m benchmarks dask --help`` for real Dask graphs on a LocalCluster.
``python -m benchmarks all`` runs the three; ``--plot DIR`` draws the figures
(:mod:`benchmarks.plots`).  The benchmarks report measurements; the goals
they are read against live in ``docs/benchmarks.md``.
"""
