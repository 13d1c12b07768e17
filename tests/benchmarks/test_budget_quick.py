"""Smoke test for ``python -m benchmarks budget --quick``.

Runs the real CLI once (see :mod:`_cli`) and checks what the budget promises:
every configuration present (ucxx, lci-ucx and lci-ofi measured or marked not
installed), every
payload budgeted, each process's categories adding up to the measured round
trip, the pair's categories plus the wait too, serialization positive both as
sampled and as timed in-process, the table and the figures.  Behaviour, not
speed: no timing assertions.
"""

from __future__ import annotations

from typing import Any

import pytest
from _cli import assert_figures, run_cli

MEASURED = ("lci-shm", "lci-shm-poll", "lci-shm-thread", "lci-tcp", "tcp", "floor")
#: Measured where their extra or library is installed, else marked "not installed".
OPTIONAL = ("ucxx", "lci-ucx", "lci-ofi")
SIZES = ("8B", "1KiB", "16KiB")

#: How far a sum of categories may be from the round trip (float rounding only:
#: the categories share out the round trip by construction).
REL_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "budget.json"
    return run_cli(["budget", "--quick"], out, timeout_s=120) | {"out": out}


def test_exit_status(quick_run: dict[str, Any]) -> None:
    proc = quick_run["proc"]
    assert proc.returncode == 0, proc.stderr


def test_every_configuration_present(quick_run: dict[str, Any]) -> None:
    data = quick_run["data"]
    assert set(data["status"]) == {*MEASURED, *OPTIONAL}
    for label in MEASURED:
        assert data["status"][label]["available"], data["status"][label]
    for label in OPTIONAL:
        status = data["status"][label]
        assert status["available"] or status["label"] == "not installed", status
    for size in SIZES:
        assert {*MEASURED} <= set(data["budget"][size]), size


def _skip_unless_measured(data: dict[str, Any], label: str) -> None:
    if not data["status"][label]["available"]:
        pytest.skip(f"{label} not installed (checked by test_every_configuration_present)")


@pytest.mark.parametrize("label", [*MEASURED, *OPTIONAL])
@pytest.mark.parametrize("size", SIZES)
def test_budget_adds_up(quick_run: dict[str, Any], size: str, label: str) -> None:
    """Per process the categories (wait included) make the round trip; so do
    the pair's on-CPU categories plus the wait of neither."""
    data = quick_run["data"]
    _skip_unless_measured(data, label)
    budget = data["budget"][size][label]
    assert budget is not None, f"{label} {size} has no measured round"
    rt = budget["rt_us"]
    assert rt > 0 and budget["reference_us"] > 0
    for role in ("client", "server"):
        assert set(budget["per_role"][role]) == set(data["config"]["categories"])
        assert sum(budget["per_role"][role].values()) == pytest.approx(rt, rel=REL_TOLERANCE)
        cpu = budget["user_us"][role] + budget["system_us"][role]
        assert 0 < cpu <= rt * 1.05, (role, cpu, rt)
        assert budget["samples"][role] > 0
    assert sum(budget["pair"].values()) == pytest.approx(rt, rel=REL_TOLERANCE)
    on_cpu = {k: v for k, v in budget["pair"].items() if k != "wait"}
    assert all(v >= 0 for v in on_cpu.values()), on_cpu


@pytest.mark.parametrize("label", MEASURED)
def test_serialization_sampled(quick_run: dict[str, Any], label: str) -> None:
    """The serialization rule finds Dask's to/from_frames in the samples. Per
    payload it is a few percent of a one-second window, which a loaded
    machine's sampler can miss; all three missing it is what would show a broken rule."""
    budget = quick_run["data"]["budget"]
    assert sum(budget[size][label]["pair"]["serialization"] for size in SIZES) > 0


def test_floor_spends_nothing_in_lci(quick_run: dict[str, Any]) -> None:
    """floor:// is Dask's serialization over asyncio streams: its comm code
    counts as a comm layer (found at some payload: like serialization, one
    payload's window can miss it on a loaded machine), and no sample of it
    lands in lci's rows at any payload."""
    budgets = {size: quick_run["data"]["budget"][size]["floor"] for size in SIZES}
    seen = {size: (b["pair"]["dask comm"], b["samples"], b["dropped"]) for size, b in budgets.items()}
    assert sum(b["pair"]["dask comm"] for b in budgets.values()) > 0, seen
    for b in budgets.values():
        assert b["pair"]["codec"] == 0 and b["pair"]["lci"] == 0, b["pair"]


@pytest.mark.parametrize("label, provider", [
    ("lci-shm", "shm"), ("lci-shm-poll", "shm"), ("lci-shm-thread", "shm"), ("lci-tcp", "tcp"),
    ("lci-ucx", "ucx"), ("lci-ofi", "ofi"),
])
def test_lci_used_its_providers(quick_run: dict[str, Any], label: str, provider: str) -> None:
    _skip_unless_measured(quick_run["data"], label)
    for size in SIZES:
        assert quick_run["data"]["budget"][size][label]["provider"] == provider


def test_serialization_timed_in_process(quick_run: dict[str, Any]) -> None:
    for size in SIZES:
        cost = quick_run["data"]["serialization"][size]
        assert cost["to_frames_us"] > 0 and cost["from_frames_us"] > 0
        assert cost["per_round_trip_us"] == pytest.approx(
            2 * (cost["to_frames_us"] + cost["from_frames_us"]))


def test_table_printed(quick_run: dict[str, Any]) -> None:
    stdout = quick_run["proc"].stdout
    for size in SIZES:
        assert f"{size} payload, us per round trip" in stdout
    for row in ("serialization (to/from_frames)", "event-loop hops", "syscalls and doorbells",
                "wait: neither process on CPU", "round trip, profiled loop",
                "serialization in-process"):
        assert row in stdout, row


def test_figures_drawn(quick_run: dict[str, Any]) -> None:
    assert_figures(quick_run["out"].parent / "figures", {f"budget-{s}.png" for s in SIZES})
