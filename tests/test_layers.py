"""Layers know only what is below them: no module of the package (or of the
benchmarks beside it) imports one that imports it back, counting every import
statement (``TYPE_CHECKING`` blocks and imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import dask_lcicomm

PACKAGE = Path(dask_lcicomm.__file__).parent
BENCHMARKS = PACKAGE.parent / "benchmarks"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, by any statement."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # "from pkg import mod" imports the module pkg.mod where there is one.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    paths = sorted(root.rglob("*.py"))
    modules = {_module_name(path) for path in paths}
    return {_module_name(path): _imports(path, modules) for path in paths}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_one_that_imports_it_back():
    graph = _graph()
    assert "dask_lcicomm.parcelport" in graph["dask_lcicomm.comm.listener"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_no_benchmark_module_imports_one_that_imports_it_back():
    graph = _graph(BENCHMARKS)
    assert "benchmarks._runner" in graph["benchmarks.comm"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_only_the_registry_names_providers():
    """The parcelport, channels and the comm layer reach fabrics only
    through the registry: a new fabric is a new module, nothing else."""
    graph = _graph()
    interface = {f"dask_lcicomm.providers.{name}" for name in ("registry", "base", "send_queue")}
    concrete = {name for name in graph if name.startswith("dask_lcicomm.providers.")} - interface
    assert {"dask_lcicomm.providers.tcp", "dask_lcicomm.providers.ucx_options"} <= concrete
    for name, imported in graph.items():
        if not name.startswith("dask_lcicomm.providers"):
            assert not imported & concrete, f"{name} imports {imported & concrete}"


def test_the_configuration_is_the_bottom_layer():
    """Providers declare and validate their own options: the configuration
    module imports nothing of the package, no provider above all."""
    assert _graph()["dask_lcicomm.config"] == set()


def test_the_codec_is_layered():
    """Within the codec each module imports only those below it: the wire
    format, the grouping policy on it, the writer on both; the reader needs the
    wire format alone. None imports the package itself."""
    graph = _graph()
    below = {
        "wire": set(),
        "grouping": {"wire"},
        "writer": {"wire", "grouping"},
        "reader": {"wire"},
    }
    for module, allowed in below.items():
        imported = {name.removeprefix("dask_lcicomm.parcel").lstrip(".") or "(the package)"
                    for name in graph[f"dask_lcicomm.parcel.{module}"]
                    if name == "dask_lcicomm.parcel" or name.startswith("dask_lcicomm.parcel.")}
        assert imported <= allowed, f"parcel.{module} imports {sorted(imported - allowed)}"
