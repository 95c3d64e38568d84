"""No import cycles anywhere in the project (library, Prefect tasks, flows, benchmarks), counting imports inside
functions too: a cycle that only a lazy import keeps from failing is still a cycle in the design."""

from __future__ import annotations

from pathlib import Path

from tests.test_layers import ROOT, imports, modules


def _modules() -> dict[str, Path]:
    mods = modules()
    for path in (ROOT / "bench").glob("*.py"):  # scripts that import each other from their own directory
        mods[path.stem] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project's modules that `name` imports (test_layers' reading of its imports)."""
    found = imports(name, path.name == "__init__.py", path.read_text(), set(mods))
    return {t for _, t in found if t in mods and t != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert len(graph) > 50 and graph["longstraw"]  # the walk found the project
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
