"""The built-in agent task record-lookup: its prompt (the chat prompt with the tool listed, sized in tokens), its
tool (values only the tool knows; an unknown id is an error the model reads), its environment's rewards, and the
resolution of `agent.env` / `agent.tools` to a factory and a registry."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest

from longstraw.agents import Feedback, ToolCall, ToolChat, ToolRegistry, ToolRunner, ToolTurns, Turn
from longstraw.agents.builtin import ENVIRONMENTS, resolve_environment, tool_call_text
from longstraw.data.tokenizer import ByteTokenizer, HFTokenizer
from longstraw.problems import get_problem, make_problem
from longstraw.problems.record_lookup import TOOL
from longstraw.train.data import prompt_ids
from tests.agents.common import call
from tests.agents.test_chat import TOOL_TEMPLATE
from tests.data.test_tokenizer import build_hf_dir

NAME = "record-lookup"
ENV = ENVIRONMENTS[NAME]
byte = ByteTokenizer()


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    pytest.importorskip("jinja2")
    path, _ = build_hf_dir(tmp_path_factory.mktemp("hf_tool_tok"), template=TOOL_TEMPLATE)
    return HFTokenizer(path)


def user_content(prompt: str) -> str:
    """The user message of a plain-format chat prompt (parsed here, not by the library)."""
    m = re.fullmatch(r"<\|tools\|>\n.*?\n<\|user\|>\n(.*)\n<\|assistant\|>\n", prompt, re.S)
    assert m, "not a plain-format chat prompt with tools"
    return m.group(1)


def document(prompt: str) -> str:
    return re.search(r"<document>\n(.*)\n</document>", prompt, re.S).group(1)


@pytest.mark.parametrize("target", [720, 1000, 4096, 16384])
def test_length_within_five_percent_and_deterministic(target):
    ex = make_problem(NAME, 7, target, byte)
    assert abs(len(byte.encode(ex.prompt)) - target) <= 0.05 * target
    assert ex.meta["prompt_tokens"] == len(byte.encode(ex.prompt))
    again = make_problem(NAME, 7, target, byte)
    assert (again.prompt, again.answer, again.meta) == (ex.prompt, ex.answer, ex.meta)
    other = make_problem(NAME, 8, target, byte)
    assert other.prompt != ex.prompt
    # the prompt the pipeline feeds the model is the task's prompt as it is, not wrapped in a user turn again
    assert prompt_ids(byte, ex) == list(ex.prompt.encode())


def test_too_short_target_names_the_least_length():
    with pytest.raises(ValueError, match="too small.*ask for at least"):
        make_problem(NAME, 0, 300, byte)
    with pytest.raises(ValueError, match="ask_by must be"):
        make_problem(NAME, 0, 1000, byte, ask_by="value")


def test_prompt_is_the_tool_chat_prompt_and_the_value_is_not_in_it():
    for ask_by in ("id", "description"):
        ex = make_problem(NAME, 3, 2000, byte, ask_by=ask_by)
        content = user_content(ex.prompt)
        assert ex.prompt == ToolChat(byte, ENV.tools).prompt([{"role": "user", "content": content}])
        lines = document(ex.prompt).splitlines()
        records = dict(line.split(": ", 1) for line in lines)
        assert len(records) == len(lines) == ex.meta["num_records"] > 10  # ids unique
        assert len(set(records.values())) == len(records)  # descriptions unique
        question = ex.prompt.split("</document>")[1]
        if ask_by == "id":
            asked = re.search(r"value of record (r[0-9a-f]{5})\?", question).group(1)
        else:
            described = re.search(r"described as '([^']+)'\?", question).group(1)
            asked = next(r for r, d in records.items() if d == described)
        assert asked == ex.meta["id"] and asked in records
        assert re.fullmatch(r"[1-9]\d{3}", ex.answer)
        assert not re.search(rf"(?<![0-9a-f]){ex.answer}(?![0-9a-f])", ex.prompt)  # only the tool knows it


def test_hf_tool_template_prompt_and_length(hf_tok):
    ex = make_problem(NAME, 5, 1500, hf_tok)
    assert abs(len(hf_tok.encode(ex.prompt)) - 1500) <= 75
    user = re.search(r"<\|im_start\|>user\n(.*)<\|im_end\|>\n<\|im_start\|>assistant\n$", ex.prompt, re.S).group(1)
    assert ex.prompt == ToolChat(hf_tok, ENV.tools).prompt([{"role": "user", "content": user}])
    assert '"name": "lookup"' in ex.prompt


def test_lookup_tool_results_and_unknown_ids():
    ex = make_problem(NAME, 11, 1000, byte)
    other = make_problem(NAME, 12, 1000, byte)
    ids = list(dict(line.split(": ", 1) for line in document(ex.prompt).splitlines()))
    runner = ToolRunner(ENV.tools)
    calls = [ToolCall("lookup", {"id": ex.meta["id"]}), ToolCall("lookup", {"id": other.meta["id"]}),
             ToolCall("lookup", {"id": "r000000"}), ToolCall("lookup", {"id": "k123"}),
             ToolCall("lookup", {"key": ex.meta["id"]}), ToolCall("lookup", {"id": 5}),
             *[ToolCall("lookup", {"id": i}) for i in ids]]
    results = runner.run([calls])[0]
    assert [r.error for r in results[:2]] == [False, False]
    assert [r.content for r in results[:2]] == [ex.answer, other.answer]
    # an id no document holds (wrong check digits, or not an id at all): an error the model reads, naming the id
    for r, bad in zip(results[2:4], ("r000000", "k123")):
        assert r.error and r.content.startswith("error: ") and f"unknown record id {bad!r}" in r.content
    assert results[4].error and "missing argument 'id'" in results[4].content
    assert results[5].error and "must be string" in results[5].content
    # every record of the document has a value, of the same form as the answer
    assert all(not r.error and re.fullmatch(r"[1-9]\d{3}", r.content) for r in results[6:])
    # an id of the right form is known for one check digit of the 16 (made-up ids are mostly unknown)
    forms = runner.run([[ToolCall("lookup", {"id": f"r0a1b{c}"}) for c in "0123456789abcdef"]])[0]
    assert sum(not r.error for r in forms) == 1
    # registered with the very schema the prompt lists
    assert ENV.tools.schemas() == [TOOL]


def env_turn(tools: ToolRegistry, text: str) -> Turn:
    chat = ToolChat(byte, tools)
    calls = chat.parse(text)
    return Turn(text, tuple(calls), tuple(ToolRunner(tools).run([calls])[0]))


@pytest.mark.parametrize("answer_text, digits", [
    ("6944", 1.0), ("The value is 6944.", 1.0), ("6945", 0.75), ("1944", 0.75), ("6940", 0.75),
    ("69", 0.5), ("694400", 4 / 6), ("4969", 0.25), ("no idea", 0.0), ("", 0.0),
])
def test_env_rewards_partial_credit(answer_text, digits):
    """1.0 for the value; else half the best id overlap of the lookups plus half the answer's digit overlap."""
    example = {"answer": "6944", "meta": {"task": NAME, "id": "r1a2b3"}}
    env = ENV.make(example)  # answers without a call: no id credit
    want = 1.0 if digits == 1.0 else 0.5 * digits
    assert env.step(Turn(answer_text)) == Feedback(done=True, reward=pytest.approx(want))
    env = ENV.make(example)  # one lookup, 5 of the id's 6 characters in place
    assert env.step(env_turn(ENV.tools, call("lookup", id="r1a2c3"))) == Feedback(reward=pytest.approx(5 / 12))
    want = 1.0 if digits == 1.0 else 0.5 * 5 / 6 + 0.5 * digits
    assert env.step(Turn(answer_text)) == Feedback(done=True, reward=pytest.approx(want))


def test_env_rewards_the_best_lookup():
    env = ENV.make({"answer": "6944", "meta": {"task": NAME, "id": "r1a2b3"}})
    rewards = [env.step(env_turn(ENV.tools, text)).reward for text in (
        call("nope", id="r1a2b3"),        # another tool: no id credit
        call("lookup", key="r1a2b3"),     # a bad argument: none either
        call("lookup", id="r1a2b3"),      # the asked id
        call("lookup", id="r00000"))]     # a worse one later keeps the best
    assert rewards == [0.0, 0.0, 0.5, 0.5]
    assert env.step(Turn("6944")).reward == 1.0


def test_env_tool_turn_then_answer_through_tool_turns():
    ex = make_problem(NAME, 4, 1000, byte)
    example = {"answer": ex.answer, "meta": ex.meta}
    env = ENV.make(example)
    # a turn with a call is answered by the tool results alone, not done (a bad call too), its reward the id credit
    assert env.step(env_turn(ENV.tools, call("nope", id="x"))) == Feedback(reward=0.0)
    assert env.step(env_turn(ENV.tools, call("lookup", id="x"))) == Feedback(reward=0.0)  # an error result
    assert env.step(env_turn(ENV.tools, call("lookup", id=ex.meta["id"]))) == Feedback(reward=0.5)
    chat = ToolChat(byte, ENV.tools)
    branch = ToolTurns(ENV.make(example), chat)
    reply = branch.step(byte.encode(tool_call_text("lookup", {"id": ex.meta["id"]})) + [byte.eos_id])
    assert not reply.done and byte.decode(reply.tokens) == f"\n<|tool|>\n{ex.answer}\n<|assistant|>\n"
    reply = branch.step(byte.encode(ex.answer) + [byte.eos_id])
    assert reply.done and reply.tokens == [] and branch.reward == 1.0 and branch.tool_calls == 1


def test_verify_reads_the_answer_after_the_last_call():
    verify, meta = get_problem(NAME).verify, {"answer": "6944"}
    assert verify(meta, call("lookup", id="r59539d") + "6944") == 1.0
    assert verify(meta, "6944") == 1.0
    assert verify(meta, "6944" + call("lookup", id="r59539d")) == 0.0  # no answer after the call
    assert verify(meta, call("lookup", id="r59539d") + "6945") == 0.0


class Cfg:
    def __init__(self, env: str, tools: str | None = None):
        self.env, self.tools = env, tools


def test_resolve_builtin_and_user_environments(tmp_path, monkeypatch):
    factory, tools = resolve_environment(Cfg(NAME))
    assert factory is ENV.make and tools is ENV.tools
    (tmp_path / "my_agent_env.py").write_text(textwrap.dedent('''
        from longstraw.agents import Feedback, ToolRegistry

        tools = ToolRegistry()
        other = ToolRegistry()

        @tools.register
        def echo(text: str) -> str:
            """Echoes."""
            return text

        def make_other():
            return other

        class Env:
            def step(self, turn):
                return Feedback(done=True, reward=1.0)

        def make_env(example):
            return Env()
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_agent_env", None)
    import my_agent_env

    factory, tools = resolve_environment(Cfg("my_agent_env:make_env"))
    assert factory is my_agent_env.make_env and tools is my_agent_env.tools  # the module's `tools`
    assert resolve_environment(Cfg("my_agent_env:make_env", "my_agent_env:other"))[1] is my_agent_env.other
    assert resolve_environment(Cfg("my_agent_env:make_env", "my_agent_env:make_other"))[1] is my_agent_env.other
    assert resolve_environment(Cfg(NAME, "my_agent_env:other"))[1] is my_agent_env.other
    with pytest.raises(ValueError, match="unknown agent.env 'nope'.*record-lookup"):
        resolve_environment(Cfg("nope"))
    with pytest.raises(ValueError, match="not a ToolRegistry"):
        resolve_environment(Cfg("my_agent_env:make_env", "my_agent_env:Env"))
    with pytest.raises(ValueError, match="no attribute 'missing'"):
        resolve_environment(Cfg("my_agent_env:make_env", "my_agent_env:missing"))
    with pytest.raises(ValueError, match="must be 'module:attr'"):
        resolve_environment(Cfg("my_agent_env:make_env", "my_agent_env"))
