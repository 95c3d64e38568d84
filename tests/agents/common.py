"""Tools and tool-call text shared by the agents tests."""

from __future__ import annotations

import json
import threading

from longstraw.agents import ToolRegistry


def lookup_tools(records: dict[str, str]) -> ToolRegistry:
    """A registry with one tool, `lookup(key)`: the value of a record id."""
    tools = ToolRegistry()

    @tools.register
    def lookup(key: str) -> str:
        """The value of a record id."""
        return records[key]

    return tools


def meeting_tools(parties: int) -> ToolRegistry:
    """A registry with one tool, `meet(who)`, whose calls wait for each other at a barrier of `parties`: run one
    after the other, the first call would break it (the proof that calls run together, with no timing)."""
    barrier = threading.Barrier(parties, timeout=30)
    tools = ToolRegistry()

    @tools.register
    def meet(who: str) -> str:
        """Waits until every party calls."""
        barrier.wait()
        return who

    return tools


def call(name: str, **arguments) -> str:
    """The text of one tool call in the JSON form."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'
