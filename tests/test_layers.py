"""Floor order: the library's packages stand on floors, and a module imports only from its own package or from
lower floors, counting imports inside functions (a lazy import that runs up is still a dependency running up).
The library never imports the pipeline (tasks, flows) or its services (Prefect, MLflow). test_import_cycles.py
checks for cycles, between single modules and between these units, with this file's `imports`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("longstraw", "tasks", "flows")

# bottom first; a unit is a package or module of longstraw ("longstraw" alone: its __init__, the public API), or
# tasks / flows; a floor's units import nothing of each other
FLOORS: list[tuple[tuple[str, ...], str]] = [
    (("longstraw.files", "longstraw.version", "longstraw.memory", "longstraw.lora",
      "longstraw.named", "longstraw.errors"),
     "leaves: file I/O, the version, device memory queries, PEFT adapters, user code named in a config, the kinds "
     "of failure"),
    (("longstraw.data",), "tokenised examples read from files; no model"),
    (("longstraw.problems",), "the built-in tasks, made of data"),
    (("longstraw.grpo",), "GRPO's loss, advantages and rewards: tensors and problems, no model"),
    (("longstraw.state",), "the prefix state: pure data, no kernel"),
    (("longstraw.parallel",), "process groups, collectives, sharding: tensors and modules, no model class"),
    (("longstraw.ops",), "the kernels; their split variants run parallel's collectives"),
    (("longstraw.segment",), "runs each mixing primitive over a prefix view of the state with its op"),
    (("longstraw.models",), "the families, built from the segment's primitives"),
    (("longstraw.engine",), "capture, replay and the prompt backward of any model"),
    (("longstraw.rollout",), "sampling answers on top of a captured state, with the engine"),
    (("longstraw.sampler",), "the sampler protocol over rollout"),
    (("longstraw.agents",), "multi-turn branches: environments and tools, and the multi-turn rollout over sampler"),
    (("longstraw.store",), "the content-addressed store of files"),
    (("longstraw.sharded_state",), "prefix states saved per rank into the store"),
    (("longstraw.config",), "the run config: engine, GRPO and model settings"),
    (("longstraw.train",), "the training worker over everything below"),
    (("longstraw.tools",), "the planner, state size and rehearsal: read the models, the engine and train"),
    (("longstraw.cli",), "the library's commands"),
    (("longstraw",), "the public API, re-exported"),
    (("tasks",), "the pipeline's Prefect tasks and MLflow tracking, over the library"),
    (("flows",), "the Prefect flows and the full CLI, over the tasks"),
]
# what no module of the library imports: the pipeline's services
LIBRARY_NEVER = ("prefect", "mlflow")


def floor_of() -> dict[str, int]:
    return {unit: i for i, (units, _) in enumerate(FLOORS) for unit in units}


def unit(module: str) -> str:
    """longstraw.models.common.moe -> longstraw.models; tasks.stages -> tasks."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "longstraw" else parts[0]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, is_package: bool, source: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) of every import in `source` (module `name`), relative ones resolved; `from a
    import b` counts as a.b where that is a module in `known`."""
    package = name if is_package else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in known else base) for a in node.names]
    return sorted(set(out))  # `from a import b, c` counts once where b and c are not modules


def violations(sources: dict[str, tuple[str, bool, str]]) -> list[str]:
    """Every import against the floors in `sources` ({module: (path shown, is a package, source)}): one line
    each, naming the module, the line and what it imports."""
    floors, out = floor_of(), []
    for name, (shown, is_package, source) in sorted(sources.items()):
        mine = unit(name)
        if mine not in floors:
            out.append(f"{shown}: {mine} is on no floor: add it to FLOORS in tests/test_layers.py, with why it sits "
                       "there")
            continue
        for line, target in imports(name, is_package, source, set(sources)):
            top = target.split(".")[0]
            if mine.startswith("longstraw") and top in LIBRARY_NEVER:
                out.append(f"{shown}:{line} imports {target}: the library never imports {', '.join(LIBRARY_NEVER)} "
                           "(the pipeline's services: tasks/ and flows/ use them)")
            if top not in PACKAGES or unit(target) == mine:
                continue
            theirs = unit(target)
            if theirs not in floors:
                continue  # reported as that module's own violation
            if floors[theirs] >= floors[mine]:
                out.append(f"{shown}:{line} imports {target}: {mine} (floor {floors[mine]}: {FLOORS[floors[mine]][1]}) "
                           f"may not import {theirs} (floor {floors[theirs]}), which sits on or above it")
    return out


def _project() -> dict[str, tuple[str, bool, str]]:
    return {name: (str(path.relative_to(ROOT)), path.name == "__init__.py", path.read_text())
            for name, path in modules().items()}


def test_floor_order():
    sources = _project()
    assert len(sources) > 50 and "longstraw.parallel.experts" in sources  # the walk found the project
    bad = violations(sources)
    assert not bad, "imports against the floor order (tests/test_layers.py's FLOORS):\n" + "\n".join(bad)


def test_every_floor_unit_exists():
    known = {unit(name) for name in modules()}
    assert set(floor_of()) <= known, f"FLOORS names units that no longer exist: {set(floor_of()) - known}"


def test_an_import_running_up_is_named():
    sources = {
        "longstraw.parallel.experts": ("longstraw/parallel/experts.py", False,
                                       "def f():\n    from ..models.common.moe import Experts\n"),
        "longstraw.models.common.moe": ("longstraw/models/common/moe.py", False, "import torch\n"),
        "longstraw.ops.attention": ("longstraw/ops/attention.py", False, "import mlflow\nfrom ..parallel import x\n"),
    }
    assert violations(sources) == [
        "longstraw/ops/attention.py:1 imports mlflow: the library never imports prefect, mlflow (the pipeline's "
        "services: tasks/ and flows/ use them)",
        "longstraw/parallel/experts.py:2 imports longstraw.models.common.moe: longstraw.parallel (floor 5: process "
        "groups, collectives, sharding: tensors and modules, no model class) may not import longstraw.models "
        "(floor 8), which sits on or above it",
    ]
