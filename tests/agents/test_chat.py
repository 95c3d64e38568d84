"""The tool-call format: parsing <tool_call> JSON, and tools and observations rendered with the chat template."""

from __future__ import annotations

import json

import pytest

from longstraw.agents.chat import ToolChat, parse_tool_calls
from longstraw.agents.tools import ToolRegistry, ToolResult, ToolRunner
from longstraw.data.tokenizer import ByteTokenizer, HFTokenizer, plain_chat, stop_ids
from tests.data.test_tokenizer import TEMPLATE as NO_TOOLS_TEMPLATE, build_hf_dir

pytest.importorskip("jinja2")

# A small template in the style of Qwen3's tool format (written for these tests): tools listed in a system turn,
# tool results grouped into one user turn of <tool_response> blocks, and, like Qwen3, an empty think block written
# into an assistant turn only when it is the last message.
TOOL_TEMPLATE = (
    r"{%- if tools %}{{- '<|im_start|>system\nTools you may call, one signature a line:\n<tools>' }}"
    r"{%- for t in tools %}{{- '\n' + (t | tojson) }}{%- endfor %}"
    r"""{{- '\n</tools>\nTo call one, answer <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call>' }}"""
    r"{{- '<|im_end|>\n' }}{%- endif %}"
    r"{%- for m in messages %}"
    r"{%- if m.role == 'tool' %}"
    r"{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    r"{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    r"{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    r"{%- elif m.role == 'assistant' and loop.last %}"
    r"{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m.content + '<|im_end|>\n' }}"
    r"{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    r"{%- endif %}{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def registry() -> ToolRegistry:
    tools = ToolRegistry()

    @tools.register
    def lookup(key: str) -> str:
        """The value of a record id."""
        return key

    return tools


def test_parse_several_calls():
    text = ('Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("lookup", {"key": "k1"}, None),
                                                               ("add", {"a": 1, "b": 2}, None)]
    assert parse_tool_calls("no call here") == []


def test_parse_bad_calls():
    text = ('<tool_call>\n{"name": "lookup", "arguments": {"key": }}\n</tool_call>'
            '<tool_call>["lookup"]</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": [1]}</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": {"key": "k2"}}</tool_call>'
            '<tool_call>{"name": "lookup", "argum')
    bad_json, wrong_shape, bad_args, good, unclosed = parse_tool_calls(text)
    assert bad_json.name is None and bad_json.error.startswith("tool call is not valid JSON (Expecting value")
    assert "JSON object" in wrong_shape.error
    assert bad_args.name == "lookup" and "must be a JSON object" in bad_args.error
    assert (good.name, good.arguments, good.error) == ("lookup", {"key": "k2"}, None)
    assert "no closing </tool_call>" in unclosed.error


def test_parse_xml_calls():
    # Qwen3-Coder / Qwen3.5's form, beside a JSON call in the same turn: values that parse as JSON are JSON
    text = ('I will look.\n<tool_call>\n<function=lookup>\n<parameter=key>\nk1\n</parameter>\n'
            '<parameter=limit>\n3\n</parameter>\n<parameter=filters>\n{"year": [2024, 2025]}\n</parameter>\n'
            '<parameter=note>\ntwo lines\nof text\n</parameter>\n</function>\n</tool_call>\n'
            '<tool_call>\n{"name": "lookup", "arguments": {"key": "k2"}}\n</tool_call>\n'
            '<tool_call>\n<function=now>\n</function>\n</tool_call>')
    xml, json_call, no_args = parse_tool_calls(text)
    assert (xml.name, xml.error) == ("lookup", None)
    assert xml.arguments == {"key": "k1", "limit": 3, "filters": {"year": [2024, 2025]}, "note": "two lines\nof text"}
    assert (json_call.name, json_call.arguments) == ("lookup", {"key": "k2"})
    assert (no_args.name, no_args.arguments, no_args.error) == ("now", {}, None)


def test_malformed_xml_calls_become_error_observations():
    bodies = {
        "<function=lookup>\n<parameter=key>\nk1\n</parameter>\n": "no closing </function>",
        "<function=lookup>\n<parameter=key>\nk1\n</function>": "text outside a parameter",  # unclosed parameter
        "<function=lookup>\nkey=k1\n</function>": "text outside a parameter ('key=k1')",
        "<function=>\n</function>": "empty function name",
        "<function=lookup>\n<parameter=key>\na\n</parameter>\n<parameter=key>\nb\n</parameter>\n</function>":
            "parameter 'key' twice",
        "<function=lookup>\n</function>\ntrailing": "text around <function=...>",
    }
    calls = parse_tool_calls("".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies))
    assert len(calls) == len(bodies)
    for call, problem in zip(calls, bodies.values()):
        assert call.error is not None and problem in call.error, (call, problem)
        assert "<function=NAME>" in call.error  # says what the form should be
    # the runner turns each into an error observation for the model, never an exception
    results = ToolRunner(registry()).run([calls])[0]
    assert all(r.error and r.content.startswith("error: ") for r in results)


@pytest.fixture(scope="module")
def hf_tool_tok(tmp_path_factory):
    path, _ = build_hf_dir(tmp_path_factory.mktemp("hf_tool_tok"), template=TOOL_TEMPLATE)
    return HFTokenizer(path)


def test_hf_tools_render_into_the_prompt(hf_tool_tok):
    chat = ToolChat(hf_tool_tok, registry())
    prompt = chat.prompt([{"role": "user", "content": "What is k1?"}])
    schema = json.dumps(registry().schemas()[0])
    assert prompt.startswith("<|im_start|>system\nTools you may call")
    assert json.loads(prompt.split("<tools>\n")[1].split("\n</tools>")[0]) == json.loads(schema)
    assert prompt.endswith("<|im_start|>user\nWhat is k1?<|im_end|>\n<|im_start|>assistant\n")
    # without tools the same tokenizer renders what it always did
    assert hf_tool_tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_hf_observation_matches_the_whole_conversation(hf_tool_tok):
    tok = hf_tool_tok
    chat = ToolChat(tok, registry())
    user = {"role": "user", "content": "What is k1 and k2?"}
    content = ('<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "lookup", "arguments": {"key": "k2"}}\n</tool_call>')
    results = [ToolResult("lookup", "123456"), ToolResult("lookup", "error: unknown key", error=True)]
    obs_text = chat.observation_text(results)
    assert obs_text == ("\n<|im_start|>user\n<tool_response>\n123456\n</tool_response>\n<tool_response>\n"
                        "error: unknown key\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # the reference: the template renders the whole conversation at once; prompt + the model's turn (its stop
    # token included) + the observation must be exactly that
    whole = tok.apply_chat_template([user, {"role": "assistant", "content": content},
                                     {"role": "tool", "content": "123456"},
                                     {"role": "tool", "content": "error: unknown key"}], tools=chat.tools)
    assert chat.prompt([user]) + content + tok.eos_token + obs_text == whole
    obs = chat.observation(results)
    assert tok.encode(whole)[-len(obs) - 1:] == [tok.eos_id] + obs
    # a text observation from the environment follows the tool results as a message of its role
    with_message = chat.observation_text(results[:1], "Two turns left.")
    assert with_message.endswith("</tool_response><|im_end|>\n<|im_start|>user\nTwo turns left.<|im_end|>\n"
                                 "<|im_start|>assistant\n")


def test_a_base_tokenizer_ends_turns_at_a_stop_token(tmp_path):
    """A base model's tokenizer: eos is <|endoftext|> but its chat template ends a turn with <|im_end|>. With
    stop_tokens ['<|im_end|>'] the turn ends there, and prompt + turn + observation is the whole conversation the
    template renders; the ids that end an answer are eos and <|im_end|>."""
    path, raw = build_hf_dir(tmp_path / "base", template=TOOL_TEMPLATE, eos="<|endoftext|>")
    tok = HFTokenizer(path)
    assert stop_ids(tok, ["<|im_end|>"]) == (raw.token_to_id("<|endoftext|>"), raw.token_to_id("<|im_end|>"))
    assert stop_ids(tok, ["<|endoftext|>"]) == (tok.eos_id,)
    with pytest.raises(ValueError, match="'im_end' is .* tokens of HFTokenizer"):
        stop_ids(tok, ["im_end"])
    user = {"role": "user", "content": "What is k1?"}
    content = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call>'
    whole = tok.apply_chat_template([user, {"role": "assistant", "content": content},
                                     {"role": "tool", "content": "123456"}], tools=registry().schemas())
    chat = ToolChat(tok, registry(), ["<|im_end|>"])
    observation = chat.observation_text([ToolResult("lookup", "123456")])
    assert chat.prompt([user]) + content + "<|im_end|>" + observation == whole
    # without it the model's eos is no end of the template's turn: the observation would write <|im_end|> itself
    assert ToolChat(tok, registry()).observation_text([ToolResult("lookup", "1")]).startswith("<|im_end|>\n")


def test_template_without_tools_is_refused(tmp_path):
    path, _ = build_hf_dir(tmp_path / "no_tools", template=NO_TOOLS_TEMPLATE)
    with pytest.raises(ValueError) as e:
        ToolChat(HFTokenizer(path), registry())
    assert str(path) in str(e.value) and "does not render tools" in str(e.value) and "'lookup'" in str(e.value)


def test_talk_only_environment_needs_no_tool_support(tmp_path):
    path, _ = build_hf_dir(tmp_path / "talk_only", template=NO_TOOLS_TEMPLATE)
    chat = ToolChat(HFTokenizer(path), ToolRegistry())
    assert chat.observation_text([], "Try again.") == (
        "\n<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n")


def test_template_without_tool_role_is_refused(tmp_path):
    drops_tool_messages = (r"{%- if tools %}{{- (tools | tojson) + '\n' }}{%- endif %}"
                           r"{%- for m in messages %}{%- if m.role != 'tool' %}"
                           r"{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
                           r"{%- endif %}{%- endfor %}"
                           r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
    path, _ = build_hf_dir(tmp_path / "no_tool_role", template=drops_tool_messages)
    with pytest.raises(ValueError, match="does not render messages of role 'tool'"):
        ToolChat(HFTokenizer(path), registry())


def test_template_not_prefix_stable_is_refused(tmp_path):
    # ends a final assistant turn with <|im_end|> but one followed by more messages with <|endoftext|>
    unstable = (r"{%- if tools %}{{- (tools | tojson) + '\n' }}{%- endif %}"
                r"{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' + m.content }}"
                r"{%- if loop.last %}{{- '<|im_end|>\n' }}{%- else %}{{- '<|endoftext|>\n' }}{%- endif %}"
                r"{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
    path, _ = build_hf_dir(tmp_path / "unstable", template=unstable)
    with pytest.raises(ValueError) as e:
        ToolChat(HFTokenizer(path), registry())
    assert "not prefix-stable" in str(e.value) and str(path) in str(e.value)


def test_plain_format_with_tools():
    tools = registry().schemas()
    messages = [{"role": "user", "content": "k1?"},
                {"role": "assistant", "content": "Looking.",
                 "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"key": "k1"}}}]},
                {"role": "tool", "content": "123456"}]
    text = plain_chat(messages, tools=tools)
    assert text == ("<|tools|>\nTo call a tool, write <tool_call>\n{\"name\": <tool name>, \"arguments\": "
                    "{<arguments>}}\n</tool_call>. The tools:\n" + json.dumps(tools[0]) + "\n"
                    "<|user|>\nk1?\n"
                    "<|assistant|>\nLooking.\n<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"key\": \"k1\"}}\n"
                    "</tool_call>\n<|tool|>\n123456\n<|assistant|>\n")
    assert ByteTokenizer().apply_chat_template(messages, tools=tools) == text
    # without tools: today's format, and no trailing header when asked
    assert plain_chat(messages[:1]) == "<|user|>\nk1?\n<|assistant|>\n"
    assert plain_chat(messages[:1], add_generation_prompt=False) == "<|user|>\nk1?\n"


def test_byte_observation_matches_the_whole_conversation():
    tok = ByteTokenizer()
    chat = ToolChat(tok, registry())
    user = {"role": "user", "content": "k1?"}
    content = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call>'
    obs_text = chat.observation_text([ToolResult("lookup", "123456")])
    assert obs_text == "\n<|tool|>\n123456\n<|assistant|>\n"
    whole = plain_chat([user, {"role": "assistant", "content": content}, {"role": "tool", "content": "123456"}],
                       tools=chat.tools)
    # the byte tokenizer's stop id is no text: the model's turn is its content alone
    assert chat.prompt([user]) + content + obs_text == whole
    assert chat.observation([ToolResult("lookup", "123456")]) == list(obs_text.encode())
