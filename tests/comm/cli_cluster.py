"""Dask clusters started from the command line, as a user would, for tests.

A scheduler and workers (each with its nanny) run as separate process groups
with their own log files; :class:`Procs` tears all of them down. Each may run
inside a simulated host (:mod:`dask_lcicomm.testing.netns`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
from distributed import Client

from dask_lcicomm.testing.netns import Host

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
        #: How each process ended on SIGTERM: its exit code, or None if it had to be killed.
        self.exits: dict[str, int | None] = {}

    def start(self, name: str, args: list[str], host: Host | None = None) -> subprocess.Popen:
        """Start ``args`` (inside ``host``'s network namespace if given)."""
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115  (closed in stop())
        proc = subprocess.Popen(
            host.command(args) if host is not None else args,
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

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """Stop everything; after a failure print every log first, so that
        pytest shows what the processes said next to the failure."""
        if kind is not None:
            print(self.logs())
        self.stop()

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
        self.exits = {name: proc.poll() for name, proc, _ in self.procs}
        for _, proc, log in self.procs:
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


def start_cluster(
    procs: Procs,
    protocol: str,
    scheduler_host: str,
    worker_hosts: list[str],
    netns: dict[str, Host] | None = None,
    by_interface: bool = False,
) -> str:
    """Start ``dask scheduler`` and one ``dask worker`` per entry of
    ``worker_hosts`` (each listening on that address, inside the simulated
    host of that address when ``netns`` names one); return the scheduler's
    address once every worker has registered.

    With ``by_interface`` each process is told the name of its simulated
    host's interface (``--interface``) instead of its address (``--host``),
    as on an HPC node where the fabric's interface has a known name."""
    netns = netns or {}

    def listen_on(host: str) -> list[str]:
        if by_interface:
            interface = netns[host].interface
            assert interface is not None, f"no simulated host with an interface at {host}"
            return ["--interface", interface]
        return ["--host", host]

    scheduler_file = procs.logdir / "scheduler.json"
    procs.start(
        "scheduler",
        [
            *_dask_command("scheduler"),
            "--protocol", protocol,
            *listen_on(scheduler_host),
            "--port", "0",
            "--no-dashboard",
            "--scheduler-file", str(scheduler_file),
        ],
        host=netns.get(scheduler_host),
    )
    address = _wait_for_scheduler_file(scheduler_file, procs)["address"]
    assert address.startswith(f"{protocol}://"), address
    for i, host in enumerate(worker_hosts):
        procs.start(
            f"worker{i}",
            [
                *_dask_command("worker"),
                address,
                "--nthreads", "1",
                "--no-dashboard",
                *listen_on(host),
                "--name", f"cli-worker-{i}",
                "--death-timeout", "60",
                "--local-directory", str(procs.logdir / f"worker{i}"),
            ],
            host=netns.get(host),
        )
    with Client(address, timeout=CALL_TIMEOUT) as client:
        try:
            client.wait_for_workers(len(worker_hosts), timeout=STARTUP_TIMEOUT)
        except Exception as e:
            procs.check_alive()
            raise AssertionError(f"workers did not register: {e!r}\n{procs.logs()}") from e
    return address


def workers_at(client: Client, protocol: str, host: str) -> list[str]:
    """The addresses of the workers that listen on ``host``."""
    return sorted(w for w in client.scheduler_info()["workers"] if w.startswith(f"{protocol}://{host}:"))


def move(client: Client, src: list[str], dst: list[str], nbytes: int) -> None:
    """An array made on ``src`` is summed on ``dst``, so its bytes cross from
    one to the other, and then gathered by the client."""
    x = client.submit(np.full, nbytes, 7, dtype="u1", workers=src, pure=False)
    total = client.submit(np.sum, x, workers=dst, allow_other_workers=False)
    assert total.result(timeout=CALL_TIMEOUT) == 7 * nbytes
    assert client.who_has([total])[total.key] == tuple(dst)
    gathered = x.result(timeout=CALL_TIMEOUT)
    assert gathered.nbytes == nbytes and int(gathered[-1]) == 7
