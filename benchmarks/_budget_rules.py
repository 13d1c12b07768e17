"""Where a sampled stack spent its time: the classification of ``budget``.

A profiler sample is a Python stack (root first, leaf last) of a peer's event-loop
thread.  :data:`RULES` is the one place that says which category a sample falls
in, as a table of (category, what it means, predicate on one frame):
:func:`classify` walks the stack from the leaf towards the root and stops at the
first frame that any rule matches, taking the first matching rule in table order.
Innermost wins because the categories nest: everything runs under the event
loop's ``Handle._run`` and every lci call under Dask's ``Comm.write``, so the
frame closest to the sample is the one that was paying for it.  Frames no rule
names are passed over: a sample in msgpack, pickle or ``distributed.protocol``
is serialization because the first named frame above it is ``to_frames`` or
``from_frames``.

C calls (``socket.send``, ``epoll.poll``) have no Python frame of their own: a
sample inside one has the calling line as its leaf.  That is why the syscall
rule looks at the source line of a frame (only C methods of sockets, selectors
and ``os`` are named there, so it can only match a leaf), and why ``wait`` is
"the leaf is the selector's ``poll()`` call": the loop asleep in ``epoll``.

How the categories become µs is :mod:`benchmarks.budget`'s business: only the
shares among user-space categories are taken from samples (see there).
"""

from __future__ import annotations

import linecache
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePath

__all__ = ["Frame", "Rule", "RULES", "CATEGORIES", "ON_CPU", "IN_USER", "WAIT", "SYSCALLS",
           "OTHER", "TORN", "classify", "tally"]


@dataclass(frozen=True)
class Frame:
    """One Python frame of a sample: ``function`` at ``path``:``line``."""

    function: str
    path: str
    line: int

    def within(self, *parts: str) -> bool:
        """Whether the file lies under the directories ``parts`` (in that
        order, anywhere in its path), e.g. ``within("distributed", "comm")``."""
        dirs = PurePath(self.path).parts[:-1]
        n = len(parts)
        return any(dirs[i:i + n] == parts for i in range(len(dirs) - n + 1))

    def named(self, filename: str) -> bool:
        return PurePath(self.path).name == filename

    @property
    def source(self) -> str:
        """The line being executed; empty if the file cannot be read, which
        includes a path that a torn ``--nonblocking`` read left garbled (a NUL
        byte in it makes ``os.stat`` raise ``ValueError``)."""
        if "\0" in self.path:
            return ""
        return linecache.getline(self.path, self.line)


#: C-level I/O on a line: a socket's method, or ``os`` I/O.
_IO_CALL = re.compile(
    r"\b(?:sock|_sock|socket)\.(?:send|sendall|sendmsg|recv|recv_into|recvmsg|recvmsg_into)\("
    r"|\bos\.(?:read|write|readv|writev)\("
)

#: epoll_ctl, as selectors.py calls its C epoll object (asyncio's ``_selector``
#: is a Python selector, whose frames come below).
_EPOLL_CTL = re.compile(r"\b_selector\.(?:register|modify|unregister)\(")


def _is_wait(f: Frame) -> bool:
    return f.named("selectors.py") and f.function.endswith("select") and ".poll(" in f.source


def _is_serialization(f: Frame) -> bool:
    return (f.within("distributed", "comm") and f.named("utils.py")
            and f.function.split(".")[0] in ("to_frames", "from_frames"))


def _is_syscall(f: Frame) -> bool:
    return (f.function == "ShmDevice._ring" or bool(_IO_CALL.search(f.source))
            or (f.named("selectors.py") and bool(_EPOLL_CTL.search(f.source))))


def _is_codec(f: Frame) -> bool:
    return f.within("dask_lcicomm", "parcel")


def _is_dask_comm(f: Frame) -> bool:
    return (f.within("distributed", "comm") or (f.within("tornado") and f.named("iostream.py"))
            or (f.within("benchmarks") and f.named("_floor_comm.py")))


def _is_event_loop(f: Frame) -> bool:
    return (f.within("asyncio") or f.named("selectors.py")
            or (f.within("tornado") and not f.named("iostream.py")))


@dataclass(frozen=True)
class Rule:
    category: str
    means: str
    matches: Callable[[Frame], bool]


WAIT = "wait"
SYSCALLS = "syscalls"
OTHER = "other"

#: Samples whose stack does not reach the process's entry frame (py-spy read
#: it while the thread ran, ``--nonblocking``, and lost its way towards the
#: root) and has no frame any rule matches: left out of every share.
TORN = "torn"

#: The classification, in priority order at one frame (see the module docstring).
RULES: tuple[Rule, ...] = (
    Rule(WAIT, "off CPU: the leaf is the event loop's selector in its epoll poll() call "
         "(asleep until the peer's message or doorbell arrives)", _is_wait),
    Rule("serialization", "distributed.comm.utils to_frames/from_frames and everything they "
         "call (msgpack, pickle, distributed.protocol)", _is_serialization),
    Rule(SYSCALLS, "the leaf's line is socket/selector/os I/O (send, sendmsg, recv, "
         "recv_into, recvmsg_into, epoll register/modify/unregister, os.read/write), or the "
         "shm doorbell ShmDevice._ring; measured as the kernel time from /proc, these samples "
         "only keep syscalls out of the user-time shares", _is_syscall),
    Rule("codec", "dask_lcicomm/parcel/ (wire, grouping, writer, reader): parcel encode/decode", _is_codec),
    Rule("lci", "the rest of dask_lcicomm: comm, vconn, parcelport, link, progress, providers",
         lambda f: f.within("dask_lcicomm")),
    Rule("dask comm", "distributed.comm other than to/from_frames, tornado's IOStream "
         "(the transport of tcp://), and floor://'s comm (benchmarks/_floor_comm.py)",
         _is_dask_comm),
    Rule("event loop", "asyncio (run_once, Handle._run, futures and tasks waking up), "
         "selectors, tornado's IOLoop on asyncio", _is_event_loop),
    Rule(OTHER, "the benchmark's own loop (benchmarks/), and any stack no rule matches",
         lambda f: f.within("benchmarks")),
)

#: Every category, in table order.
CATEGORIES: tuple[str, ...] = tuple(rule.category for rule in RULES)

#: The categories a process spends on CPU (all but ``wait``).
ON_CPU: tuple[str, ...] = tuple(c for c in CATEGORIES if c != WAIT)

#: The categories a process spends in user space (all but ``wait`` and ``syscalls``).
IN_USER: tuple[str, ...] = tuple(c for c in ON_CPU if c != SYSCALLS)


def classify(stack: Sequence[Frame]) -> str:
    """The category of one sample, ``stack`` ordered root first.

    A torn stack (its root is not a module's top level, where every thread
    starts) is still classified by the frames it has: they are the ones
    nearest the leaf, read first.  Torn samples are samples of a running
    thread, so leaving them all out would under-count the code that runs
    most; only those that no rule matches are :data:`TORN`.
    """
    for frame in reversed(stack):
        for rule in RULES:
            if rule.matches(frame):
                return rule.category
    return OTHER if stack and stack[0].function == "<module>" else TORN


def tally(samples: Iterable[tuple[Sequence[Frame], int]]) -> Counter[str]:
    """Sample counts by category, from ``(stack, count)`` pairs."""
    counts: Counter[str] = Counter()
    for stack, count in samples:
        counts[classify(stack)] += count
    return counts
