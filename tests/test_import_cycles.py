"""No import cycles in the project, at two levels, counting imports inside functions too (a cycle that only a lazy
import keeps from failing is still a cycle in the design): between single modules anywhere (library, Prefect
tasks, flows, benchmarks), and between the units of tests/test_layers.py (the library's packages, tasks, flows),
whose floor order that file checks. Both read imports with test_layers' `imports`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.test_layers import PACKAGES, ROOT, imports, modules, unit


def _modules() -> dict[str, Path]:
    mods = modules()
    for path in (ROOT / "bench").glob("*.py"):  # scripts that import each other from their own directory
        mods[path.stem] = path
    return mods


def import_graph(mods: dict[str, Path], node: Callable[[str], str | None]) -> dict[str, set[str]]:
    """The import graph of `mods` ({module: path}) between nodes: `node(module)` names the node a module belongs
    to (itself, or its unit), None for a module outside the graph (torch, the standard library). Every module of
    `mods` is in the graph; a node's imports of itself are left out."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        mine = node(name)
        found = imports(name, path.name == "__init__.py", path.read_text(), set(mods))
        graph.setdefault(mine, set()).update(n for _, t in found if (n := node(t)) is not None and n != mine)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan): every cycle, each named by its nodes."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules():
    mods = _modules()
    graph = import_graph(mods, lambda m: m if m in mods else None)
    assert len(graph) > 50 and "longstraw.parallel" in graph["longstraw"]  # the walk found the project
    assert _cycles(graph) == []


def test_no_import_cycles_between_packages():
    graph = import_graph(modules(), lambda m: unit(m) if m.split(".")[0] in PACKAGES else None)
    assert {"longstraw.engine", "longstraw.train", "tasks", "flows"} <= set(graph)
    assert "longstraw.engine" in graph["longstraw.train"] and "tasks" in graph["flows"]  # edges between units
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_cycle_between_packages_is_found_where_modules_have_none(tmp_path):
    """Two packages importing each other through different modules: no module cycle, a package cycle."""
    files = {"longstraw.engine.a": "from ..train import b\n", "longstraw.train.b": "import torch\n",
             "longstraw.train.c": "from ..engine import d\n", "longstraw.engine.d": "import os\n"}
    mods = {}
    for name, text in files.items():
        (path := tmp_path / f"{name}.py").write_text(text)
        mods[name] = path
    assert _cycles(import_graph(mods, lambda m: m if m in mods else None)) == []
    packages = import_graph(mods, lambda m: unit(m) if m.split(".")[0] in PACKAGES else None)
    assert _cycles(packages) == [["longstraw.engine", "longstraw.train"]]
