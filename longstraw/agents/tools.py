"""Tools: plain Python functions with a JSON schema, a registry of them by name, and a runner that executes the
tool calls of many branches at once, each under a timeout.

A call that cannot be executed (unknown tool, unparsable call, arguments that do not fit the schema, an exception,
a timeout) becomes a `ToolResult` with `error=True` and one short line naming the problem: the model reads it as
the tool's answer, and the run goes on.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import time
import types
import typing
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


class ToolError(Exception):
    """Raised by a tool to answer with an error observation (its message, one line) instead of a result."""


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from the model's text: a tool `name` and its `arguments`, or, when the call could not be
    parsed, `error` (why) and the raw text in `raw`."""

    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None
    raw: str = ""


@dataclass(frozen=True)
class ToolResult:
    """What a call returned, as the text the model will read; `error` when it is an error observation."""

    name: str | None
    content: str
    error: bool = False
    seconds: float = 0.0


@dataclass(frozen=True)
class Tool:
    """A function the model may call. `parameters` is the JSON schema (an object schema) of its keyword arguments;
    `timeout` (seconds) overrides the runner's for this tool."""

    name: str
    function: Callable[..., Any]
    description: str
    parameters: dict
    timeout: float | None = None

    def schema(self) -> dict:
        """The OpenAI/HF function schema that chat templates render (`apply_chat_template(tools=[...])`)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


_SIMPLE_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def _json_type(hint: Any, where: str) -> dict:
    """The JSON schema of one type hint (the subset tools need: scalars, lists, dicts, Literal, Optional)."""
    if hint is Any:
        return {}
    if hint in _SIMPLE_TYPES:
        return {"type": _SIMPLE_TYPES[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        kinds = {_SIMPLE_TYPES.get(type(a)) for a in args}
        schema: dict = {"enum": list(args)}
        if len(kinds) == 1 and None not in kinds:
            schema["type"] = kinds.pop()
        return schema
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:  # Optional[X]: None is accepted for an argument with a default
            return _json_type(inner[0], where)
        return {"anyOf": [_json_type(a, where) for a in inner]}
    if origin in (list, tuple, Sequence, set):
        schema = {"type": "array"}
        if args and args[0] is not Ellipsis:
            schema["items"] = _json_type(args[0], where)
        return schema
    if origin is dict:
        return {"type": "object"}
    raise ValueError(f"{where}: type {hint!r} has no JSON schema; use str, int, float, bool, list, dict, Literal or "
                     f"Optional of those, or pass parameters= explicitly")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The description (first paragraph) and each argument's text, from a Google ("Args:") or Sphinx (":param")
    docstring."""
    paragraphs = doc.strip().split("\n\n")
    description = " ".join(paragraphs[0].split()) if paragraphs and not paragraphs[0].lstrip().startswith(
        ("Args:", "Arguments:", ":param")) else ""
    args: dict[str, str] = {}
    for m in re.finditer(r"^\s*:param\s+(?:\w+\s+)?(\w+):\s*(.+)$", doc, re.M):
        args[m.group(1)] = m.group(2).strip()
    section = re.search(r"^\s*(?:Args|Arguments):\s*\n((?:[ \t]+\S.*\n?|\s*\n)+)", doc, re.M)
    if section:
        current = None
        for line in section.group(1).splitlines():
            m = re.match(r"^\s+(\w+)\s*(?:\([^)]*\))?:\s*(.*)$", line)
            if m:
                current = m.group(1)
                args[current] = m.group(2).strip()
            elif current and line.strip():
                args[current] += " " + line.strip()
    return description, args


def function_schema(fn: Callable[..., Any], name: str | None = None) -> tuple[str, dict]:
    """(description, parameters schema) of `fn` from its type hints and docstring. Parameters without a default
    are required."""
    name = name or fn.__name__
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:
        raise ValueError(f"tool {name!r}: cannot read its type hints ({e}); pass parameters= explicitly") from e
    description, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
    properties: dict[str, dict] = {}
    required: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ValueError(f"tool {name!r}: parameter {p.name!r} is not a plain keyword argument; tools take "
                             f"named arguments only")
        if p.name not in hints:
            raise ValueError(f"tool {name!r}: parameter {p.name!r} has no type hint; annotate it or pass "
                             f"parameters= explicitly")
        schema = _json_type(hints[p.name], f"tool {name!r} parameter {p.name!r}")
        if p.name in arg_docs:
            schema["description"] = arg_docs[p.name]
        properties[p.name] = schema
        if p.default is p.empty:
            required.append(p.name)
    return description, {"type": "object", "properties": properties, "required": required}


_JSON_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def argument_problem(parameters: dict, arguments: Any) -> str | None:
    """Why `arguments` do not fit the object schema `parameters` (top-level names and types), or None."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    properties = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing argument {missing[0]!r}"
    if parameters.get("additionalProperties", False) is not True:
        unknown = [k for k in arguments if k not in properties]
        if unknown:
            return f"unknown argument {unknown[0]!r} (takes {', '.join(properties) or 'none'})"
    required = set(parameters.get("required", []))
    for key, value in arguments.items():
        schema = properties.get(key, {})
        if value is None and key not in required:
            continue
        kind = schema.get("type")
        if isinstance(kind, str) and kind in _JSON_CHECKS and not _JSON_CHECKS[kind](value):
            return f"argument {key!r} must be {kind}, got {type(value).__name__}"
        if "enum" in schema and value not in schema["enum"]:
            return f"argument {key!r} must be one of {schema['enum']}, got {value!r}"
    return None


class ToolRegistry:
    """Tools by name. `register` works as a decorator (`@tools.register`, `@tools.register(timeout=5)`) or a call."""

    def __init__(self, tools: Sequence[Tool] = ()):
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.add(t)

    def add(self, tool: Tool) -> Tool:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", tool.name):
            raise ValueError(f"tool name {tool.name!r} must be letters, digits, '_', '.' or '-'")
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered; give the second one another name")
        if tool.parameters.get("type") != "object":
            raise ValueError(f"tool {tool.name!r}: parameters must be an object schema {{'type': 'object', ...}}")
        self._tools[tool.name] = tool
        return tool

    def register(self, fn: Callable[..., Any] | None = None, *, name: str | None = None,
                 description: str | None = None, parameters: dict | None = None, timeout: float | None = None):
        def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
            tool_name = name or f.__name__
            if parameters is None:
                derived_description, schema = function_schema(f, tool_name)
            else:
                derived_description, schema = _parse_docstring(inspect.getdoc(f) or "")[0], parameters
            self.add(Tool(tool_name, f, description if description is not None else derived_description, schema,
                          timeout))
            return f

        return wrap(fn) if fn is not None else wrap

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict]:
        """The function schemas, for `apply_chat_template(tools=...)`."""
        return [t.schema() for t in self._tools.values()]


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


class ToolRunner:
    """Runs tool calls, many at once (`max_workers` threads), each under `timeout` seconds (or its tool's own).

    Python cannot stop a thread: a call past its timeout is answered with an error observation at once and left
    to finish in a daemon thread, its result discarded. A tool that must really be stopped (the `python` tool)
    runs its work in a subprocess it kills itself.
    """

    def __init__(self, registry: ToolRegistry, *, timeout: float = 30.0, max_workers: int = 8,
                 max_chars: int = 4000):
        if timeout <= 0 or max_workers < 1 or max_chars < 1:
            raise ValueError(f"ToolRunner needs timeout > 0, max_workers >= 1 and max_chars >= 1, got "
                             f"{timeout}, {max_workers}, {max_chars}")
        self.registry, self.timeout, self.max_workers, self.max_chars = registry, timeout, max_workers, max_chars

    def run(self, calls: Sequence[Sequence[ToolCall]]) -> list[list[ToolResult]]:
        """The results of each branch's calls (one list per branch, in call order), all run concurrently."""
        flat = [(b, c) for b, branch in enumerate(calls) for c in branch]
        results: list[list[ToolResult]] = [[] for _ in calls]
        if not flat:
            return results
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(flat))) as pool:
            for (b, _), result in zip(flat, pool.map(lambda bc: self.call(bc[1]), flat)):
                results[b].append(result)
        return results

    def call(self, call: ToolCall) -> ToolResult:
        """One call's result; never raises."""
        start = time.perf_counter()
        if call.error is not None:
            return ToolResult(call.name, f"error: {call.error}", True, 0.0)
        if call.name not in self.registry:
            available = ", ".join(self.registry.names) or "none"
            return ToolResult(call.name, f"error: unknown tool {call.name!r} (available: {available})", True, 0.0)
        tool = self.registry[call.name]
        problem = argument_problem(tool.parameters, call.arguments)
        if problem is not None:
            return ToolResult(call.name, f"error: tool {call.name!r}: {problem}", True, 0.0)
        timeout = tool.timeout if tool.timeout is not None else self.timeout
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["value"] = tool.function(**call.arguments)
            except BaseException as e:  # noqa: BLE001 - any failure of user code is the model's observation
                outcome["error"] = e

        worker = threading.Thread(target=target, name=f"tool-{call.name}", daemon=True)
        worker.start()
        worker.join(timeout)
        seconds = time.perf_counter() - start
        if worker.is_alive():
            return ToolResult(call.name, f"error: tool {call.name!r} timed out after {timeout:g} s", True, seconds)
        if "error" in outcome:
            e = outcome["error"]
            if isinstance(e, ToolError):
                return ToolResult(call.name, f"error: {_one_line(str(e))}", True, seconds)
            return ToolResult(call.name, f"error: tool {call.name!r} raised {type(e).__name__}: "
                                         f"{_one_line(str(e))}", True, seconds)
        text = _as_text(outcome.get("value"))
        if len(text) > self.max_chars:
            text = text[: self.max_chars] + f"\n[... {len(text) - self.max_chars} more characters cut]"
        return ToolResult(call.name, text, False, seconds)
