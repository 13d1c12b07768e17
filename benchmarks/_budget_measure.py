"""The measuring side of ``budget``: peers, profiles and the serialization
cross-check, as raw numbers; :mod:`benchmarks.budget` turns them into µs.

A configuration's round is one server and one client process (the comm
benchmark's, see :mod:`benchmarks._budget_peers`) doing every payload in
turn; while the client loops on a payload, both processes are sampled with
py-spy and their CPU time is read from ``/proc`` over the same seconds.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from time import monotonic, perf_counter

import psutil
from distributed.comm.utils import from_frames, to_frames

from benchmarks._budget_peers import LoopResult, client_main
from benchmarks._budget_rules import tally
from benchmarks._comm_peers import (
    SERIALIZERS,
    BenchSpec,
    Server,
    bounded,
    make_message,
    make_payload,
    server_main,
)
from benchmarks._comm_suite import size_name
from benchmarks._configurations import STARTUP_TIMEOUT_S, Configuration
from benchmarks._procs import Peer, PeerError, expect, receive, spawned
from benchmarks._pyspy import Profile, ProfilerError, record

__all__ = ["ROLES", "Budgets", "Recording", "RoundResult", "measure_round", "serialization_us"]

#: The two peers, as the profiles and CPU times are keyed.
ROLES = ("client", "server")

#: Seconds for connecting, warming up and py-spy's attaching and exiting,
#: beyond a payload's two windows, before its loop counts as hung.
_SLACK_S = 60.0


@dataclass(frozen=True)
class Budgets:
    """How long each payload is measured: ``reference_s`` unprofiled, then
    ``window_s`` under py-spy at ``rate_hz``; ``warmup`` untimed round trips."""

    reference_s: float
    window_s: float
    rate_hz: int
    warmup: int


@dataclass(frozen=True)
class Recording:
    """What was seen of the peers during one loop: each peer's CPU time in
    user space and in the kernel and the times it was preempted (involuntary
    context switches, ``/proc``) over ``wall_s`` seconds, and the
    profile's sample counts by category per role with the samples py-spy
    dropped; or, in ``error``, why there is no profile (round trips and CPU
    times count)."""

    samples: dict[str, dict[str, int]] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    user_s: dict[str, float] = field(default_factory=dict)
    system_s: dict[str, float] = field(default_factory=dict)
    preempted: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class RoundResult:
    """One payload size, one configuration (by label), one round: the round
    trips and their recording, or in ``error`` why there are none."""

    size: int
    label: str
    round: int
    loop: LoopResult | None = None
    recording: Recording = field(default_factory=Recording)
    error: str | None = None


def _spec(size: int, budgets: Budgets) -> BenchSpec:
    return BenchSpec(name=f"budget-{size_name(size)}", kind="pingpong", payload_bytes=size,
                     duration_s=budgets.reference_s, max_count=10_000_000,
                     warmup=budgets.warmup,
                     timeout_s=budgets.reference_s + budgets.window_s + _SLACK_S)


def measure_round(configuration: Configuration, sizes: tuple[int, ...], budgets: Budgets,
                  round_index: int, on_result: Callable[[RoundResult], None]) -> None:
    """Every payload of ``sizes`` on one fresh pair of peers; a failure ends
    the round (what the client and parent say to each other is then out of
    step) and marks the payloads not measured yet."""
    label = configuration.label
    done = 0
    try:
        with (
            spawned(server_main, configuration.scheme, name=f"{label}-server",
                    dask_config=configuration.overrides) as server,
            spawned(client_main, name=f"{label}-client",
                    dask_config=configuration.overrides) as client,
        ):
            specs = [_spec(size, budgets) for size in sizes]
            address = expect(server, "ready", STARTUP_TIMEOUT_S)
            client.conn.send((Server(address, configuration.provider), specs))
            pids = {role: _pid(peer) for role, peer in zip(ROLES, (client, server), strict=True)}
            for spec in specs:
                on_result(_measure_size(client, pids, spec, budgets, label, round_index))
                done += 1
    except PeerError as exc:
        for size in sizes[done:]:
            on_result(RoundResult(size, label, round_index, error=str(exc)))


def _pid(peer: Peer) -> int:
    pid = peer.process.pid
    assert pid is not None, "a started process has a pid"
    return pid


def _answer(client: Peer, kind: str, spec: BenchSpec) -> object:
    """The payload of the client's next ``(kind, name, payload)`` report on ``spec``."""
    got, name, payload = receive(client, spec.timeout_s)
    if got != kind or name != spec.name:
        raise PeerError(f"{client.process.name}: {name}: {payload}" if got == "failed"
                        else f"{client.process.name} sent {got} {name}, not {kind} {spec.name}")
    return payload


def _measure_size(client: Peer, pids: dict[str, int], spec: BenchSpec, budgets: Budgets,
                  label: str, round_index: int) -> RoundResult:
    """Profile both peers while the client loops on ``spec``, then stop it."""
    _answer(client, "looping", spec)
    recording = _profile(pids, budgets)
    client.conn.send(("stop",))
    loop = _answer(client, "result", spec)
    assert isinstance(loop, LoopResult)
    if loop.profiled.count == 0:
        raise PeerError(f"{client.process.name}: no round trip in the profiled loop")
    return RoundResult(spec.payload_bytes, label, round_index, loop=loop, recording=recording)


def _profile(pids: dict[str, int], budgets: Budgets) -> Recording:
    """py-spy on every peer for the window, and their CPU time meanwhile;
    without a profile, the window is still waited out, so that the round
    trips and CPU times cover as long a loop as with one."""
    procs = {role: psutil.Process(pid) for role, pid in pids.items()}
    before = {role: (proc.cpu_times(), proc.num_ctx_switches()) for role, proc in procs.items()}
    start = monotonic()
    profiles: dict[str, Profile] = {}
    error: str | None = None
    try:
        profiles = record(pids, budgets.window_s, budgets.rate_hz)
    except ProfilerError as exc:
        time.sleep(max(0.0, budgets.window_s - (monotonic() - start)))
        error = str(exc)
    after = {role: (proc.cpu_times(), proc.num_ctx_switches()) for role, proc in procs.items()}
    return Recording(
        samples={role: dict(tally(p.stacks)) for role, p in profiles.items()},
        dropped={role: p.errors for role, p in profiles.items()},
        user_s={role: after[role][0].user - before[role][0].user for role in procs},
        system_s={role: after[role][0].system - before[role][0].system for role in procs},
        preempted={role: after[role][1].involuntary - before[role][1].involuntary
                   for role in procs},
        wall_s=monotonic() - start,
        error=error,
    )


def serialization_us(size: int, max_count: int, duration_s: float) -> tuple[float, float]:
    """Median µs of one ``to_frames`` and one ``from_frames`` of the ping-pong
    message of ``size`` bytes, in this process, as the comms call them."""
    return asyncio.run(_serialization_us(size, max_count, duration_s))


async def _serialization_us(size: int, max_count: int, duration_s: float) -> tuple[float, float]:
    msg = make_message("ping", make_payload(size))
    to_s, from_s = [], []
    for _ in bounded(max_count, perf_counter() + duration_s):
        start = perf_counter()
        frames = await to_frames(msg, serializers=SERIALIZERS, on_error="message")
        middle = perf_counter()
        await from_frames(frames)
        to_s.append(middle - start)
        from_s.append(perf_counter() - middle)
    return statistics.median(to_s) * 1e6, statistics.median(from_s) * 1e6
