"""The tool-call format: tool calls parsed from the model's text, tools and tool results rendered with the
tokenizer's own chat template.

Calls are Qwen3's: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number per turn; or, inside
the same `<tool_call>` block, the XML form of Qwen3-Coder's and Qwen3.5's templates:
`<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>`. The tokens of an observation are
what the chat template writes after the model's turn: the end of that turn (after the stop token the model
sampled), the tool message(s), and the next assistant header.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from ..data.tokenizer import Tokenizer
from .tools import ToolCall, ToolRegistry, ToolResult

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.S)
_CALL_SHAPE = 'a tool call must be a JSON object {"name": ..., "arguments": {...}}'
# stands for the model's turn in a rendering, so that what the template writes after it can be cut out
_TURN = "LONGSTRAW_ASSISTANT_TURN_7f3a"
_PROBE = "LONGSTRAW_TOOL_RESULT_7f3a"


_XML_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.S)
_XML_SHAPE = "a tool call in XML form is <function=NAME> then <parameter=KEY> VALUE </parameter> ... </function>"


def _xml_value(text: str):
    """A parameter's value: JSON when it parses (numbers, lists, objects, quoted strings), else the text itself;
    the one newline the template writes on each side of it is not part of it."""
    text = text.removeprefix("\n").removesuffix("\n")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_xml(body: str) -> ToolCall:
    m = _XML_FUNCTION.fullmatch(body)
    if m is None:
        problem = "no closing </function>" if "</function>" not in body else "text around <function=...>"
        return ToolCall(None, error=f"tool call in XML form has {problem}; {_XML_SHAPE}", raw=body)
    name = m.group(1).strip()
    if not name:
        return ToolCall(None, error=f"tool call in XML form has an empty function name; {_XML_SHAPE}", raw=body)
    args, at, inner = {}, 0, m.group(2)
    for p in _XML_PARAMETER.finditer(inner):
        key, stray = p.group(1).strip(), inner[at : p.start()].strip()
        if stray or not key or key in args:
            what = (f"text outside a parameter ({stray[:40]!r})" if stray
                    else "an empty parameter name" if not key else f"parameter {key!r} twice")
            return ToolCall(name, error=f"call of {name!r} in XML form has {what}; {_XML_SHAPE}", raw=body)
        args[key] = _xml_value(p.group(2))
        at = p.end()
    if inner[at:].strip():  # an unclosed <parameter=...> lands here too
        return ToolCall(name, error=f"call of {name!r} in XML form has text outside a parameter "
                                    f"({inner[at:].strip()[:40]!r}); {_XML_SHAPE}", raw=body)
    return ToolCall(name, args, raw=body)


def _parse_one(body: str) -> ToolCall:
    if body.startswith("<function="):
        return _parse_xml(body)
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(None, error=f"tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                        raw=body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, error=_CALL_SHAPE, raw=body)
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(obj["name"], error=f"arguments of {obj['name']!r} are not valid JSON ({e.msg})", raw=body)
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f"arguments of {obj['name']!r} must be a JSON object", raw=body)
    return ToolCall(obj["name"], args, raw=body)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` in `text`, in order, its body a JSON object or the XML form; a block that
    does not parse is a call with `error` set (an unclosed block at the end too), so that the model is told what
    was wrong."""
    calls = []
    for m in _CALL.finditer(text):
        body = m.group(1).strip()
        if not m.group(2):
            calls.append(ToolCall(None, error="tool call has no closing </tool_call>", raw=body))
        else:
            calls.append(_parse_one(body))
    return calls


def _template_name(tokenizer: Tokenizer) -> str:
    directory = getattr(tokenizer, "directory", None)
    return f"the chat template of {directory}" if directory is not None else f"the chat format of {tokenizer!r}"


def tool_messages(results: Sequence[ToolResult]) -> list[dict]:
    """Tool results as chat messages of role "tool" (HF's convention)."""
    return [{"role": "tool", "content": r.content, **({"name": r.name} if r.name else {})} for r in results]


class ToolChat:
    """A tokenizer's chat format with tools: the prompt with the tools listed, and observation tokens.

    Checked once, at construction: the template renders the tools and messages of role "tool", and closes the
    model's turn the same way whether or not a tool message follows (prefix-stable after the turn). The text
    before the turn may differ between renderings (Qwen3 writes an empty `<think>` block into a final assistant
    turn only): the observation starts where the model's turn ended, so only what follows the turn must agree.
    With an empty registry (an environment that only talks) no tool support is needed.
    """

    def __init__(self, tokenizer: Tokenizer, registry: ToolRegistry, stop_tokens: Sequence[str] = ()):
        self.tokenizer, self.registry = tokenizer, registry
        # None without tools: an environment that only talks (a simulated user) renders as the template always did
        self.tools = registry.schemas() or None
        name = _template_name(tokenizer)
        listed = self.tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tools=self.tools)
        missing = [n for n in registry.names if n not in listed]
        if missing:
            raise ValueError(f"{name} does not render tools (tool {missing[0]!r} is missing from its output with "
                             f"tools=...): use a tokenizer whose chat template supports tools, e.g. Qwen3's")
        self._closing = self._after_turn([], add_generation_prompt=False)
        # the model's stop token (eos, or one of `stop_tokens`) is the template's end-of-turn marker: the
        # observation starts after it
        ends = [t for t in (getattr(tokenizer, "eos_token", None), *stop_tokens) if t and self._closing.startswith(t)]
        self._end_of_turn = max(ends, key=len, default="")
        if self.tools and _PROBE not in self._after_turn([{"role": "tool", "content": _PROBE}]):
            raise ValueError(f"{name} does not render messages of role 'tool' (a tool result is missing from its "
                             f"output): use a tokenizer whose chat template supports tools, e.g. Qwen3's")

    def _after_turn(self, following: list[dict], add_generation_prompt: bool = True) -> str:
        """What the template writes after an assistant turn, the `following` messages included."""
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN}, *following]
        text = self.tokenizer.apply_chat_template(messages, tools=self.tools,
                                                  add_generation_prompt=add_generation_prompt)
        if text.count(_TURN) != 1:
            raise ValueError(f"{_template_name(self.tokenizer)} does not render an assistant message's content "
                             f"once, as written; tool turns cannot be rendered with it")
        after = text[text.index(_TURN) + len(_TURN):]
        if following and not after.startswith(self._closing):
            raise ValueError(f"{_template_name(self.tokenizer)} is not prefix-stable: it ends an assistant turn "
                             f"with {self._closing!r} alone but with {after[:len(self._closing)]!r} before a tool "
                             f"message; observation tokens cannot be appended to the model's turn")
        return after

    def prompt(self, messages: list[dict]) -> str:
        """The prompt text of `messages` with the tools listed, ending with the assistant header."""
        return self.tokenizer.apply_chat_template(messages, tools=self.tools)

    def observation_text(self, results: Sequence[ToolResult], message: str | None = None,
                         role: str = "user") -> str:
        """The text after the model's stop token: its turn's end, the tool results, then `message` as a message of
        `role` if given, and the next assistant header."""
        following = tool_messages(results) + ([{"role": role, "content": message}] if message is not None else [])
        return self._after_turn(following)[len(self._end_of_turn):]

    def observation(self, results: Sequence[ToolResult], message: str | None = None, role: str = "user") -> list[int]:
        """`observation_text` as token ids."""
        return self.tokenizer.encode(self.observation_text(results, message, role))

    def parse(self, text: str) -> list[ToolCall]:
        return parse_tool_calls(text)
