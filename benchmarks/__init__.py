"""Benchmarks of dask-lcicomm, run from the repository root as
``python -m benchmarks COMMAND``; see ``docs/benchmarks.md``."""
