"""Where a small-message round trip spends its time, by category, from py-spy samples and
``/proc`` CPU times of both ping-pong peers (method: docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import linecache
import math
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import psutil
from distributed.comm.utils import from_frames, to_frames

from benchmarks import _comm_peers as peers
from benchmarks import _runner
from benchmarks._contenders import Configuration
from benchmarks._floor_comm import SCHEME as FLOOR
from benchmarks._procs import PeerError, expect, send_quietly
from benchmarks._runner import Benchmark, Metric, Record, format_number, progress, size_name
from benchmarks.comm import PINNED, VARIANTS, started_pair

SIZES = (8, 2**10, 2**14)  # a tiny task message, a small object, a small array chunk
CONFIGURATIONS = (  # ucxx, lci-ucx and lci-ofi show as not installed where they are not
    Configuration("lci-shm", "lci"), replace(VARIANTS["poll-500us"], label="lci-shm-poll"),
    replace(VARIANTS["thread"], label="lci-shm-thread"), *PINNED.values(),
    *map(Configuration.of_scheme, ("tcp", "ucxx", FLOOR)))
ROLES = ("client", "server")
#: As (quick, full; ~3 minutes on 2 cores): per payload, seconds unprofiled, then under py-spy
#: at its rate, after warm-up round trips; rounds; the serialization timing's count and seconds.
_BUDGETS = ({"reference_s": 0.3, "window_s": 1.0, "rate_hz": 200, "warmup": 20},
            {"reference_s": 1.0, "window_s": 4.0, "rate_hz": 250, "warmup": 100})
_ROUNDS, _SERIALIZATION = (1, 2), ((200, 0.2), (5000, 1.0))
_SLACK_S = 60.0  # connecting, warming up, py-spy attaching: beyond a payload's windows
ROUND_TRIP = Metric("round_trip", "us/round trip, profiled", False)


@dataclass(frozen=True)
class Frame:
    function: str
    path: str
    line: int

    @property
    def source(self) -> str:
        """The line executed; empty if unreadable (a torn read's path may hold a NUL byte)."""
        return "" if "\0" in self.path else linecache.getline(self.path, self.line)


#: C-level I/O on a line: a socket's, ``os``'s, or epoll_ctl as selectors.py calls it.
_IO = re.compile(r"\b(?:sock|_sock|socket)\.(?:send|sendall|sendmsg|recv|recv_into|recvmsg|recvmsg_into)\("
                 r"|\bos\.(?:read|write|readv|writev)\(|\b_selector\.(?:register|modify|unregister)\(")
WAIT, SYSCALLS, TORN = "wait", "syscalls", "torn"
#: (category, its table row, frame predicate): the first frame from the leaf up that a rule matches decides.
RULES: tuple[tuple[str, str, Callable[[Frame], bool]], ...] = (
    (WAIT, "wait: neither process on CPU",
     lambda f: f.path.endswith("selectors.py") and f.function.endswith("select") and ".poll(" in f.source),
    ("serialization", "serialization (to/from_frames)",
     lambda f: f.path.endswith("/comm/utils.py") and f.function.startswith(("to_frames", "from_frames"))),
    (SYSCALLS, "syscalls and doorbells",
     lambda f: f.function == "ShmDevice._ring" or bool(_IO.search(f.source))),
    ("codec", "lci codec (parcel/)", lambda f: "/dask_lcicomm/parcel/" in f.path),
    ("lci", "lci layers (rest of dask_lcicomm)", lambda f: "/dask_lcicomm/" in f.path),
    ("dask comm", "Dask comm layer (+ tornado streams; floor's comm)",
     lambda f: "/distributed/comm/" in f.path or f.path.endswith(("/tornado/iostream.py", "_floor_comm.py"))),
    ("event loop", "event-loop hops",
     lambda f: "/asyncio/" in f.path or "/tornado/" in f.path or f.path.endswith("selectors.py")),
    ("other", "other on CPU (benchmark loop)", lambda f: "/benchmarks/" in f.path),
)
CATEGORIES = tuple(category for category, _, _ in RULES)
ROWS = (*(c for c in CATEGORIES if c != WAIT), WAIT)  # on CPU, then the wait: the table's order
IN_USER = tuple(c for c in ROWS if c not in (SYSCALLS, WAIT))
_ROW_NAMES = {category: row for category, row, _ in RULES}
_FRAME = re.compile(r"^(?P<function>.*) \((?P<path>.*?)(?::(?P<line>\d+))?\)$")
_THREAD = re.compile(r"^thread \((?P<tid>0x[0-9a-fA-F]+|\d+)\)(?:: (?P<name>.*))?$")


def classify(stack: Sequence[Frame]) -> str:
    """A sample's category, ``stack`` root first; ``torn`` (left out): unmatched, cut off from its root."""
    for frame in reversed(stack):
        for category, _, matches in RULES:
            if matches(frame):
                return category
    return "other" if stack and stack[0].function == "<module>" else TORN


def _comm_thread_stacks(raw: str, pid: int) -> list[tuple[tuple[Frame, ...], int]]:
    """The main (event-loop) thread's and lci progress threads' samples in py-spy's raw format,
    ``thread;frame;...;frame count`` (a frame's name may go on over lines on Python 3.13)."""
    stacks = []
    for sample in re.split(r"\n(?=thread \()", raw.strip()):
        frames, _, count = sample.rpartition(" ")
        thread, *names = frames.split(";")
        if (label := _THREAD.match(thread)) is None or not count.isdigit():
            continue
        stack = tuple(Frame(m["function"], m["path"], int(m["line"] or 0)) if (m := _FRAME.match(name))
                      else Frame(name, "", 0) for name in names)
        # From Python 3.11 a thread shows its OS id, the pid for the main thread; before,
        # --nonblocking shows its pthread id in hex, so the main thread goes by its name.
        tid = label["tid"]
        if (label["name"] == "MainThread" if tid.startswith("0x") else int(tid) == pid) or any(
                f.function.endswith("_main") and "/dask_lcicomm/progress/" in f.path for f in stack):
            stacks.append((stack, int(count)))
    return stacks


async def _client(conn: Connection, server: peers.Server, specs: list[peers.BenchSpec]) -> None:
    """Per payload: the comm benchmark's ping-pong, ``("looping", None)``, round trips until the parent's
    ``("stop",)`` (outlasting py-spy's recording), ``("result", loop)``; or ``("failed", why)``."""
    for spec in specs:
        msg = peers.make_message("ping", peers.make_payload(spec.payload_bytes))
        try:
            async with peers.connected_many(server, 1) as (comm,):
                await peers.ping(comm, msg, spec.warmup, math.inf)
                start = time.perf_counter()
                count = await peers.ping(comm, msg, spec.max_count, start + spec.duration_s)
                reference = peers.Measurement(count, time.perf_counter() - start)
                conn.send(("looping", None))
                events, stopped, count = asyncio.get_running_loop(), asyncio.Event(), 0
                events.add_reader(conn.fileno(), stopped.set)
                start = time.perf_counter()
                while not stopped.is_set():  # until the parent's "stop", or its end of the pipe closing
                    count += await peers.ping(comm, msg, 1, math.inf)
                profiled = peers.Measurement(count, time.perf_counter() - start)
                events.remove_reader(conn.fileno())
                conn.recv()  # the "stop" itself
        except Exception as exc:
            send_quietly(conn, ("failed", f"{spec.name}: {type(exc).__name__}: {exc}"))
            return  # the parent ends the round
        send_quietly(conn, ("result", {"reference": asdict(reference), "profiled": asdict(profiled),
                                       "provider": comm.extra_info.get("provider")}))


def run_round(budgets: dict[str, Any], c: Configuration, benches: list[Benchmark], index: int,
              record: Callable[[Record], None]) -> None:
    """Each payload's loop and recording on one fresh pair of peers; a failure ends the round."""
    specs = [b.spec for b in benches]

    def answers() -> Iterator[tuple[peers.BenchSpec, Any]]:
        with started_pair(c, specs, _client) as (server, client):
            procs = {"client": psutil.Process(client.process.pid),
                     "server": psutil.Process(server.process.pid)}
            for spec in specs:
                expect(client, "looping", spec.timeout_s)
                recording = _profile(procs, budgets["window_s"], budgets["rate_hz"])
                client.conn.send(("stop",))
                loop = expect(client, "result", spec.timeout_s)
                if loop["profiled"]["count"] == 0:
                    raise PeerError(f"{c.label}-client: no round trip in the profiled loop")
                yield spec, ("result", spec.name, (loop, recording))

    _runner.record_answers(c.label, index, specs, answers(), record, lambda spec, answer: (
        {ROUND_TRIP.key: answer[0]["profiled"]["seconds"] / answer[0]["profiled"]["count"] * 1e6},
        {"size": spec.payload_bytes, "loop": answer[0], "recording": answer[1]}))


def _profile(procs: dict[str, psutil.Process], window_s: float, rate_hz: int) -> dict[str, Any]:
    """py-spy on the peers for the window and their CPU time meanwhile (all of it, without py-spy)."""
    before = {role: (p.cpu_times(), p.num_ctx_switches()) for role, p in procs.items()}
    start, error, samples, dropped = time.monotonic(), None, {}, {}
    beside = Path(sys.executable).with_name("py-spy")  # in a venv's bin, else on PATH
    pyspy = str(beside) if beside.is_file() else "py-spy"
    try:
        with TemporaryDirectory(prefix="budget-") as tmp:
            spies = {role: subprocess.Popen(
                [pyspy, "record", "--format", "raw", "--rate", str(rate_hz), "--idle", "--threads",
                 "--nonblocking", "--full-filenames", "--duration", str(max(1, round(window_s))),
                 "--pid", str(p.pid), "--output", f"{tmp}/{role}"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for role, p in procs.items()}
            try:  # 30 s for attaching, writing and exiting
                logs = {role: spy.communicate(timeout=window_s + 30)[0] for role, spy in spies.items()}
            finally:
                for spy in spies.values():
                    spy.kill()
                    spy.wait()
            for role, p in procs.items():
                out, errors = Path(tmp, role), re.search(r"Errors: (\d+)", logs[role])
                stacks = _comm_thread_stacks(out.read_text(), p.pid) if out.is_file() else []
                if spies[role].returncode or not stacks:
                    why = [line for line in logs[role].splitlines() if line.startswith("Error")] or [""]
                    raise ChildProcessError(f"py-spy got no sample of the comm threads of pid {p.pid} "
                                            f"(exit {spies[role].returncode}) {why[0]}")
                samples[role] = dict(Counter(c for stack, n in stacks for c in [classify(stack)] * n))
                dropped[role] = int(errors[1]) if errors else 0
    except (OSError, subprocess.TimeoutExpired) as exc:  # py-spy missing, failed or hung
        time.sleep(max(0.0, window_s - (time.monotonic() - start)))
        error, samples, dropped = _runner.one_line(exc), {}, {}
    after = {role: (p.cpu_times(), p.num_ctx_switches()) for role, p in procs.items()}
    return {"samples": samples, "dropped": dropped,
            "user_s": {r: after[r][0].user - before[r][0].user for r in procs},
            "system_s": {r: after[r][0].system - before[r][0].system for r in procs},
            "preempted": {r: after[r][1].involuntary - before[r][1].involuntary for r in procs},
            "wall_s": time.monotonic() - start, "error": error}


async def _serialization(size: int, count: int, seconds: float) -> dict[str, float]:
    """Median µs of one ``to_frames`` and one ``from_frames`` of the ping-pong message, here."""
    msg, to_s, from_s = peers.make_message("ping", peers.make_payload(size)), [], []
    for _ in peers.bounded(count, time.perf_counter() + seconds):
        start = time.perf_counter()
        frames = await to_frames(msg, serializers=peers.SERIALIZERS, on_error="message")
        middle = time.perf_counter()
        await from_frames(frames)
        to_s.append(middle - start)
        from_s.append(time.perf_counter() - middle)
    to_us, from_us = statistics.median(to_s) * 1e6, statistics.median(from_s) * 1e6
    progress(f"{size_name(size)}: to_frames {to_us:.1f} us, from_frames {from_us:.1f} us")
    return {"to_frames_us": to_us, "from_frames_us": from_us, "per_round_trip_us": 2 * (to_us + from_us)}


def measure(configurations: Sequence[Configuration], sizes: Sequence[int], rounds: int,
            quick: bool) -> dict[str, Any]:
    """The serialization timing, then each configuration once per round, in rotating order: the JSON."""
    serialization = {size_name(size): asyncio.run(_serialization(size, *_SERIALIZATION[not quick]))
                     for size in sizes}
    budgets: dict[str, Any] = _BUDGETS[not quick]
    benches = [Benchmark(peers.BenchSpec(
        f"budget-{size_name(size)}", "pingpong", size, budgets["reference_s"], 10_000_000, budgets["warmup"],
        budgets["reference_s"] + budgets["window_s"] + _SLACK_S), (ROUND_TRIP,)) for size in sizes]
    result = _runner.run("budget", configurations, benches, rounds, quick, partial(run_round, budgets))
    result.environment["load_average_end"] = [round(load, 2) for load in psutil.getloadavg()]
    measured = [label for label, status in result.status.items() if status.available]

    def pooled(bench: Benchmark, label: str) -> dict[str, Any] | None:
        return _cell([r.raw for r in result.records
                      if r.values and (r.benchmark, r.configuration) == (bench.name, label)])

    return _runner.to_json(result, [], sizes=list(sizes), budgets=budgets, categories=list(ROWS)) | {
        "serialization": serialization,
        "budget": {size_name(b.spec.payload_bytes): {label: pooled(b, label) for label in measured}
                   for b in benches}}


def _cell(rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """µs per round trip by category, per role and for the pair, pooled over the measured rounds."""
    if not rounds:
        return None
    recs = [r["recording"] for r in rounds]
    rt_us, reference_us = (sum(r["loop"][k]["seconds"] for r in rounds) * 1e6
                           / sum(r["loop"][k]["count"] for r in rounds) for k in ("profiled", "reference"))
    trips = sum(rec["wall_s"] for rec in recs) / rt_us * 1e6
    user_us, system_us = ({role: sum(rec[key][role] for rec in recs) / trips * 1e6 for role in ROLES}
                          for key in ("user_s", "system_s"))
    profiled = [rec for rec in recs if rec["error"] is None]
    counts = {role: {c: sum(rec["samples"][role].get(c, 0) for rec in profiled) for c in CATEGORIES}
              for role in ROLES} if profiled else {}
    per_role = {role: {c: by[c] / max(sum(by[c] for c in IN_USER), 1) * user_us[role] for c in IN_USER}
                | {SYSCALLS: system_us[role], WAIT: rt_us - user_us[role] - system_us[role]}
                for role, by in counts.items()}
    return {
        "rt_us": rt_us, "reference_us": reference_us, "provider": rounds[0]["loop"]["provider"],
        "user_us": user_us, "system_us": system_us, "per_role": per_role,
        "pair": {c: sum(by[c] for by in per_role.values()) for c in CATEGORIES}
        | {WAIT: rt_us - sum(user_us.values()) - sum(system_us.values())} if per_role else {},
        "preempted": {role: sum(rec["preempted"][role] for rec in recs) / trips for role in ROLES},
        "sampled_cpu_us": {role: (1 - by[WAIT] / max(sum(by.values()), 1)) * rt_us
                           for role, by in counts.items()},
        "samples": {role: sum(by.values()) for role, by in counts.items()},
        "dropped": {role: sum(rec["dropped"][role] + rec["samples"][role].get(TORN, 0) for rec in profiled)
                    for role in counts},
    }


def format_table(data: dict[str, Any]) -> str:
    """Per payload: µs per round trip by category and configuration, the round trip, cross-checks."""
    status, env, budgets = data["status"], data["environment"], data["config"]["budgets"]
    names = [*(_ROW_NAMES[c] for c in ROWS), "round trip, profiled loop (= sum)", "round trip, unprofiled",
             "on CPU client/server, /proc", "on CPU client/server, py-spy",
             "preempted per round trip client/server", "provider"]

    def column(label: str, k: dict[str, Any] | None) -> list[str]:
        if k is None:
            return [status[label]["label"] if not status[label]["available"] else "error"] * len(names)
        return [*(format_number(k["pair"][c]) if k["pair"] else "no profile" for c in ROWS),
                format_number(k["rt_us"]), format_number(k["reference_us"]),
                " / ".join(format_number(k["user_us"][r] + k["system_us"][r]) for r in ROLES),
                " / ".join(map(format_number, k["sampled_cpu_us"].values())) or "no profile",
                " / ".join(f"{k['preempted'][r]:.2f}" for r in ROLES), k["provider"] or "-"]

    blocks = []
    for size, cells in data["budget"].items():
        ser = data["serialization"][size]
        rows = [[f"{size} payload, us per round trip", *status],
                *map(list, zip(names, *(column(label, cells.get(label)) for label in status), strict=True)),
                [f"serialization in-process: 2 x (to_frames {ser['to_frames_us']:.1f} + from_frames "
                 f"{ser['from_frames_us']:.1f})", *[format_number(ser["per_round_trip_us"])] * len(status)]]
        blocks.append("\n".join(_runner.align(rows, 1, (1, 1 + len(ROWS), len(rows) - 1))))
    start, end = (", ".join(f"{x:g}" for x in env[key]) for key in ("load_average", "load_average_end"))
    return "\n\n".join([*blocks, "\n".join([
        f"{budgets['reference_s']:g} s unprofiled, then {budgets['window_s']:g} s under py-spy at "
        f"{budgets['rate_hz']} Hz per payload, {data['config']['rounds']} round(s) pooled; rows add both "
        f"processes (how to read them: docs/benchmarks.md). {env['cpu']}, {env['cpu_count']} CPUs, load "
        f"{start} at the start, {end} at the end; distributed {env['distributed']}; code {env['source']}.",
        *(f"{label}: {s['label']}: {s['detail']}" for label, s in status.items() if not s["available"]),
        *(f"{r['configuration']} {r['benchmark'].removeprefix('budget-')} round {r['round'] + 1}: "
          + (f"failed: {r['error']}" if r["error"] else f"no profile: {r['recording']['error']}")
          for r in data["raw"] if r["error"] or r["recording"]["error"]),
    ])])


def main(argv: list[str] | None = None) -> int:
    labels, sizes = [c.label for c in CONFIGURATIONS], {size_name(s): s for s in SIZES}
    p = _runner.parser("budget", __doc__, (), "2 pooled, quick: 1", baseline=False)
    p.add_argument("--configs", type=_runner.subset(labels), metavar="NAMES", help=f"of: {','.join(labels)}")
    p.add_argument("--sizes", type=_runner.subset(sizes), metavar="SIZES", help=f"of: {','.join(sizes)}")
    args = p.parse_args(argv)
    chosen = [CONFIGURATIONS[labels.index(n)] for n in args.configs or labels]
    rounds = args.rounds or _ROUNDS[not args.quick]
    data = measure(chosen, [sizes[n] for n in args.sizes or sizes], rounds, args.quick)
    return _runner.finish(args, format_table(data), data)
