"""Tool schemas from type hints and docstrings, the registry, and the runner: each fault an error observation."""

from __future__ import annotations

import threading
from typing import Literal

import pytest

from longstraw.agents.tools import (Tool, ToolCall, ToolError, ToolRegistry, ToolRunner, argument_problem,
                                    function_schema)
from tests.agents.common import meeting_tools


def lookup(key: str, limit: int = 3, exact: bool | None = None) -> str:
    """Find the value of a record id.

    Args:
        key: the record id, e.g. "k1a2".
        limit (int): at most this many
            values are returned.
        exact: match the id exactly.
    """
    return f"{key}:{limit}:{exact}"


def test_schema_from_hints_and_docstring():
    description, params = function_schema(lookup)
    assert description == "Find the value of a record id."
    assert params == {
        "type": "object",
        "properties": {
            "key": {"type": "string", "description": 'the record id, e.g. "k1a2".'},
            "limit": {"type": "integer", "description": "at most this many values are returned."},
            "exact": {"type": "boolean", "description": "match the id exactly."},
        },
        "required": ["key"],
    }


def test_schema_types_and_sphinx_docstring():
    def f(xs: list[float], mode: Literal["a", "b"], opts: dict, anything=None) -> None:
        """Do f.

        :param xs: numbers
        """

    with pytest.raises(ValueError, match="'anything' has no type hint"):
        function_schema(f)

    def g(xs: list[float], mode: Literal["a", "b"], opts: dict) -> None:
        """Do g.

        :param xs: numbers
        """

    description, params = function_schema(g)
    assert description == "Do g."
    assert params["properties"] == {"xs": {"type": "array", "items": {"type": "number"}, "description": "numbers"},
                                    "mode": {"enum": ["a", "b"], "type": "string"}, "opts": {"type": "object"}}

    def h(x: complex) -> None: ...

    with pytest.raises(ValueError, match="complex"):
        function_schema(h)


def test_registry():
    tools = ToolRegistry()
    tools.register(lookup)

    @tools.register(name="add", timeout=2)
    def add_numbers(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    explicit = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    tools.register(lambda q: q.upper(), name="shout", description="Shout.", parameters=explicit)
    assert tools.names == ["lookup", "add", "shout"] and "add" in tools and len(tools) == 3
    assert tools["add"].timeout == 2 and tools["add"].function is add_numbers
    assert tools["shout"].schema() == {"type": "function", "function": {"name": "shout", "description": "Shout.",
                                                                        "parameters": explicit}}
    assert [s["function"]["name"] for s in tools.schemas()] == tools.names
    with pytest.raises(ValueError, match="already registered"):
        tools.register(lookup)
    with pytest.raises(ValueError, match="letters"):
        tools.add(Tool("bad name", print, "", {"type": "object"}))


def test_argument_problems():
    _, params = function_schema(lookup)
    assert argument_problem(params, {"key": "a"}) is None
    assert argument_problem(params, {"key": "a", "exact": None}) is None
    assert "missing argument 'key'" in argument_problem(params, {})
    assert "unknown argument 'kee'" in argument_problem(params, {"key": "a", "kee": 1})
    assert "'limit' must be integer" in argument_problem(params, {"key": "a", "limit": "3"})
    assert "'limit' must be integer" in argument_problem(params, {"key": "a", "limit": True})
    assert "JSON object" in argument_problem(params, [1])


@pytest.fixture
def runner():
    tools = ToolRegistry()
    tools.register(lookup)

    @tools.register
    def fail(message: str) -> str:
        """Always raises."""
        raise KeyError(message)

    @tools.register
    def refuse(why: str) -> str:
        """Raises a ToolError."""
        raise ToolError(f"refused: {why}")

    release = threading.Event()

    @tools.register(timeout=0.2)
    def hang() -> str:
        """Waits until released."""
        release.wait(60)
        return "late"

    @tools.register
    def table() -> dict:
        """Returns a dict."""
        return {"a": 1, "b": [2, 3]}

    @tools.register
    def long() -> str:
        """Returns much text."""
        return "x" * 50

    yield ToolRunner(tools, timeout=30, max_chars=30)
    release.set()


def test_runner_results_and_faults(runner):
    calls = [
        ToolCall("lookup", {"key": "k1"}),
        ToolCall("nope", {}),
        ToolCall(None, error="tool call is not valid JSON (Expecting value at line 1 column 9)"),
        ToolCall("lookup", {"limit": 2}),
        ToolCall("fail", {"message": "no such record"}),
        ToolCall("refuse", {"why": "too big"}),
        ToolCall("hang", {}),
        ToolCall("table", {}),
        ToolCall("long", {}),
    ]
    results = runner.run([calls[:4], [], calls[4:]])
    assert [len(r) for r in results] == [4, 0, 5]
    ok, unknown, bad_json, bad_args = results[0]
    failed, refused, hung, table, long = results[2]
    assert (ok.content, ok.error) == ("k1:3:None", False)
    assert unknown.error and unknown.content.startswith("error: unknown tool 'nope'") and "lookup" in unknown.content
    assert bad_json.error and "not valid JSON" in bad_json.content
    assert bad_args.error and bad_args.content == "error: tool 'lookup': missing argument 'key'"
    assert failed.error and failed.content == "error: tool 'fail' raised KeyError: 'no such record'"
    assert refused.error and refused.content == "error: refused: too big"
    assert hung.error and hung.content == "error: tool 'hang' timed out after 0.2 s"
    assert (table.content, table.error) == ('{"a": 1, "b": [2, 3]}', False)
    assert long.content.startswith("x" * 30 + "\n[... 20 more") and not long.error
    # every error observation is one line
    assert all("\n" not in r.content for r in results[0] + results[2] if r.error)


def test_runner_runs_branches_concurrently():
    # two calls on different branches meet at a barrier: run one after the other, the first would break it
    tools = meeting_tools(2)
    results = ToolRunner(tools, max_workers=4).run([[ToolCall("meet", {"who": "a"})], [ToolCall("meet", {"who": "b"})]])
    assert [[r.content for r in b] for b in results] == [["a"], ["b"]]
    assert not any(r.error for b in results for r in b)


def test_runner_timeout_does_not_wait_for_the_call():
    tools = ToolRegistry()
    release, finished = threading.Event(), threading.Event()

    @tools.register(timeout=0.1)
    def stuck() -> str:
        """Waits until released."""
        release.wait(60)
        finished.set()
        return "late"

    result = ToolRunner(tools).call(ToolCall("stuck", {}))
    assert result.error and result.content == "error: tool 'stuck' timed out after 0.1 s"
    assert not finished.is_set()  # answered while the call still runs
    release.set()


def test_runner_bad_settings():
    with pytest.raises(ValueError, match="timeout > 0"):
        ToolRunner(ToolRegistry(), timeout=0)
