"""dask-lcicomm: an HPC-style communication backend for Dask (scheme ``lci://``)."""

from dask_lcicomm import config as _config  # noqa: F401  (registers defaults)

__version__ = "0.1.0"
