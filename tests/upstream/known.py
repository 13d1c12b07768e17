"""Upstream tests that hard-code TCP, so they cannot pass over another scheme.

Each key is a pytest node id (``fnmatch`` patterns allowed, for parametrized
ids); each value says why, from the test's source in distributed 2026.7.1, and
how that shows: a regular expression that the failure's message or traceback
must match. A listed test that fails any other way is reported like any
other failure, and one that passes is reported as a stale entry.

A test belongs here only because of what its source says. A test that merely
fails over lci:// shows a defect of lci:// and is reported, not listed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase


@dataclass(frozen=True)
class Known:
    reason: str
    match: str  # re.search()ed in the failure's message and traceback


# Shared by every test that intercepts comms with distributed.utils_test's
# freeze_batched_send() or _LockedCommPool: both wrap the comm in LockedComm.
_LOCKED_COMM = Known(
    "Intercepts comms through distributed.utils_test.LockedComm (via freeze_batched_send() "
    "or _LockedCommPool), whose __init__ asserts isinstance(comm, TCP).",
    r"assert isinstance\(comm, TCP\)",
)

KNOWN: dict[str, Known] = {
    # get_host_array() knows only tcp://'s buffer owners.
    "distributed/shuffle/tests/test_rechunk.py::test_rechunk_in_memory_shards_dont_share_buffer": Known(
        "distributed.protocol.utils_test.get_host_array() walks memoryview, ndarray, bytes and "
        "bytearray, the buffer owners that tcp:// produces, and raises TypeError on any other, "
        "such as a shared-memory lease. The property (received shards do not share one buffer) "
        "is tested for lci:// by the project in tests/comm/test_buffers.py, and over the default "
        "scheme by tests/upstream/comms_generic.py::test_do_not_share_buffers.",
        r"TypeError: Unexpected numpy buffer",
    ),
    # Literal tcp:// expected where the address has no scheme, i.e. the default one.
    "distributed/comm/tests/test_comms.py::test_resolve_address*": Known(
        'Asserts that resolve_address("127.0.0.2:789"), which has no scheme, gives '
        '"tcp://127.0.0.2:789": it takes the default scheme to be tcp.',
        r"== 'tcp://127\.0\.0\.2:789'",
    ),
    "distributed/tests/test_core.py::test_coerce_to_address": Known(
        'Asserts that coerce_to_address() of scheme-less addresses gives "tcp://127.0.0.1:8786": '
        "it takes the default scheme to be tcp.",
        r"== 'tcp://127\.0\.0\.1:8786'",
    ),
    "distributed/tests/test_core.py::test_rpc_inputs": Known(
        'Asserts that rpc("127.0.0.1:8884") and rpc(("127.0.0.1", 8884)) have the address '
        '"tcp://127.0.0.1:8884": it takes the default scheme to be tcp.',
        r'r\.address == "tcp://127\.0\.0\.1:8884"',
    ),
    "distributed/tests/test_core.py::test_server": Known(
        'Listens with server.listen(8881), no scheme, then asserts the address "tcp://IP:8881" '
        'and connects to "tcp://127.0.0.1:8881".',
        r"assert '\w+://[\d.]+:8881' == 'tcp://[\d.]+:8881'",
    ),
    "distributed/tests/test_scheduler.py::test_coerce_address": Known(
        'Asserts that Scheduler.coerce_address("127.0.0.1:8000") is "tcp://127.0.0.1:8000": it '
        "takes the default scheme to be tcp.",
        r"== 'tcp://127\.0\.0\.1:8000'",
    ),
    "distributed/tests/test_core.py::test_connection_pool": Known(
        "Servers listen without a scheme (the default one), but the test looks their comms up in "
        'ConnectionPool.available under "tcp://127.0.0.1:PORT".',
        r'rpc\.available\["tcp://127\.0\.0\.1:%d"',
    ),
    "distributed/tests/test_core.py::test_close_properly": Known(
        "Servers listen without a scheme (the default one), but the test connects to them with "
        'rpc("tcp://IP:8883") ("We use TCP here for simplicity"), which a non-tcp listener does '
        "not answer.",
        r"CommClosedError: in <TCP \(closed\)",
    ),
    # Literal tcp:// expected where a worker or scheduler follows the default scheme.
    "distributed/tests/test_nanny.py::test_worker_uses_same_host_as_nanny": Known(
        'Starts nannies with host="tcp://0.0.0.0" and "tcp://127.0.0.2" and asserts that literal '
        "in the worker's listen address; a worker takes its scheme from the scheduler's address, "
        "so over any other scheme the address is e.g. lci://0.0.0.0:PORT.",
        r"assert 'tcp://0\.0\.0\.0' in '\w+://0\.0\.0\.0:\d+'",
    ),
    "distributed/tests/test_worker.py::test_service_hosts_match_worker": Known(
        'Asserts that a worker started with host="" (its scheme from the scheduler\'s address) '
        'has an address in ("tcp://[::1]", "tcp://127.0.0.1").',
        r"in \('tcp://\[::1\]', 'tcp://127\.0\.0\.1'\)",
    ),
    "distributed/tests/test_worker.py::test_gather_missing_workers": Known(
        'Asserts b.address.startswith("tcp://127.0.0.1:") for a gen_cluster worker, whose scheme '
        "is the scheduler's, i.e. the default one.",
        r"startswith of str object at 0x[0-9a-f]+>\('tcp://127\.0\.0\.1:'\)",
    ),
    "distributed/tests/test_worker.py::test_interface_async*": Known(
        'Starts Scheduler(interface="lo") without a protocol (so the default scheme) and asserts '
        's.address.startswith("tcp://127.0.0.1").',
        r"startswith of str object at 0x[0-9a-f]+>\('tcp://127\.0\.0\.1'\)",
    ),
    # LockedComm.
    "distributed/tests/test_scheduler.py::test_deadlock_dependency_of_queued_released_when_worker_removed*": (
        _LOCKED_COMM
    ),
    "distributed/tests/test_scheduler.py::test_deadlock_resubmit_queued_tasks_fast*": _LOCKED_COMM,
    "distributed/tests/test_scheduler.py::test_stimulus_from_erred_task": _LOCKED_COMM,
    "distributed/tests/test_scheduler.py::test_transition_waiting_memory": _LOCKED_COMM,
    "distributed/tests/test_steal.py::test_steal_worker_dies_same_ip": _LOCKED_COMM,
    "distributed/tests/test_worker.py::test_heartbeat_missing_real_cluster": _LOCKED_COMM,
    # The assertion fails inside the worker's gather_dep, which logs it and errs the task.
    "distributed/tests/test_worker.py::test_task_flight_compute_oserror": _LOCKED_COMM,
}


def lookup(nodeid: str, failure: str) -> Known | None:
    """The entry that explains ``nodeid`` failing with ``failure`` (its message
    and traceback), if there is one."""
    for pattern, known in KNOWN.items():
        if fnmatchcase(nodeid, pattern) and re.search(known.match, failure):
            return known
    return None


def listed(nodeid: str) -> bool:
    return any(fnmatchcase(nodeid, pattern) for pattern in KNOWN)
