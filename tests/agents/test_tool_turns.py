"""ToolTurns end to end: a scripted model's turns through the byte tokenizer, tools (faulty ones included) and a
scripted environment, checked against the chat format rendering the whole conversation at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from longstraw.agents import (Feedback, ToolChat, ToolRunner, ToolTurns, Turn, TurnEnv, TurnReply,
                              step_branches)
from longstraw.data.tokenizer import ByteTokenizer, plain_chat
from tests.agents.common import call, lookup_tools, meeting_tools

RECORDS = {"k1": "123456", "k2": "654321"}


class Grader:
    """Done when the model answers without a tool call; reward 1 if the answer is the sum of the records."""

    def __init__(self):
        self.seen: list[Turn] = []

    def step(self, turn: Turn) -> Feedback:
        self.seen.append(turn)
        if turn.calls:
            return Feedback(reward=0.0)
        return Feedback(done=True, reward=float(turn.text.strip() == str(sum(map(int, RECORDS.values())))))


def test_tool_turns_end_to_end():
    tok = ByteTokenizer()
    chat = ToolChat(tok, lookup_tools(RECORDS))
    env = Grader()
    branch = ToolTurns(env, chat, ToolRunner(chat.registry, timeout=30))
    assert isinstance(branch, TurnEnv)
    user = {"role": "user", "content": "Add the values of k1 and k2."}
    turn_texts = [
        call("lookup", key="k1") + "\n" + call("lookup", key="k3"),  # one good call, one raising KeyError
        call("search", query="k2") + "\n<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"key\": \"k2\"}\n"
                                     "</tool_call>",  # an unknown tool and bad JSON (a brace short)
        call("lookup", key="k2"),
        "777777",
    ]
    sequence = tok.encode(chat.prompt([user]))
    replies = []
    for text in turn_texts:
        turn = tok.encode(text) + [tok.eos_id]
        reply = branch.step(turn)
        replies.append(reply)
        sequence += turn + reply.tokens
    assert [r.done for r in replies] == [False, False, False, True] and replies[-1].tokens == []
    assert (branch.reward, branch.turns, branch.tool_calls, branch.tool_errors) == (1.0, 4, 5, 3)
    assert branch.tool_seconds >= 0.0 and len(branch.history) == 4 and env.seen == branch.history
    assert [r.content for r in env.seen[0].results] == ["123456", "error: tool 'lookup' raised KeyError: 'k3'"]
    assert env.seen[1].results[0].content.startswith("error: unknown tool 'search' (available: lookup)")
    assert env.seen[1].results[1].content.startswith("error: tool call is not valid JSON")

    # the reference: the plain chat format rendering the whole conversation at once
    messages = [user]
    for turn in env.seen[:3]:
        messages.append({"role": "assistant", "content": turn.text})
        messages += [{"role": "tool", "content": r.content} for r in turn.results]
    messages.append({"role": "assistant", "content": "777777"})
    whole = plain_chat(messages, tools=chat.tools, add_generation_prompt=False)
    # the byte tokenizer's stop id is no text; the final turn's closing newline is never rendered as it ends the
    # branch
    assert tok.decode(sequence) == whole.removesuffix("\n")
    assert sequence.count(tok.eos_id) == 4


def test_observation_kinds_and_no_call_turns():
    tok = ByteTokenizer()
    chat = ToolChat(tok, lookup_tools(RECORDS))

    class Script:
        def __init__(self, answers):
            self.answers = list(answers)

        def step(self, turn: Turn) -> Feedback:
            return self.answers.pop(0)

    # a text observation on a turn without a tool call continues the branch as a user message
    branch = ToolTurns(Script([Feedback("Try again.", reward=0.5), Feedback()]), chat)
    first = branch.step(tok.encode("maybe 3") + [tok.eos_id])
    assert first == TurnReply(list(b"\n<|user|>\nTry again.\n<|assistant|>\n"), False)
    # no tool call and nothing to say: the branch is done, keeping the last reward given
    assert branch.step(tok.encode("4") + [tok.eos_id]) == TurnReply([], True)
    assert (branch.reward, branch.turns, branch.tool_calls) == (0.5, 2, 0)

    # token observations are appended as they are
    branch = ToolTurns(Script([Feedback([1, 2, 3])]), chat)
    assert branch.step(tok.encode(call("lookup", key="k1"))) == TurnReply([1, 2, 3], False)
    assert branch.tool_calls == 1 and branch.reward is None


def test_step_branches_runs_tools_of_all_branches_together():
    tools = meeting_tools(3)
    tok = ByteTokenizer()
    chat = ToolChat(tok, tools)
    runner = ToolRunner(tools, max_workers=4)
    branches = [ToolTurns(Grader(), chat, runner) for _ in range(3)]
    replies = step_branches(branches, [tok.encode(call("meet", who=w)) + [tok.eos_id] for w in "abc"])
    assert [tok.decode(r.tokens) for r in replies] == [f"\n<|tool|>\n{w}\n<|assistant|>\n" for w in "abc"]
    assert all(b.tool_errors == 0 for b in branches)


def test_branches_stepped_from_threads_share_chat_and_runner():
    # the multi-turn rollout steps branches from a thread pool: one ToolChat and ToolRunner serve them all at once
    tools = meeting_tools(3)
    tok = ByteTokenizer()
    chat = ToolChat(tok, tools)
    runner = ToolRunner(tools)
    branches = [ToolTurns(Grader(), chat, runner) for _ in range(3)]
    with ThreadPoolExecutor(max_workers=3) as pool:
        replies = list(pool.map(lambda bw: bw[0].step(tok.encode(call("meet", who=bw[1])) + [tok.eos_id]),
                                zip(branches, "abc")))
    assert [tok.decode(r.tokens) for r in replies] == [f"\n<|tool|>\n{w}\n<|assistant|>\n" for w in "abc"]
