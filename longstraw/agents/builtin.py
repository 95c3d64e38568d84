"""The built-in environments (a run config's `agent.env` by name) and the resolution of `agent.env` / `agent.tools`
to an environment factory and its tool registry, for built-in names and "module:function" alike.

`record-lookup` (the task of longstraw/problems/record_lookup.py): a turn with a tool call is answered by the tool
results alone; a turn without one is the final answer. The reward is shaped (`RecordLookup`): 1.0 only for the
exact value, partial credit for the id looked up and the answer's digits, so that GRPO has a signal before the
model gets either right.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..grpo.rewards import digit_overlap
from ..problems import record_lookup
from .environment import EnvironmentFactory, Feedback, Turn, load_environment_factory
from .tools import ToolError, ToolRegistry


@dataclass(frozen=True)
class BuiltinEnv:
    """A built-in environment: its factory `make(example) -> Environment`, the tools it brings, and
    `demonstration(example) -> [text of each model turn]`, a solving conversation's turns (the SFT warm start
    learns them, the environment's and tools' answers in between)."""

    make: EnvironmentFactory
    tools: ToolRegistry
    description: str = ""
    demonstration: Callable[[dict], list[str]] | None = None


def tool_call_text(name: str, arguments: dict) -> str:
    """A call as the model writes it: Qwen3's `<tool_call>` JSON block (what chat.parse_tool_calls reads)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


# ---- record-lookup ---------------------------------------------------------------------------------------------

def _lookup(id: str) -> str:  # noqa: A002 - the argument's name is what the model writes
    try:
        return record_lookup.record_value(id)
    except KeyError as e:
        raise ToolError(e.args[0]) from None  # the model reads one line naming the bad id


def record_lookup_tools() -> ToolRegistry:
    """The `lookup(id)` tool, with the schema the task's prompt lists (record_lookup.TOOL)."""
    tools = ToolRegistry()
    fn = record_lookup.TOOL["function"]
    tools.register(_lookup, name=fn["name"], description=fn["description"], parameters=fn["parameters"])
    return tools


def _overlap(got: str, want: str) -> float:
    """The share of positions where `got` has `want`'s character, over the longer of the two."""
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1)


class RecordLookup:
    """One branch of a record-lookup example, its reward shaped so that a group whose calls and answers are all
    somewhat wrong still has a gradient: a tool turn scores half the best id overlap of its lookups so far (the
    share of the asked id's characters in place: copying the id is the first skill); the first turn without a tool
    call is the answer, done: 1.0 when it is the value, else half that id overlap plus half its digit overlap
    (`digit_overlap`)."""

    def __init__(self, example: dict):
        self.answer = str(example["answer"])
        self.meta = {**example.get("meta", {}), "answer": self.answer}
        self.asked = str(self.meta.get("id", ""))
        self.id_match = 0.0

    def step(self, turn: Turn) -> Feedback:
        name = record_lookup.TOOL["function"]["name"]
        for c in turn.calls:
            if c.name == name and isinstance(c.arguments.get("id"), str):
                self.id_match = max(self.id_match, _overlap(c.arguments["id"].strip(), self.asked))
        if turn.calls:
            return Feedback(reward=0.5 * self.id_match)
        digits = digit_overlap(self.meta, record_lookup.final_answer(turn.text))
        return Feedback(done=True, reward=1.0 if digits == 1.0 else 0.5 * self.id_match + 0.5 * digits)


def make_record_lookup(example: dict) -> RecordLookup:
    if "answer" not in example:
        raise KeyError(f"record-lookup's environment needs the example's 'answer', got keys {sorted(example)}")
    return RecordLookup(example)


def record_lookup_demonstration(example: dict) -> list[str]:
    """Call lookup with the asked record's id, then answer with the value."""
    return [tool_call_text(record_lookup.TOOL["function"]["name"], {"id": example["meta"]["id"]}),
            str(example["answer"])]


ENVIRONMENTS: dict[str, BuiltinEnv] = {
    record_lookup.NAME: BuiltinEnv(make_record_lookup, record_lookup_tools(),
                                   "lookup(id) returns a record's value; the answer turn scores digit overlap",
                                   record_lookup_demonstration),
}


# ---- resolution --------------------------------------------------------------------------------------------------

def load_tools(spec: str) -> ToolRegistry:
    """The ToolRegistry named by "module:attr": the attribute itself, or what calling it returns."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"agent.tools {spec!r} must be 'module:attr' naming a ToolRegistry (or a function "
                         f"returning one), e.g. 'my_envs.search:tools'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"agent.tools {spec!r}: importing {module_name!r} failed ({type(e).__name__}: {e}); check "
                         f"that the module is importable (installed, or its directory on PYTHONPATH)") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"agent.tools {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, ToolRegistry) and callable(obj):
        obj = obj()
    if not isinstance(obj, ToolRegistry):
        raise ValueError(f"agent.tools {spec!r} is a {type(obj).__name__}, not a ToolRegistry; name a "
                         f"ToolRegistry or a function returning one")
    return obj


def resolve_environment(agent_cfg: Any) -> tuple[EnvironmentFactory, ToolRegistry]:
    """(factory, registry) of a run's `agent` config (`env`, `tools`): a built-in name (the env's own tools), or
    "module:function" with the tools of `agent.tools` ("module:attr"), else the env module's attribute `tools`
    if it is a ToolRegistry, else none (an environment that only talks). `agent.tools` given with a built-in
    env replaces the built-in's tools."""
    env = agent_cfg.env
    spec = getattr(agent_cfg, "tools", None)
    if env in ENVIRONMENTS:
        builtin = ENVIRONMENTS[env]
        return builtin.make, load_tools(spec) if spec else builtin.tools
    if ":" not in env:
        raise ValueError(f"unknown agent.env {env!r}; built-in environments: {', '.join(sorted(ENVIRONMENTS))}; or "
                         f"give your own as 'module:function' (make_env(example: dict) -> Environment)")
    factory = load_environment_factory(env)
    if spec:
        return factory, load_tools(spec)
    module_tools = getattr(importlib.import_module(env.partition(":")[0]), "tools", None)
    return factory, module_tools if isinstance(module_tools, ToolRegistry) else ToolRegistry()
