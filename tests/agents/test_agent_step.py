"""One agent GRPO step through the library, end to end: a prompt holding a document and the tools, captured once;
multi-turn branches from `rollout_turns`, each talking with a user's `Environment` through `ToolTurns`; then
`grpo_backward` on the branches with their masks, exact mode == naive mode (fp64, <= 1e-10). This checks the
seams between the environment protocol, the multi-turn rollout and the masked loss, dense and hybrid.

A tiny random model writes no valid tool call: the environment answers a turn without one with a deterministic
instruction (a user message ToolTurns renders with the chat format), and those are the observation tokens. A tiny
model taught the call first (a few hundred Adam steps on the one call, as a warm start would) really calls the
tool, and its branches go on from the tool's result."""

from __future__ import annotations

import math

import pytest
import torch

import longstraw as ls
from longstraw.agents import Feedback, ToolChat, ToolRunner, ToolTurns, Turn, rollout_turns
from longstraw.data.tokenizer import ByteTokenizer
from tests.agents.common import lookup_tools
from tests.conftest import flat_grad, rel_err, tiny_model

RECORDS = {"k1": "4821", "k2": "9307", "k3": "1150"}
INSTRUCTION = "Call lookup with key k1."
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call>'
G, BUDGET, MAX_TURNS = 4, 96, 3
tok = ByteTokenizer()
# a random model rarely samples <eos>: the control bytes end a turn too, so that turns are a few tokens long
STOPS = (tok.eos_id, *range(32))
LOSS = ls.GRPOConfig(clip_low=0.2, clip_high=0.28, rollout_correction="token_truncate", rollout_correction_max=2.0)
ENGINE = ls.EngineConfig(prompt_chunk=64, branch_batch=2)


class Reader:
    """Tells the model once which tool to call; done on the turn after, its reward how near the answer's length is
    to the value's (a random model's answers differ in length, so the group's advantages are not all zero)."""

    def __init__(self) -> None:
        self.seen: list[Turn] = []

    def step(self, turn: Turn) -> Feedback:
        self.seen.append(turn)
        if turn.calls:
            return Feedback(reward=0.0)  # the tool results answer the turn
        if len(self.seen) == 1:
            return Feedback(INSTRUCTION, reward=0.0)
        return Feedback(done=True, reward=1.0 / (1 + abs(len(turn.text.strip()) - len(RECORDS["k1"]))))


def prompt_ids(chat: ToolChat) -> torch.Tensor:
    document = "\n".join(f"record {k}: see the lookup tool" for k in RECORDS)
    user = {"role": "user", "content": f"{document}\nWhat is the value of record k1?"}
    return torch.tensor(tok.encode(chat.prompt([user])))


def runs(mask: list[bool]) -> list[tuple[bool, int, int]]:
    """The mask's runs as (value, start, end)."""
    out, at = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[at]:
            out.append((mask[at], at, i))
            at = i
    return out


def expected_reply(chat: ToolChat, turns: list[Turn], k: int) -> list[int]:
    """What ToolTurns renders after turn k of a Reader's branch: the tool results, or the instruction."""
    if turns[k].calls:
        return chat.observation(list(turns[k].results))
    return chat.observation([], INSTRUCTION) if k == 0 else []


def agent_step(model: torch.nn.Module, settings: ls.SamplingSettings) -> tuple[list[ls.Sample], list[ToolTurns]]:
    """Capture, multi-turn rollout with ToolTurns, and the GRPO step on the branches: exact == naive."""
    chat = ToolChat(tok, lookup_tools(RECORDS))
    runner = ToolRunner(chat.registry, timeout=30)
    prompt = prompt_ids(chat)
    envs = [ToolTurns(Reader(), chat, runner) for _ in range(G)]
    state = ls.capture(model, prompt, ENGINE)
    samples = rollout_turns(model, state, settings, ls.Draw(n=G, seed=3), envs, max_turns=MAX_TURNS)

    # each branch: the model's turns, as its environment read them, and between them exactly ToolTurns' rendering
    # of the feedback, mask False
    for s, env in zip(samples, envs):
        assert s.mask.dtype == torch.bool and len(s.mask) == len(s.tokens) <= settings.max_new_tokens
        assert torch.isnan(s.sampler_logprobs[~s.mask]).all() and torch.isfinite(s.sampler_logprobs[s.mask]).all()
        assert env.turns <= s.turns <= MAX_TURNS
        seen = env.env.seen
        for k, (model_wrote, a, b) in enumerate(runs(s.mask.tolist())):
            tokens = s.tokens[a:b].tolist()
            if model_wrote:
                if k // 2 < len(seen):  # a turn cut by the budget is never sent
                    assert tok.decode(tokens) == seen[k // 2].text
            else:
                want = expected_reply(chat, seen, k // 2)
                assert tokens == (want if b < len(s.mask) or s.finish_reason != "length" else want[: b - a])
    assert [s.finish_reason for s in samples].count("stop") >= 1

    rewards = [env.reward if env.reward is not None else 0.0 for env in envs]
    adv = ls.group_advantages(rewards)
    assert any(abs(a) > 0 for a in adv)
    data = dict(responses=[s.tokens for s in samples], advantages=adv, masks=[s.mask for s in samples],
                old_logprobs=[s.logprobs.double() for s in samples],
                sampler_logprobs=[s.sampler_logprobs.double() for s in samples])

    def step(mode: str, **override) -> tuple[torch.Tensor, dict]:
        model.zero_grad(set_to_none=True)
        stats = ls.grpo_backward(model, prompt, mode=mode, config=LOSS, engine=ENGINE, **(data | override))
        return flat_grad(model), stats

    g_naive, s_naive = step("naive")
    g_exact, s_exact = step("exact")
    assert rel_err(g_exact, g_naive) <= 1e-10
    for key in ("loss", "clip_frac", "sampler_logp_diff_mean", "correction_weight_mean"):
        assert math.isfinite(s_exact[key]) and s_exact[key] == pytest.approx(s_naive[key], rel=1e-9, abs=1e-12), key
    # the masks matter: the observation tokens counted as the model's move the gradient
    g_all, _ = step("exact", masks=None, sampler_logprobs=[s.sampler_logprobs.double().nan_to_num(-5.0)
                                                           for s in samples])
    assert rel_err(g_all, g_exact) > 1e-3
    return samples, envs


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_random_model_step_exact_equals_naive(model_type):
    """A random model: no tool call; every branch whose first turn ends gets the instruction."""
    model = tiny_model(model_type, dtype=torch.float64, vocab_size=tok.vocab_size, max_position_embeddings=1024)
    settings = ls.SamplingSettings(max_new_tokens=BUDGET, temperature=1.0, stop_ids=STOPS)
    samples, envs = agent_step(model, settings)
    told = [s for s, env in zip(samples, envs) if env.turns and not s.mask.all()]
    assert told and all(env.tool_calls == 0 for env in envs)


def warm_start(model: torch.nn.Module, steps: int = 300) -> float:
    """Teach the model the first turn, a lookup call (as an SFT warm start teaches the call format); the loss."""
    prompt = prompt_ids(ToolChat(tok, lookup_tools(RECORDS)))
    target = torch.tensor(tok.encode(CALL) + [tok.eos_id])
    ids = torch.cat([prompt, target])[None, :-1]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(ids, logits_from=len(prompt) - 1)[0], target)
        if loss.item() < 1e-3:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return loss.item()


def test_warm_model_calls_the_tool_and_reads_its_result():
    """A model taught the call: its branches call lookup, ToolTurns runs it, and the tool's result, rendered with
    the chat format, is the observation the branch goes on from."""
    model = tiny_model("qwen3", dtype=torch.float64, vocab_size=tok.vocab_size, max_position_embeddings=1024)
    assert warm_start(model) < 1e-2
    settings = ls.SamplingSettings(max_new_tokens=160, temperature=1.0, stop_ids=(tok.eos_id,))
    samples, envs = agent_step(model, settings)
    called = [(s, env) for s, env in zip(samples, envs) if env.tool_calls]
    assert called
    for s, env in called:
        assert env.tool_errors == 0 and [r.content for r in env.history[0].results] == [RECORDS["k1"]]
        # (agent_step checked that the observation is the rendering of these results, token for token)
        assert RECORDS["k1"] in tok.decode(s.tokens[~s.mask].tolist())
