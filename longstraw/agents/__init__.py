"""Agents: GRPO branches of several turns. The model writes, an environment answers (a tool's result, a user's
reply), the model writes again; every turn of every branch decodes on the one captured prefix state.

`protocol` is the seam between the multi-turn rollout (`turns`), which works in token ids, and the environments
and tools, which work in text: `environment` (the user's protocol), `tools` (functions, registry, runner), `chat`
(the tool-call format and its rendering), `python_tool` (a sandboxed `python` tool) and `tool_turns` (the adapter
from an environment to the rollout's `TurnEnv`). docs/agents.md shows them together."""

from .chat import ToolChat, parse_tool_calls
from .environment import (Environment, EnvironmentFactory, EnvironmentFailed, Feedback, Turn,
                          load_environment_factory, make_environment)
from .protocol import TurnEnv, TurnReply
from .python_tool import python_tool
from .tool_turns import ToolTurns, step_branches
from .turns import rollout_turns
from .tools import Tool, ToolCall, ToolError, ToolRegistry, ToolResult, ToolRunner

__all__ = ["Environment", "EnvironmentFactory", "EnvironmentFailed", "Feedback", "Tool", "ToolCall", "ToolChat",
           "ToolError", "ToolRegistry", "ToolResult", "ToolRunner", "ToolTurns", "Turn", "TurnEnv", "TurnReply",
           "load_environment_factory", "make_environment", "parse_tool_calls", "python_tool", "rollout_turns",
           "step_branches"]
