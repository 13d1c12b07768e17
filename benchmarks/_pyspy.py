"""Sampling the peers from outside with py-spy, and reading what it wrote.

py-spy reads a process's Python stacks from outside without touching its
code, so the peers run exactly what the comm benchmark runs.  ``--idle``
keeps the samples of a thread asleep in a system call (the event loop in
epoll); they carry no mark of being idle, so :mod:`benchmarks._budget_rules`
tells them by their stack.  ``--nonblocking`` reads the stacks without
stopping the process: the default (a pause per sample) stretched an 8 B round
trip by a third on a 2-core machine, and put twice the in-process
serialization time into the serialization samples.

What the samples are good for, as measured here: on a process that never
sleeps they split its time among code paths within a percent or two; on one
that sleeps and wakes thousands of times a second they fall mostly on the
sleeping and the system calls, and find it on CPU at half the rate ``/proc``
does.  So :mod:`benchmarks.budget` takes time on CPU from ``/proc`` and only
the shares among user-space code paths from here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

from benchmarks._budget_rules import Frame

__all__ = ["ProfilerError", "Profile", "find_pyspy", "record"]

#: Seconds py-spy may take beyond its recording to attach, write and exit.
_EXIT_SLACK_S = 30.0

_FRAME = re.compile(r"^(?P<function>.*) \((?P<path>.*?)(?::(?P<line>\d+))?\)$")
_THREAD = re.compile(r"^thread \((?P<tid>0x[0-9a-fA-F]+|\d+)\)(?:: (?P<name>.*))?$")
_COUNTS = re.compile(r"Samples: (?P<samples>\d+) Errors: (?P<errors>\d+)")

#: What ``threading`` names a process's main thread.
_MAIN_THREAD = "MainThread"


class ProfilerError(RuntimeError):
    """py-spy is missing, could not attach, or failed: the reason, for the tables."""


@dataclass(frozen=True)
class Profile:
    """The samples of one process's event-loop thread and lci progress
    threads: ``(stack, count)`` pairs, stacks root first; ``errors`` are
    samples py-spy had to drop."""

    stacks: tuple[tuple[tuple[Frame, ...], int], ...]
    errors: int

    @property
    def samples(self) -> int:
        return sum(count for _, count in self.stacks)


def find_pyspy() -> str:
    """The py-spy next to this interpreter (a venv's ``bin``), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.is_file() else shutil.which("py-spy")
    if found is None:
        raise ProfilerError("py-spy not found (pip install py-spy, or the 'test' extra)")
    return found


def record(pids: Mapping[str, int], duration_s: float, rate_hz: int) -> dict[str, Profile]:
    """Sample every process of ``pids`` (by role) at once for ``duration_s``."""
    pyspy = find_pyspy()
    with TemporaryDirectory(prefix="budget-") as tmp:
        outputs = {role: Path(tmp, f"{role}.txt") for role in pids}
        procs = {
            role: subprocess.Popen(
                [pyspy, "record", "--format", "raw", "--rate", str(rate_hz), "--idle",
                 "--threads", "--full-filenames", "--nonblocking", "--pid", str(pid),
                 "--duration", str(max(1, round(duration_s))), "--output", str(outputs[role])],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for role, pid in pids.items()
        }
        try:
            logs = {role: proc.communicate(timeout=duration_s + _EXIT_SLACK_S)[1]
                    for role, proc in procs.items()}
        except subprocess.TimeoutExpired as exc:
            raise ProfilerError(f"py-spy did not finish within {exc.timeout:g} s") from exc
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return {role: _read(outputs[role], pids[role], procs[role].returncode, logs[role])
                for role in pids}


def _read(path: Path, pid: int, returncode: int | None, log: str) -> Profile:
    if returncode != 0 or not path.is_file():
        lines = [line for line in log.splitlines() if line.strip()]
        raise ProfilerError(f"py-spy could not sample pid {pid} (exit {returncode}): "
                            f"{lines[-1] if lines else 'no output'}")
    counts = _COUNTS.search(log)
    stacks = tuple(_comm_thread_stacks(path.read_text(), pid))
    if not stacks:
        raise ProfilerError(f"py-spy recorded no sample of the main thread of pid {pid}")
    return Profile(stacks, int(counts["errors"]) if counts else 0)


def _comm_thread_stacks(raw: str, pid: int) -> list[tuple[tuple[Frame, ...], int]]:
    """The stacks of the threads that carry the comm, from py-spy's raw format
    (``thread;frame;...;frame count``): the main thread (the event loop's, see
    :func:`_is_main_thread`) and lci's progress threads (``progress=thread``);
    helper threads that block for the harness are left out. A frame whose
    name holds a line break (seen on Python 3.13) continues its sample on the
    next line; a sample that still ends in no count is left out."""
    samples: list[str] = []
    for line in raw.splitlines():
        if line.startswith("thread (") or not samples:
            samples.append(line)
        else:
            samples[-1] += "\n" + line
    stacks = []
    for sample in samples:
        frames, _, count = sample.rpartition(" ")
        thread, *names = frames.split(";")
        label = _THREAD.match(thread)
        if label is None or not count.isdigit():
            continue
        stack = tuple(_frame(name) for name in names)
        if _is_main_thread(label, pid) or any(_is_progress_thread(f) for f in stack):
            stacks.append((stack, int(count)))
    return stacks


def _is_main_thread(label: re.Match[str], pid: int) -> bool:
    """A thread labelled with its OS thread id is the main thread if that is
    the pid.  py-spy reads that id from the thread state of Python 3.11 and
    later; before, it must stop the process to find it, which
    ``--nonblocking`` rules out, so it labels threads with their pthread id
    (hex, never the pid), and the main thread is told by its name."""
    tid = label["tid"]
    return label["name"] == _MAIN_THREAD if tid.startswith("0x") else int(tid) == pid


def _is_progress_thread(frame: Frame) -> bool:
    """The bottom frames of an lci progress thread run its engine's ``_main``."""
    return frame.function.endswith("_main") and frame.within("dask_lcicomm", "progress")


def _frame(name: str) -> Frame:
    match = _FRAME.match(name)
    if match is None:
        return Frame(name, "", 0)
    return Frame(match["function"], match["path"], int(match["line"] or 0))
