"""dask-lcicomm: an HPC-style communication backend for Dask (scheme ``lci://``)."""

from dask_lcicomm import config as _config  # noqa: F401  (registers defaults)
from dask_lcicomm.parcelport import connections

__all__ = ["connections"]
__version__ = "0.1.0"
