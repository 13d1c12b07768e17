"""Benchmarks for dask-lcicomm, run from the repository root.

``python -m benchmarks comm --help`` compares Dask comm backends (``lci://``
against ``tcp://`` and optionally ``ucxx://``) side by side in one run, so that
the numbers share the same machine state and can be compared directly.
``python -m benchmarks variants --help`` does the same for variants of
``lci://`` that each switch one knob, against the default ``lci`` and ``tcp``.
"""
