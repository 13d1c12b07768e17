"""The contenders of a run: a scheme with Dask settings for its processes (for ``--baseline``,
another build), and whether each can run, known before any round, so that a missing extra or a
rejected setting shows as a labelled column instead of failing every round."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._comm_peers import server_main
from benchmarks._procs import PeerError, expect, report_origin, spawned

#: The package a baseline build replaces in its processes.
PACKAGE = "dask_lcicomm"

#: The label of lci as built elsewhere (``--baseline``).
BASELINE_BUILD = "lci@baseline"

#: Seconds a child may take to import everything and come up.
STARTUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Configuration:
    """``scheme`` with ``dask_config`` set in each process, which imports from ``pythonpath``
    first; ``provider`` pins lci to one fabric (a silent fallback would put tcp's numbers under
    this label); without the module ``requires`` it is "not installed"."""

    label: str
    scheme: str
    dask_config: tuple[tuple[str, Any], ...] = ()
    pythonpath: str | None = None
    provider: str | None = None
    requires: str | None = None

    @classmethod
    def of_scheme(cls, scheme: str) -> Configuration:
        return cls(scheme, scheme)

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.dask_config)


def with_baseline(configurations: Sequence[Configuration], path: str | None) -> list[Configuration]:
    """``configurations`` plus lci as built in ``path`` right after plain lci."""
    result = list(configurations)
    if path is None:
        return result
    directory = Path(path).resolve()
    if not (directory / PACKAGE / "__init__.py").is_file():
        raise ValueError(f"baseline {path}: no {PACKAGE} package in it (make one with "
                         f"pip install --no-deps --target {path} <checkout>)")
    labels = [c.label for c in result]
    result.insert(labels.index("lci") + 1 if "lci" in labels else len(result),
                  Configuration(BASELINE_BUILD, "lci", pythonpath=str(directory)))
    return result


@dataclass(frozen=True)
class Status:
    """Whether a contender can run; ``label`` is shown in its cells."""

    available: bool
    label: str
    detail: str = ""


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _installed(c: Configuration) -> Status:
    """Its backend loads and its extra is there (looked up, not imported: a fabric's bindings
    may start a runtime on import)."""
    from distributed.comm.registry import get_backend

    if c.scheme != "inproc":
        try:
            get_backend(c.scheme)
        except ValueError:
            return Status(False, "not installed", f"no backend registered for {c.scheme}://")
        except Exception as exc:
            return Status(False, "unavailable", f"backend failed to load: {one_line(exc)}")
    try:
        found = c.requires is None or importlib.util.find_spec(c.requires) is not None
    except (ImportError, ValueError):
        found = False
    return Status(True, "ok") if found else Status(
        False, "not installed", f"no module {c.requires} (its extra is missing)")


def probe(configurations: Sequence[Configuration]) -> dict[str, Status]:
    """Each contender's status before any round: installed, and, with overrides or another
    build, a comm server of it comes up listening, and a child imports :data:`PACKAGE` from
    its ``pythonpath``."""
    status = {c.label: _installed(c) for c in configurations}
    started = [c for c in configurations if (c.dask_config or c.pythonpath)
               and status[c.label].available]
    with ExitStack() as stack:
        children = {c.label: (stack.enter_context(spawned(
            server_main, c.scheme, name=f"{c.label}-probe", dask_config=c.overrides,
            pythonpath=c.pythonpath)), c.pythonpath and stack.enter_context(spawned(
                report_origin, PACKAGE, name=f"{c.label}-origin", pythonpath=c.pythonpath)))
            for c in started}
        for c in started:
            peer, origin = children[c.label]
            try:
                expect(peer, "ready", STARTUP_TIMEOUT_S)
                if origin and c.pythonpath:
                    where = Path(expect(origin, "origin", STARTUP_TIMEOUT_S)).resolve().parent
                    if not where.is_relative_to(Path(c.pythonpath).resolve()):
                        raise PeerError(f"{PACKAGE} imported from {where}, not {c.pythonpath}")
                    status[c.label] = Status(True, "ok", f"{PACKAGE} from {where}")
            except PeerError as exc:
                status[c.label] = Status(False, "unavailable", f"rejected at start-up: {exc}")
    return status
