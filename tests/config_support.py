"""Configuration as a fresh process reads it: ``DASK_*`` variables are read
once, when dask's configuration is first built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def read_in_a_fresh_process(expression: str, **variables: str) -> Any:
    """``expression`` (JSON-able, with ``Settings`` in scope) evaluated in a
    new interpreter whose environment adds ``DASK_DISTRIBUTED__COMM__LCI__<NAME>``
    for each ``NAME=value`` of ``variables``."""
    env = {**os.environ, **{f"DASK_DISTRIBUTED__COMM__LCI__{k}": v for k, v in variables.items()}}
    code = ("import dataclasses, json; from dask_lcicomm.config import Settings; "
            "from dask_lcicomm.providers.shm_options import ShmOptions; "
            "from dask_lcicomm.providers.ucx_options import UcxOptions; "
            f"print(json.dumps({expression}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return json.loads(out)
