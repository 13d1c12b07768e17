"""Training on a real (in-process) Dask cluster, models moving worker to
worker over lci:// and tcp://. Each result is checked against what the same
exchange must compute: the all-reduces against centralised mini-batch SGD,
asap against the discrete-event simulation of the same state machines
(NOTIFY-ACK reduces exactly the round-r models, whatever the timing)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
from distributed import Client, LocalCluster, get_worker

from dask_lcicomm.asap import runtime
from dask_lcicomm.asap.client import train
from dask_lcicomm.asap.graphs import choose_graph
from dask_lcicomm.asap.modes import make_exchange
from dask_lcicomm.asap.pacing import Pacing
from dask_lcicomm.asap.protocol import Kind, Message
from dask_lcicomm.asap.simulate import simulate
from dask_lcicomm.asap.synthetic import SparseLogReg

N = 4
ROUNDS = 12
PROBLEM = SparseLogReg(n_features=1024, nworkers=N, samples_per_worker=128, n_test=256, nnz=8)


@pytest.fixture(scope="module", params=["lci", "tcp"])
def client(request):
    before = {t.ident for t in threading.enumerate()}
    with LocalCluster(protocol=request.param, n_workers=N, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as c:
        yield c
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _new_threads(before):
        time.sleep(0.1)
    assert not _new_threads(before)


def _new_threads(before: set[int | None]) -> list[str]:
    """Threads started since ``before``, except Dask's process-wide offload
    executor, which lives for the whole process by design."""
    return [t.name for t in threading.enumerate()
            if t.ident not in before and not t.name.startswith("Dask-Offload")]


def centralised_sgd(rounds: int) -> np.ndarray:
    w = PROBLEM.init_model()
    for r in range(rounds):
        w = np.mean([PROBLEM.local_step(w, rank, r) for rank in range(N)], axis=0)
    return w


@pytest.mark.parametrize("mode", ["bsp", "bsp-ring"])
def test_all_reduces_match_centralised_sgd(client, mode):
    report = train(client, PROBLEM, mode=mode, rounds=ROUNDS, time_limit_s=60, start_delay_s=0.5)
    expected = PROBLEM.loss(centralised_sgd(ROUNDS))
    assert [w.rounds for w in report.workers] == [ROUNDS] * N
    for w in report.workers:
        assert w.final_loss == pytest.approx(expected, rel=1e-9)
        assert len(w.curve) == ROUNDS + 1 and not w.timed_out
    assert report.max_iteration_gap() <= 1
    # payload per round: every model to every peer, or 2(n-1)/n of a model per worker;
    # on top of it each message carries a header of a few hundred bytes
    model_bytes = PROBLEM.init_model().nbytes
    payload = N * (N - 1) * model_bytes if mode == "bsp" else 2 * (N - 1) * model_bytes
    messages = N * (N - 1) * (1 if mode == "bsp" else 2)
    assert sum(w.messages_sent for w in report.workers) == messages * ROUNDS
    assert payload * ROUNDS < report.bytes_sent <= (payload + 512 * messages) * ROUNDS


def test_asap_matches_the_simulated_state_machines(client):
    graph = choose_graph(N, 2)
    report = train(client, PROBLEM, mode="asap", graph=graph, rounds=ROUNDS, time_limit_s=60,
                   pacing=Pacing(0.002, 5.0, transient=True), start_delay_s=0.5)
    sim = simulate([make_exchange("asap", graph, r) for r in range(N)], [PROBLEM.init_model()] * N,
                   ROUNDS, step=lambda rank, r, w: PROBLEM.local_step(w, rank, r))
    for w in report.workers:
        assert w.final_loss == pytest.approx(PROBLEM.loss(sim.models[w.rank]), rel=1e-9)
        assert w.max_staleness == 0
        assert w.bytes_sent >= ROUNDS * graph.degree * PROBLEM.init_model().nbytes
    assert report.max_iteration_gap() <= graph.diameter
    assert report.graph == graph.name and report.spectral_gap == graph.spectral_gap


def test_async_runs_without_waiting_for_peers(client):
    report = train(client, PROBLEM, mode="async", rounds=ROUNDS, time_limit_s=60,
                   pacing=Pacing(0.01, 10.0, straggler=0), start_delay_s=0.5)
    assert all(w.rounds == ROUNDS for w in report.workers)
    fast = [w for w in report.workers if w.rank != 0]
    assert max(w.elapsed_s for w in fast) < report.workers[0].elapsed_s
    assert all(w.wait_s < 0.5 * report.workers[0].step_s for w in fast)


def test_time_limit_stops_every_worker(client):
    report = train(client, PROBLEM, mode="asap", rounds=10_000, time_limit_s=1.5,
                   pacing=Pacing(0.01), start_delay_s=0.5)
    assert all(w.timed_out and 0 < w.rounds < 10_000 for w in report.workers)
    assert all(w.elapsed_s < 10 for w in report.workers)


@dataclass(frozen=True)
class FailingStep(SparseLogReg):
    """Rank 1 fails in round 3."""

    def local_step(self, model, rank, round):
        if rank == 1 and round == 3:
            raise ArithmeticError("step failed")
        return super().local_step(model, rank, round)


def test_a_failing_worker_aborts_the_run_instead_of_waiting_out_the_limit(client):
    failing = FailingStep(**vars(PROBLEM))
    started = time.monotonic()
    with pytest.raises(ArithmeticError, match="step failed"):
        train(client, failing, mode="bsp", rounds=1000, time_limit_s=120, pacing=Pacing(0.005),
              start_delay_s=0.5)
    assert time.monotonic() - started < 30
    assert runtime._RUNS == {}


def test_runs_are_removed_from_the_workers(client):
    train(client, PROBLEM, mode="asap", rounds=2, time_limit_s=30, start_delay_s=0.5)
    assert runtime._RUNS == {}


def test_bad_arguments(client):
    with pytest.raises(ValueError):
        train(client, PROBLEM, mode="bulk")
    with pytest.raises(ValueError):
        train(client, PROBLEM, graph=choose_graph(N + 1, 2))



@dataclass(frozen=True)
class InjectsBadAck(SparseLogReg):
    """In round 2, rank 0 receives an ACK nobody sent it."""

    def local_step(self, model, rank, round):
        if rank == 0 and round == 2:
            address = get_worker().address
            for (_, where), run in list(runtime._RUNS.items()):
                if where == address:
                    run.loop.call_soon_threadsafe(run.deliver, 1, Message(Kind.ACK, 99))
        return super().local_step(model, rank, round)


def test_a_protocol_violation_fails_the_run_at_once(client):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="unexpected ACK"):
        train(client, InjectsBadAck(**vars(PROBLEM)), mode="asap", rounds=1000, time_limit_s=120,
              pacing=Pacing(0.005), start_delay_s=0.5)
    assert time.monotonic() - started < 30
    assert runtime._RUNS == {}
