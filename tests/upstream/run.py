"""Run a named selection of distributed's own tests once per comm scheme and compare.

``python -m tests.upstream [--selection fast|full] [--scheme lci,tcp] [-k EXPR]``

Each scheme gets its own pytest process, started from the root of distributed's
unpacked source tree (its ``conftest.py`` and its pytest configuration apply,
and ``distributed`` imports from that tree) with the Python of a cached venv,
``.venv-upstream/``, that pins the same release and has this project installed
in editable mode, so the ``lci`` entry point resolves to the working tree. The
plugin ``lci_scheme`` makes the chosen scheme the default one. Results are
compared per test id from pytest's junit XML: a test that fails or errors over
a non-tcp scheme while it passes over tcp is a failure of that scheme, unless
``known.py`` lists it as hard-coding TCP. The exit status is 1 if there is such
a failure, 2 if a run produced no or partial results (crash, run timeout), else 0.

Each pytest process runs in a network namespace of its own that has only a
loopback interface (with the default routes pointing at it, so that Dask's
"which address reaches the outside" probe answers 127.0.0.1): distributed's
tests bind and connect to the machine's external address in places, and here
that address is loopback and nothing leaves the machine. Everything a run
starts is in one process group, which is killed when the run ends or overruns.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from . import known
from .selections import DISTRIBUTED_VERSION, REQUIREMENTS, SELECTIONS, Selection

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CACHE = REPO / ".venv-upstream"
# shared/ lies beside the repository, in CI too.
TARBALL = Path(
    os.environ.get(
        "DASK_UPSTREAM_TARBALL",
        REPO.parent / "shared" / "upstream" / f"distributed-{DISTRIBUTED_VERSION}.tar.gz",
    )
)
OURS = "ours:"
FAILED = ("failed", "error")
INSTALL_TIMEOUT = 1800
INTERRUPT_GRACE = 120

# Bring up loopback and route everything to it, then exec the command.
NETNS_PRELUDE = (
    "ip link set lo up && ip route add default dev lo && "
    '{ ip -6 route add default dev lo 2>/dev/null || true; } && exec "$@"'
)


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()


def _stamped(stamp: Path, digest: str) -> bool:
    return stamp.is_file() and stamp.read_text() == digest


def _run(cmd: list[str], timeout: float) -> None:
    logger.info("$ %s", " ".join(cmd))
    subprocess.run(cmd, check=True, timeout=timeout)


def venv_python() -> Path:
    return CACHE / "bin" / "python"


def ensure_venv(base_python: str, rebuild: bool) -> Path:
    """Create (once) the pinned venv and (re)install this project into it when
    its build inputs change; returns the venv's Python."""
    python = venv_python()
    version = subprocess.run(
        [base_python, "-c", "import sys; print(sys.version)"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    deps = _digest(json.dumps(REQUIREMENTS).encode(), version.encode())
    deps_stamp = CACHE / ".deps-stamp"
    if rebuild or not python.exists() or not _stamped(deps_stamp, deps):
        print(f"upstream: creating {CACHE} ({DISTRIBUTED_VERSION})", flush=True)
        shutil.rmtree(CACHE, ignore_errors=True)
        _run([base_python, "-m", "venv", str(CACHE)], 300)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, *REQUIREMENTS], INSTALL_TIMEOUT)
        deps_stamp.write_text(deps)

    # The package's Python is used live from the tree (editable); only its build
    # inputs (metadata, entry points, the C extension) need a reinstall.
    inputs = [REPO / "pyproject.toml", *sorted((REPO / "dask_lcicomm").rglob("*.c"))]
    project = _digest(*(p.read_bytes() for p in inputs))
    project_stamp = CACHE / ".project-stamp"
    if not _stamped(project_stamp, project):
        print("upstream: installing this project into the venv", flush=True)
        # Everything already installed stays as it is: the pins are the tested ones.
        constraints = CACHE / "constraints.txt"
        frozen = subprocess.run(
            [str(python), "-m", "pip", "freeze", "--exclude-editable", "--disable-pip-version-check"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        constraints.write_text(frozen)
        _run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "-c",
                str(constraints),
                "-e",
                str(REPO),
            ],
            INSTALL_TIMEOUT,
        )
        project_stamp.write_text(project)
    return python


def ensure_source(tarball: Path, python: Path, ours: list[str]) -> Path:
    """Unpack (once) distributed's source tree, the same release as the venv's
    wheel, and link our test modules ``ours`` into it under ``tests/upstream/``
    as in this repository, so that pytest names them with ids of that form and
    runs them under the same rootdir and configuration."""
    if not tarball.is_file():
        raise SystemExit(f"upstream: no source tarball at {tarball} (see --tarball)")
    root = CACHE / "src" / f"distributed-{DISTRIBUTED_VERSION}"
    stamp = root / ".unpacked-from"
    digest = _digest(tarball.read_bytes())
    if not _stamped(stamp, digest) or not (root / "distributed" / "_version.py").is_file():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        with tarfile.open(tarball) as tar:
            if hasattr(tarfile, "data_filter"):  # 3.10.12+, 3.11.4+
                tar.extractall(root, filter="data")
            else:
                tar.extractall(root)
        _match_wheel(root, python)
        stamp.write_text(digest)
    linked = root / "tests" / "upstream"
    linked.mkdir(parents=True, exist_ok=True)
    for name in ours:
        link = linked / name
        if not link.is_symlink():
            link.symlink_to(HERE / name)
    return root


def _match_wheel(root: Path, python: Path) -> None:
    """Tests import ``distributed`` from the tree (pytest puts the rootdir first on
    ``sys.path``, and spawned workers inherit it). Check that the tree's package is
    the wheel's, and give it the wheel's build-generated ``_version.py``, without
    which it calls itself version "unknown"."""
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    wheel = Path(purelib) / "distributed"
    tree = root / "distributed"
    shutil.copy2(wheel / "_version.py", tree / "_version.py")
    differ = [
        str(path.relative_to(wheel))
        for path in wheel.rglob("*.py")
        if not (tree / path.relative_to(wheel)).is_file()
        or (tree / path.relative_to(wheel)).read_bytes() != path.read_bytes()
    ]
    if differ:
        raise SystemExit(f"upstream: the source tree differs from the installed wheel in {differ[:10]}")


def netns_prefix() -> list[str]:
    """The command prefix that runs a command in a loopback-only network namespace."""
    unshare = ["unshare", "--net"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--net"]
    cmd = [*unshare, "sh", "-c", NETNS_PRELUDE, "sh"]
    probe = subprocess.run([*cmd, "true"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        raise SystemExit(
            "upstream: cannot make a loopback-only network namespace "
            f"({probe.stderr.strip()}); --no-netns runs without one"
        )
    return cmd


@dataclass
class Run:
    scheme: str
    junit: Path
    log: Path
    seconds: float = 0.0
    returncode: int | None = None
    timed_out: bool = False


def _tee(stream: IO[bytes], log: IO[bytes], quiet: bool) -> None:
    for line in iter(stream.readline, b""):
        log.write(line)
        if not quiet:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()


def _kill_group(pgid: int, grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def planned_run(name: str, scheme: str) -> Run:
    results = CACHE / "results"
    return Run(scheme, results / f"{name}-{scheme}.xml", results / f"{name}-{scheme}.log")


def run_pytest(
    python: Path,
    root: Path,
    scheme: str,
    name: str,
    selection: Selection,
    args: argparse.Namespace,
    prefix: list[str],
) -> Run:
    run = planned_run(name, scheme)
    run.junit.parent.mkdir(exist_ok=True)
    run.junit.unlink(missing_ok=True)
    paths = [f"tests/upstream/{p.removeprefix(OURS)}" if p.startswith(OURS) else p for p in selection.paths]
    cmd = [
        *prefix,
        str(python),
        "-m",
        "pytest",
        *paths,
        "-p",
        "lci_scheme",
        "-p",
        "no:cacheprovider",
        "-q",
        "--color=no",
        "-o",
        "junit_family=xunit1",
        "-o",
        "junit_logging=all",  # captured output and logs, of failing tests only:
        "-o",
        "junit_log_passing_tests=false",
        f"--junitxml={run.junit}",
        f"--timeout={args.timeout or selection.test_timeout}",
        "--timeout-method=signal",
        *selection.args,
    ]
    if args.k:
        cmd += ["-k", args.k]
    if args.jobs > 1:
        cmd += ["-n", str(args.jobs)]
    cmd += args.pytest_args
    env = dict(os.environ)
    env.update(
        DASK_DISTRIBUTED__COMM__DEFAULT_SCHEME=scheme,
        PYTHONPATH=str(HERE),
        VIRTUAL_ENV=str(CACHE),
        PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}",
    )
    print(f"\nupstream: {name} over {scheme}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    with run.log.open("wb", buffering=0) as log:
        proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert proc.stdout is not None
        tee = threading.Thread(target=_tee, args=(proc.stdout, log, args.quiet), daemon=True)
        tee.start()
        try:
            run.returncode = proc.wait(timeout=args.run_timeout or selection.run_timeout)
        except subprocess.TimeoutExpired:
            run.timed_out = True
            # pytest answers SIGINT by writing the results it has, then stopping.
            print(f"upstream: {scheme} run overran its time limit; interrupting it", flush=True)
            proc.send_signal(signal.SIGINT)
            try:
                run.returncode = proc.wait(timeout=INTERRUPT_GRACE)
            except subprocess.TimeoutExpired:
                pass
        finally:
            _kill_group(proc.pid)  # also whatever the tests left running
            proc.wait()
            tee.join(timeout=30)
    run.seconds = time.monotonic() - start
    return run


@dataclass
class Result:
    outcome: str  # passed, failed, error or skipped
    message: str = ""
    details: str = ""  # the traceback
    captured: str = ""  # what the test printed and logged

    def text(self) -> str:
        return f"{self.message}\n{self.details}\n{self.captured}"


def _nodeid(case: ET.Element) -> str:
    """The pytest node id of a junit (xunit1) test case."""
    classname, name, file = case.get("classname", ""), case.get("name", ""), case.get("file")
    if not file:
        return f"{classname}::{name}" if classname else name
    module = file.removesuffix(".py").replace("/", ".")
    if classname.startswith(module + "."):
        return f"{file}::{classname[len(module) + 1 :].replace('.', '::')}::{name}"
    return f"{file}::{name}"


def parse_junit(path: Path) -> dict[str, Result]:
    results: dict[str, Result] = {}
    for case in ET.parse(path).iter("testcase"):
        nodeid = _nodeid(case)
        result = Result("passed")
        for tag in ("skipped", "error", "failure"):  # the last one found wins
            child = case.find(tag)
            if child is not None:
                outcome = "failed" if tag == "failure" else tag
                result = Result(outcome, child.get("message", ""), child.text or "")
        result.captured = "\n".join(e.text or "" for e in case if e.tag in ("system-out", "system-err"))
        previous = results.get(nodeid)
        if previous is None or (result.outcome in FAILED and previous.outcome not in FAILED):
            results[nodeid] = result
    return results


def _counts(results: dict[str, Result]) -> Counter[str]:
    return Counter(r.outcome for r in results.values())


def _fd_leaks(results: dict[str, Result]) -> int:
    """How many tests distributed's ``--leaks=fds`` checker flagged."""
    return sum("leaking fds" in r.message for r in results.values())


def _first_line(text: str, width: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def _stack(details: str, limit: int = 40) -> str:
    """The frames (``file:line: in function``) and ``E`` lines of a pytest
    traceback: where it failed, without the source listings."""
    lines = [
        line
        for line in details.splitlines()
        if line.startswith(("E ", "failed on ")) or re.match(r"^\S+:\d+:", line)
    ]
    return "\n".join((["  ..."] if len(lines) > limit else []) + lines[-limit:]) or details[-2000:]


def report(runs: list[Run], name: str) -> int:
    """Print the comparison; returns the exit status."""
    print(f"\n==== upstream {name}: distributed {DISTRIBUTED_VERSION} ====")
    results: dict[str, dict[str, Result]] = {}
    status = 0
    print(
        f"{'scheme':8} {'passed':>7} {'failed':>7} {'error':>7} {'skipped':>8} "
        f"{'fd leaks':>9} {'time':>8}"
    )
    for run in runs:
        if run.junit.is_file():
            results[run.scheme] = parse_junit(run.junit)
            if run.timed_out:
                status = 2  # partial results: the selection did not run to its end
            c = _counts(results[run.scheme])
            print(
                f"{run.scheme:8} {c['passed']:7} {c['failed']:7} {c['error']:7} "
                f"{c['skipped']:8} {_fd_leaks(results[run.scheme]):9} {run.seconds:7.0f}s"
                + (" (overran its time limit)" if run.timed_out else "")
            )
        else:
            status = 2
            why = "overran its time limit" if run.timed_out else f"exit status {run.returncode}"
            print(f"{run.scheme:8} no results ({why}); see {run.log}")

    baseline = results.get("tcp")
    for scheme, res in results.items():
        if scheme == "tcp":
            continue
        failing = {i: r for i, r in res.items() if r.outcome in FAILED}
        if baseline is None:
            print(f"\n{scheme}: no tcp baseline, every failure counts as {scheme}-only")
        only = {
            i: r
            for i, r in failing.items()
            if baseline is None or i not in baseline or baseline[i].outcome == "passed"
        }
        expected = {i: k for i, r in only.items() if (k := known.lookup(i, r.text()))}
        unlisted = {i: r for i, r in only.items() if i not in expected}
        both = sorted(set(failing) - set(only))
        stale = sorted(i for i, r in res.items() if r.outcome == "passed" and known.listed(i))

        print(
            f"\n{scheme}-only failures (failed or errored on {scheme}, passed on tcp), "
            f"not explained by known.py: {len(unlisted)}"
        )
        for nodeid, r in sorted(unlisted.items()):
            note = " (listed in known.py, but failed another way)" if known.listed(nodeid) else ""
            print(f"  {r.outcome.upper():6} {nodeid}{note}\n         {_first_line(r.message)}")
        if expected:
            print(f"\n{scheme}-only failures of tests that hard-code TCP (known.py): {len(expected)}")
            for nodeid, k in sorted(expected.items()):
                print(
                    f"  {nodeid}\n"
                    + textwrap.fill(k.reason, 100, initial_indent=" " * 9, subsequent_indent=" " * 9)
                )
        if both:
            print(f"\nfailed on {scheme} and on tcp (not {scheme}-specific): {len(both)}")
            for nodeid in both:
                print(f"  {nodeid} (tcp: {baseline[nodeid].outcome if baseline else '-'})")
        if stale:
            print(f"\nlisted in known.py but passed on {scheme}: {len(stale)}")
            for nodeid in stale:
                print(f"  {nodeid}")
        if unlisted:
            status = status or 1
            print(f"\n---- details of the {scheme}-only failures ----")
            for nodeid, r in sorted(unlisted.items()):
                print(f"\n__ {nodeid} __\n{_stack(r.details)}")
                errors = [line for line in r.captured.splitlines() if " - ERROR - " in line]
                if errors:
                    print("logged errors:\n" + "\n".join(errors[:10]))

    verdict = {0: "ok", 1: "unlisted non-tcp failures", 2: "a run gave no or partial results"}[status]
    print(f"\nupstream {name}: exit status {status} ({verdict})")
    for scheme, res in results.items():
        c = _counts(res)
        print(
            f"upstream-{scheme}: {c['passed']} passed, {c['failed'] + c['error']} failed, "
            f"{c['skipped']} skipped"
        )
    return status


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.upstream",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after -- go to pytest.",
    )
    parser.add_argument("--selection", choices=sorted(SELECTIONS), default="fast")
    parser.add_argument(
        "--scheme", default="lci,tcp", help="comma-separated schemes, one pytest run each (default: lci,tcp)"
    )
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument("--jobs", type=int, default=1, help="pytest-xdist workers per run")
    parser.add_argument("--timeout", type=int, help="per-test timeout in s (default: the selection's)")
    parser.add_argument("--run-timeout", type=int, help="per-run limit in s (default: the selection's)")
    parser.add_argument("--tarball", type=Path, default=TARBALL)
    parser.add_argument("--python", default=sys.executable, help="interpreter to create the venv with")
    parser.add_argument("--rebuild", action="store_true", help="recreate the venv")
    parser.add_argument(
        "--no-netns", action="store_true", help="run without a loopback-only network namespace"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="compare the results of the last runs, run nothing"
    )
    parser.add_argument("--quiet", action="store_true", help="don't echo pytest's output (it is in the log)")
    parser.add_argument("pytest_args", nargs="*", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    args = parse_args(argv)
    schemes = [s.strip() for s in args.scheme.split(",") if s.strip()]
    selection = SELECTIONS[args.selection]
    if args.report_only:
        return report([planned_run(args.selection, scheme) for scheme in schemes], args.selection)
    python = ensure_venv(args.python, args.rebuild)
    ours = [p.removeprefix(OURS) for p in selection.paths if p.startswith(OURS)]
    root = ensure_source(args.tarball, python, ours)
    prefix = [] if args.no_netns else netns_prefix()
    try:
        runs = [
            run_pytest(python, root, scheme, args.selection, selection, args, prefix) for scheme in schemes
        ]
    except KeyboardInterrupt:
        print("upstream: interrupted", file=sys.stderr)
        return 130
    return report(runs, args.selection)
