"""The contenders of a run: a :class:`Configuration` is a scheme plus Dask
configuration overrides for its peer processes (and, for ``--baseline``,
another build of the backend), under a unique label; :func:`probe_configurations`
says which of them can run before any round starts, so that a missing extra
or a rejected setting shows as a labelled column instead of failing every
round."""

from __future__ import annotations

import importlib.util
import json
import os
import urllib.parse
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distributed.comm.registry import get_backend

from benchmarks._comm_peers import server_main
from benchmarks._environment import PACKAGE, one_line, source_revision
from benchmarks._procs import Peer, PeerError, expect, report_origin, spawned

#: Seconds a peer process may take to import everything and start listening.
STARTUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Configuration:
    """One contender: ``scheme`` with ``dask_config`` (dotted keys) set in
    each of its peer processes, which look for modules in ``pythonpath``
    first if one is given (another build of the backend, see
    :func:`baseline_build`).

    ``label`` identifies it in rounds, tables and JSON, so it must be unique
    within a run.  The overrides are a tuple of pairs to keep the object
    hashable and their order (as shown) stable.

    ``provider`` pins an lci configuration to one fabric: every comm its
    peers open, and every link of its idle cluster, must run over it, or the
    benchmark fails -- lci falls back to tcp when a provider cannot be used,
    and a silent fallback would put tcp's numbers under this label.
    ``requires`` is a module (an extra's) without which the configuration
    shows as "not installed" instead of running.
    """

    label: str
    scheme: str
    dask_config: tuple[tuple[str, Any], ...] = ()
    pythonpath: str | None = None
    provider: str | None = None
    requires: str | None = None

    @classmethod
    def of_scheme(cls, scheme: str) -> Configuration:
        """A scheme as it comes, labelled with its own name."""
        return cls(scheme, scheme)

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.dask_config)


#: The label of lci as built elsewhere (``--baseline``).
BASELINE_BUILD = "lci@baseline"


def baseline_build(path: str | os.PathLike[str]) -> Configuration:
    """``lci`` without overrides, all of whose processes import
    :data:`PACKAGE` from ``path``: a directory holding another build of it,
    as ``pip install --no-deps --target PATH <checkout>`` makes one.  Raises
    :class:`ValueError` if ``path`` holds no such package (a user error)."""
    directory = Path(path).resolve()
    if not (directory / PACKAGE / "__init__.py").is_file():
        raise ValueError(f"baseline {path}: no {PACKAGE} package in it (make one with "
                         f"pip install --no-deps --target {path} <checkout>)")
    return Configuration(BASELINE_BUILD, "lci", pythonpath=str(directory))


def with_baseline_build(
    configurations: Sequence[Configuration], path: str | os.PathLike[str] | None
) -> list[Configuration]:
    """``configurations`` plus :func:`baseline_build` of ``path`` right after
    the plain lci one (last if there is none); unchanged without ``path``."""
    result = list(configurations)
    if path is None:
        return result
    labels = [c.label for c in result]
    result.insert(labels.index("lci") + 1 if "lci" in labels else len(result),
                  baseline_build(path))
    return result


@dataclass(frozen=True)
class SchemeStatus:
    """Whether a scheme can be benchmarked; ``label`` is shown in its cells."""

    available: bool
    label: str
    detail: str = ""


def probe_scheme(scheme: str) -> SchemeStatus:
    """Check that a backend is registered and loads, without any networking.

    Missing optional backends (e.g. ``ucxx`` without ``distributed_ucxx``)
    must degrade to a labelled column rather than abort the whole run.
    """
    try:
        get_backend(scheme)
    except ValueError:
        return SchemeStatus(False, "not installed", f"no backend registered for {scheme}://")
    except Exception as exc:  # registered, but its module is broken/incomplete
        return SchemeStatus(False, "unavailable", f"backend failed to load: {one_line(exc)}")
    return SchemeStatus(True, "ok")


def _installed(configuration: Configuration) -> SchemeStatus:
    """Its scheme loads (:func:`probe_scheme`) and the module it
    ``requires`` is there -- looked up, not imported: a fabric's bindings
    may start a runtime on import, which the harness has no use for."""
    status = probe_scheme(configuration.scheme)
    module = configuration.requires
    if status.available and module:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # its parent package missing, or broken
            found = False
        if not found:
            return SchemeStatus(False, "not installed", f"no module {module} (its extra is missing)")
    return status


def probe_configurations(configurations: Sequence[Configuration]) -> dict[str, SchemeStatus]:
    """The status of each configuration, by label.

    What a configuration needs must be installed (:func:`_installed`); a
    configuration with Dask overrides must also be accepted where it
    matters, at start-up in a process of its own: a server peer with the
    overrides has to come up listening.
    A setting the backend rejects (a provider it does not ship) thus marks
    its configuration "unavailable" before the run instead of failing every
    round.  A configuration with a ``pythonpath`` (another build) must also
    come up, and a child of it must report :data:`PACKAGE` imported from
    there (:func:`_build_status`).  The children start all at once, so
    probing costs one start-up.
    """
    status = {c.label: _installed(c) for c in configurations}
    to_start = [c for c in configurations
                if (c.dask_config or c.pythonpath) and status[c.label].available]
    with ExitStack() as stack:
        servers = {
            c.label: stack.enter_context(spawned(server_main, c.scheme, name=f"{c.label}-probe",
                                                 dask_config=c.overrides,
                                                 pythonpath=c.pythonpath))
            for c in to_start
        }
        builds = {
            c.label: (c.pythonpath, stack.enter_context(
                spawned(report_origin, PACKAGE, name=f"{c.label}-origin", pythonpath=c.pythonpath)))
            for c in to_start if c.pythonpath
        }
        for label, server in servers.items():
            try:
                await_server(server)
            except PeerError as exc:
                status[label] = SchemeStatus(False, "unavailable", f"rejected at start-up: {exc}")
        for label, (path, child) in builds.items():
            if status[label].available:
                status[label] = _build_status(path, child)
    return status


def _build_status(path: str, child: Peer) -> SchemeStatus:
    """Available if ``child`` (started with ``path`` first on its module
    path) imported :data:`PACKAGE` from ``path``; the detail says from where,
    and what the build was made of."""
    try:
        origin = Path(expect(child, "origin", STARTUP_TIMEOUT_S)).resolve().parent
    except PeerError as exc:
        return SchemeStatus(False, "unavailable", f"no {PACKAGE} from {path}: {exc}")
    if not origin.is_relative_to(Path(path).resolve()):
        return SchemeStatus(False, "unavailable", f"{PACKAGE} imported from {origin}, not {path}")
    source = _build_source(path)
    return SchemeStatus(True, "ok", f"{PACKAGE} from {origin}" + (f" ({source})" if source else ""))


def _build_source(path: str) -> str | None:
    """The checkout ``pip install --target path`` built from, as its record
    says, at its current revision (if it is a git work tree still)."""
    for record in sorted(Path(path).glob(f"{PACKAGE.replace('_', '?')}-*.dist-info/direct_url.json")):
        try:
            url = json.loads(record.read_text())["url"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not url.startswith("file://"):
            return f"built from {url}"
        checkout = urllib.parse.unquote(url.removeprefix("file://"))
        revision = source_revision(checkout) if os.path.isdir(checkout) else "unknown"
        return f"built from {checkout}, now at {revision}"
    return None


def await_server(server: Peer) -> str:
    """Return the server's contact address once it listens."""
    return expect(server, "ready", STARTUP_TIMEOUT_S)
