"""The ``dask scheduler`` / ``dask worker`` command line tools over ``lci://``.

A scheduler and two workers (each with its nanny) run as separate
subprocesses, exactly as a user would start them, and clients connect to the
scheduler by its ``lci://`` address.  Only loopback (127.0.0.1) is used.

To check the test logic against Dask's reference backend, replace
``PROTOCOL = "lci"`` by ``"tcp"``.
"""

from __future__ import annotations

import functools
import json
import operator
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from distributed import Client
from distributed.comm import parse_address, parse_host_port

PROTOCOL = "lci"

HOST = "127.0.0.1"
STARTUP_TIMEOUT = 60  # scheduler file / workers registered
CALL_TIMEOUT = 60  # any single client call
STOP_TIMEOUT = 15  # SIGTERM -> exit, before SIGKILL


def _dask_command(sub: str) -> list[str]:
    """``dask scheduler`` / ``dask worker``, preferring the venv's entry point."""
    candidates = [os.path.join(os.path.dirname(sys.executable), "dask")]
    which = shutil.which("dask")
    if which:
        candidates.append(which)
    for exe in candidates:
        if os.path.isfile(exe) and os.access(exe, os.X_OK):
            return [exe, sub]
    return [sys.executable, "-m", f"distributed.cli.dask_{sub}"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # short connect timeouts: a broken comm fails instead of hanging
    env["DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT"] = "20s"
    return env


class Procs:
    """Subprocesses started by a test, with their log files."""

    def __init__(self, logdir):
        self.logdir = logdir
        self.procs: list[tuple[str, subprocess.Popen, object]] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(),
            # own process group: lets teardown reach the nanny's worker
            # process even if the CLI process itself has to be SIGKILLed
            start_new_session=True,
        )
        self.procs.append((name, proc, log))
        return proc

    def check_alive(self):
        for name, proc, _ in self.procs:
            if proc.poll() is not None:
                raise AssertionError(
                    f"{name} exited with {proc.returncode}\n{self.logs()}"
                )

    def logs(self, tail: int = 4000) -> str:
        out = []
        for name, _, log in self.procs:
            log.flush()
            try:
                text = (self.logdir / f"{name}.log").read_text(errors="replace")
            except OSError:
                text = ""
            out.append(f"----- {name} -----\n{text[-tail:]}")
        return "\n".join(out)

    def stop(self):
        # workers first (so they do not try to reconnect), then the scheduler
        workers = [p for n, p, _ in self.procs if n != "scheduler"]
        schedulers = [p for n, p, _ in self.procs if n == "scheduler"]
        for group in (workers, schedulers):
            for proc in group:
                if proc.poll() is None:
                    proc.terminate()
            for proc in group:
                try:
                    proc.wait(timeout=STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    pass
        for name, proc, log in self.procs:
            # the whole group: CLI process, nanny's worker process, ...
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
            log.close()


def _wait_for_scheduler_file(path, procs: Procs) -> dict:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        procs.check_alive()
        if path.exists():
            try:
                info = json.loads(path.read_text())
            except ValueError:
                info = None  # partially written
            if info and info.get("address"):
                return info
        if time.monotonic() > deadline:
            raise AssertionError(f"no scheduler file after {STARTUP_TIMEOUT}s\n{procs.logs()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory):
    """Scheduler + 2 workers started with the ``dask`` CLI on PROTOCOL."""
    tmp = tmp_path_factory.mktemp("lci_cli")
    scheduler_file = tmp / "scheduler.json"
    procs = Procs(tmp)
    try:
        procs.start(
            "scheduler",
            _dask_command("scheduler")
            + [
                "--protocol", PROTOCOL,
                "--host", HOST,
                "--port", "0",
                "--no-dashboard",
                "--scheduler-file", str(scheduler_file),
            ],
        )
        info = _wait_for_scheduler_file(scheduler_file, procs)
        address = info["address"]
        assert address.startswith(f"{PROTOCOL}://"), address

        for i in range(2):
            procs.start(
                f"worker{i}",
                _dask_command("worker")
                + [
                    address,
                    "--nthreads", "1",
                    "--no-dashboard",
                    "--host", HOST,
                    "--name", f"cli-worker-{i}",
                    "--death-timeout", "60",
                    "--local-directory", str(tmp / f"worker{i}"),
                ],
            )

        with Client(address, timeout=CALL_TIMEOUT) as client:
            try:
                client.wait_for_workers(2, timeout=STARTUP_TIMEOUT)
            except Exception as e:
                procs.check_alive()
                raise AssertionError(f"workers did not register: {e!r}\n{procs.logs()}")

        yield {
            "address": address,
            "scheduler_file": str(scheduler_file),
            "procs": procs,
        }
    finally:
        procs.stop()


# Only functions importable in the worker subprocesses: this test module is
# not on their sys.path, so functions defined here could not be unpickled.
inc = functools.partial(operator.add, 1)
double = functools.partial(operator.mul, 2)


def _check_workers(client, n=2):
    workers = client.scheduler_info()["workers"]
    assert len(workers) == n, list(workers)
    assert all(a.startswith(f"{PROTOCOL}://") for a in workers), list(workers)
    assert {w["name"] for w in workers.values()} == {f"cli-worker-{i}" for i in range(n)}
    return sorted(workers)


def _small_computation(client):
    a, b = _check_workers(client)
    futures = client.map(inc, range(100))
    assert client.gather(futures) == list(range(1, 101))
    total = client.submit(sum, futures)
    assert total.result(timeout=CALL_TIMEOUT) == sum(range(1, 101))

    # a result computed on one worker is consumed on the other
    x = client.submit(inc, 10, workers=[a], pure=False)
    y = client.submit(double, x, workers=[b], allow_other_workers=False, pure=False)
    assert y.result(timeout=CALL_TIMEOUT) == 22
    assert set(client.who_has([y])[y.key]) == {b}


def test_cli_scheduler_and_workers(cli_cluster):
    procs = cli_cluster["procs"]
    try:
        with Client(cli_cluster["address"], timeout=CALL_TIMEOUT) as client:
            assert client.scheduler.address.startswith(f"{PROTOCOL}://")
            client.wait_for_workers(2, timeout=STARTUP_TIMEOUT)
            _small_computation(client)

            import dask.array as da
            import numpy as np

            x = da.arange(1_000_000, chunks=100_000)
            assert client.compute(x.sum()).result(timeout=CALL_TIMEOUT) == np.arange(
                1_000_000
            ).sum()
    except BaseException:
        print(procs.logs())
        raise
    procs.check_alive()


def test_cli_client_direct_address(cli_cluster):
    procs = cli_cluster["procs"]
    # rebuild "lci://HOST:PORT" by hand, as a user would type it
    scheme, loc = parse_address(cli_cluster["address"])
    assert scheme == PROTOCOL
    host, port = parse_host_port(loc)
    assert host == HOST and port > 0
    address = f"{PROTOCOL}://{HOST}:{port}"
    try:
        with Client(address, timeout=CALL_TIMEOUT) as client:
            assert client.scheduler.address == address
            _small_computation(client)
        # and via the scheduler file
        with Client(
            scheduler_file=cli_cluster["scheduler_file"], timeout=CALL_TIMEOUT
        ) as client:
            assert client.scheduler.address == address
            _small_computation(client)
    except BaseException:
        print(procs.logs())
        raise
    procs.check_alive()
