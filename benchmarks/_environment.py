"""What a run was measured on: the machine, the versions, the code and the
lci:// settings every configuration starts from, recorded in every JSON."""

from __future__ import annotations

import datetime
import importlib.util
import os
import platform
import subprocess
import sys
from dataclasses import asdict
from typing import Any

import distributed
import numpy
import psutil

#: The package a baseline build replaces in its processes.
PACKAGE = "dask_lcicomm"


#: Prefix of the environment variables that configure the lci:// backend.
LCI_ENV_PREFIX = "DASK_DISTRIBUTED__COMM__LCI__"


def environment_facts() -> dict[str, Any]:
    """The machine, the versions and the code measured, plus any lci knobs
    the harness inherited: those silently change every lci configuration."""
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "distributed": distributed.__version__,
        "numpy": numpy.__version__,
        "source": source_revision(),
        PACKAGE: _package_dir(),
        "lci_settings": _lci_settings(),
        "argv": sys.argv,
        "inherited_lci_env": {k: v for k, v in os.environ.items() if k.startswith(LCI_ENV_PREFIX)},
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def _lci_settings() -> dict[str, Any] | str:
    """The lci:// settings every configuration starts from (defaults plus
    the inherited environment), or why they are invalid."""
    from dask_lcicomm.config import Settings

    try:
        return asdict(Settings.from_config())
    except ValueError as exc:
        return one_line(exc)


def _package_dir() -> str:
    """Where this process (and every configuration without a ``pythonpath``)
    finds :data:`PACKAGE`."""
    spec = importlib.util.find_spec(PACKAGE)
    origin = spec.origin if spec else None
    return os.path.dirname(origin) if origin else "unknown"


def source_revision(where: str | None = None) -> str:
    """The commit of the code in ``where`` (default: the code measured),
    marked ``-dirty`` when the work tree differs from it: numbers of
    uncommitted code are not the commit's."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10,
                              cwd=where or os.path.dirname(__file__))
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() or "unknown"


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]
