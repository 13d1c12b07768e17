"""Named selections of distributed's tests, and the pinned environment they run in.

Paths are relative to the root of distributed's source tree, except ``ours:``
entries, which are modules of this directory run in the same pytest process.
Both selections run with distributed's own fd-leak checker made fatal
(``--leaks=fds --leaks-fail``): a comm backend that leaks sockets, pipes or
shared-memory descriptors should fail here, and the tcp baseline run shows
which leaks are upstream's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DISTRIBUTED_VERSION = "2026.7.1"

# What the selected files import (numpy, pandas and pyarrow through dask's
# extras), distributed's pytest plugins, and pytest-xdist for --jobs.
REQUIREMENTS = [
    f"distributed=={DISTRIBUTED_VERSION}",
    f"dask[array,dataframe]=={DISTRIBUTED_VERSION}",
    "pytest==9.2.0",
    "pytest-timeout==2.4.0",
    "pytest-rerunfailures==16.7",
    "pytest-repeat==0.9.4",
    "pytest-xdist==3.8.0",
]


@dataclass(frozen=True)
class Selection:
    """Test paths or node ids, pytest arguments, and time bounds for one run."""

    paths: list[str]
    args: list[str] = field(default_factory=lambda: ["--leaks=fds", "--leaks-fail"])
    test_timeout: int = 120
    run_timeout: int = 900


FAST = Selection(
    paths=[
        "ours:comms_generic.py",
        "distributed/comm/tests/test_comms.py::test_default_client_server_ipv4",
        "distributed/tests/test_worker.py::test_worker_fds",
        "distributed/tests/test_scheduler.py::test_file_descriptors_dont_leak",
        "distributed/shuffle/tests/test_rechunk.py::test_rechunk_in_memory_shards_dont_share_buffer",
        "distributed/tests/test_worker_memory.py",
        "distributed/tests/test_nanny.py",
    ],
)

FULL = Selection(
    paths=[
        "ours:comms_generic.py",
        "distributed/comm/tests/test_comms.py",
        "distributed/tests/test_core.py",
        "distributed/tests/test_worker.py",
        "distributed/tests/test_worker_memory.py",
        "distributed/tests/test_scheduler.py",
        "distributed/tests/test_nanny.py",
        "distributed/tests/test_steal.py",
        "distributed/tests/test_client.py",
        "distributed/shuffle/tests",  # includes test_rechunk.py
    ],
    test_timeout=300,
    run_timeout=4 * 3600,
)

SELECTIONS = {"fast": FAST, "full": FULL}
