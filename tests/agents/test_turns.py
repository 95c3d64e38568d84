"""rollout_turns(): multi-turn branches from one prefix state, checked against transformers' `generate` re-run on
the whole sequence turn by turn, against `rollout` for the first turn, and on 2 gloo ranks against one process."""

from __future__ import annotations

import pytest
import torch

import longstraw as ls
from longstraw.agents.protocol import TurnReply
from longstraw.agents.turns import rollout_turns
from tests.conftest import GLM, tiny_model
from tests.models.test_dense import hf_model
from tests.models.test_qwen3_5 import hf_causal_lm
from tests.parallel.launch import run_ranks

STOPS = tuple(range(0, 97, 7))  # one id in seven ends a turn: turns of a few tokens
# by branch, the reply to each turn (the last one says done): an observation holding a stop id (14), one empty,
# one ending the branch with tokens
SCRIPTS = [[[3, 4, 5], [6, 8]], [[9, 10, 11, 12], [13, 14, 15], [16, 17]], [[], [18, 19, 20]]]


class ScriptedEnv:
    """Replies to turn k with `replies[k]`, done with the last; keeps the turns it was sent."""

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies, self.calls = replies, []

    def step(self, tokens: list[int]) -> TurnReply:
        self.calls.append(list(tokens))
        k = len(self.calls) - 1
        return TurnReply(list(self.replies[k]), done=k == len(self.replies) - 1)


def reference_branch(hf, prompt: torch.Tensor, replies: list[list[int]], budget: int, max_turns: int) -> dict:
    """One branch the plain way: `generate` (greedy) on prompt + everything so far until a stop id, the scripted
    reply appended, again; the ends as rollout_turns documents them."""
    out, mask, calls, turns = [], [], [], 0
    while True:  # each generate call is a turn the model writes
        turns += 1
        context = torch.cat([prompt, torch.tensor(out, dtype=torch.long)])[None]
        new = hf.generate(context, max_new_tokens=budget - len(out), do_sample=False, eos_token_id=list(STOPS),
                          pad_token_id=0)[0, context.shape[1]:].tolist()
        out, mask = out + new, mask + [True] * len(new)
        if new[-1] not in STOPS:
            finish = "length"
            break
        calls.append(new)
        done = len(calls) == len(replies)
        if not done and len(calls) == max_turns:
            finish = "turns"
            break
        observation = replies[len(calls) - 1][: budget - len(out)]
        out, mask = out + observation, mask + [False] * len(observation)
        if done or len(out) == budget:
            finish = "stop" if done else "length"
            break
    ids = torch.cat([prompt, torch.tensor(out, dtype=torch.long)])
    with torch.no_grad():
        logps = hf(ids[None]).logits[0, len(prompt) - 1 : -1].double().log_softmax(-1)
    return {"tokens": out, "mask": mask, "finish": finish, "calls": calls, "turns": turns,
            "logprobs": logps.gather(-1, torch.tensor(out)[:, None])[:, 0]}


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5_text"])
def models(request, tmp_path_factory):
    """A tiny transformers model with random weights (fp64: greedy near-ties cannot fall apart) and ours loaded
    from its checkpoint."""
    hf = (hf_model("qwen3") if request.param == "qwen3" else hf_causal_lm(vocab_size=97)).double()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, ls.load_model(path, dtype=torch.float64)


PROMPT = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(1))


def run(ours, budget: int, max_turns: int) -> tuple[list[ls.Sample], list[ScriptedEnv]]:
    envs = [ScriptedEnv(s) for s in SCRIPTS]
    state = ls.capture(ours, PROMPT, ls.EngineConfig(prompt_chunk=8))
    settings = ls.SamplingSettings(max_new_tokens=budget, temperature=0.0, stop_ids=STOPS)
    return rollout_turns(ours, state, settings, ls.Draw(n=len(envs), seed=0), envs, max_turns=max_turns), envs


def assert_as_reference(samples: list[ls.Sample], envs: list[ScriptedEnv], refs: list[dict]) -> None:
    for s, env, ref in zip(samples, envs, refs, strict=True):
        assert s.tokens.tolist() == ref["tokens"]
        assert s.mask.tolist() == ref["mask"]
        assert (s.finish_reason, s.turns) == (ref["finish"], ref["turns"])
        assert env.calls == ref["calls"]  # each ended turn, its stop id included, sent to its own env
        torch.testing.assert_close(s.logprobs.double(), ref["logprobs"], atol=1e-5, rtol=0)  # fp32 logits
        assert torch.isnan(s.sampler_logprobs[~s.mask]).all()
        assert torch.equal(s.sampler_logprobs[s.mask], torch.zeros(int(s.mask.sum())))  # greedy: a point mass


def test_branches_equal_generate_turn_by_turn(models):
    hf, ours = models
    refs = [reference_branch(hf, PROMPT, script, 80, 5) for script in SCRIPTS]
    samples, envs = run(ours, 80, 5)
    assert_as_reference(samples, envs, refs)
    assert samples[0].finish_reason == samples[2].finish_reason == "stop"  # done after 2 turns
    assert [s.turns for s in samples] == [2, 3, 2]
    # observation tokens end no turn (14 is a stop id); branch 1 is done after its third turn, or loops to the end
    assert samples[1].tokens[~samples[1].mask].tolist()[:7] == [9, 10, 11, 12, 13, 14, 15]
    assert samples[0].tokens.tolist() != samples[1].tokens.tolist()  # each observation went to its branch only


def test_budget_and_max_turns_end_branches(models):
    hf, ours = models
    whole = reference_branch(hf, PROMPT, SCRIPTS[1], 80, 5)
    # a budget that ends inside branch 1's first observation, after one of its 4 tokens
    budget = whole["mask"].index(False) + 1
    refs = [reference_branch(hf, PROMPT, script, budget, 5) for script in SCRIPTS]
    samples, envs = run(ours, budget, 5)
    assert_as_reference(samples, envs, refs)
    assert samples[1].finish_reason == "length" and samples[1].mask.tolist()[-2:] == [True, False]
    assert all(len(s.tokens) <= budget for s in samples)

    refs = [reference_branch(hf, PROMPT, script, 80, 1) for script in SCRIPTS]
    samples, envs = run(ours, 80, 1)
    assert_as_reference(samples, envs, refs)
    assert [s.finish_reason for s in samples] == ["turns"] * 3 and all(s.mask.all() for s in samples)


def test_first_turn_is_what_rollout_samples():
    """Sampled (tempered, top-k): each branch's first turn is the answer `rollout` draws with the same seed, and
    its sampler log-probs are rollout's."""
    model = tiny_model("qwen3_5_text")
    state = ls.capture(model, PROMPT, ls.EngineConfig(prompt_chunk=8))
    settings = ls.SamplingSettings(max_new_tokens=30, temperature=0.8, top_k=40, stop_ids=STOPS)
    draw = ls.Draw(n=3, seed=5, first_branch=2)
    singles = ls.rollout(model, state, settings, draw)
    envs = [ScriptedEnv(s) for s in SCRIPTS]
    for s, single, env in zip(rollout_turns(model, state, settings, draw, envs, max_turns=4), singles, envs):
        k = len(single.tokens)
        assert torch.equal(s.tokens[:k], single.tokens) and s.mask[:k].all()
        torch.testing.assert_close(s.sampler_logprobs[:k], single.sampler_logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(s.logprobs[:k], single.logprobs, atol=1e-5, rtol=0)
        if single.finish_reason == "stop":
            assert env.calls[0] == single.tokens.tolist()
    assert len({tuple(s.tokens.tolist()) for s in singles}) > 1


def test_routing_is_recorded_for_every_token():
    """MoE routing replay: a multi-turn sample's routing covers all its tokens, observations included, and its
    first turn's is what `rollout` records for the same answer."""
    torch.manual_seed(0)
    model = ls.build_model(GLM)
    state = ls.capture(model, PROMPT, ls.EngineConfig(prompt_chunk=8))
    settings = ls.SamplingSettings(max_new_tokens=24, temperature=1.0, stop_ids=STOPS, record_routing=True)
    draw = ls.Draw(n=3, seed=1)
    singles = ls.rollout(model, state, settings, draw)
    samples = rollout_turns(model, state, settings, draw, [ScriptedEnv(s) for s in SCRIPTS], max_turns=3)
    assert any(not s.mask.all() for s in samples)
    for s, single in zip(samples, singles):
        assert torch.equal(s.tokens[: len(single.tokens)], single.tokens)
        assert s.routing and s.routing.keys() == single.routing.keys()
        for layer, experts in s.routing.items():
            assert experts.shape == (len(s.tokens), GLM["num_experts_per_tok"])
            assert torch.equal(experts[: len(single.tokens)], single.routing[layer])


class BadEnv:
    def __init__(self, reply) -> None:
        self.reply = reply

    def step(self, tokens: list[int]) -> TurnReply:
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply


@pytest.mark.parametrize("reply,error,match", [
    (TurnReply([5, 500], done=False), ValueError,
     r"envs\[1\] \(BadEnv\) replied token ids \[500\] outside the model vocab \[0, 97\)"),
    (TurnReply([5, 2.5], done=False), ValueError, r"envs\[1\] \(BadEnv\) replied tokens that are not int token ids"),
    ([5, 6], ValueError, r"envs\[1\] \(BadEnv\) returned list from step\(\); it must return a TurnReply"),
    (OSError("disk full"), RuntimeError, r"envs\[1\] \(BadEnv\) raised OSError: disk full"),
])
def test_a_bad_reply_is_an_error_naming_the_env(reply, error, match):
    model = tiny_model()
    state = ls.capture(model, PROMPT)
    settings = ls.SamplingSettings(max_new_tokens=40, temperature=1.0, stop_ids=tuple(range(97)))  # every token
    with pytest.raises(error, match=match):
        rollout_turns(model, state, settings, ls.Draw(n=2, seed=0), [ScriptedEnv([[1], [2]]), BadEnv(reply)],
                      max_turns=3)


def test_bad_arguments():
    model = tiny_model()
    state = ls.capture(model, PROMPT)
    settings = ls.SamplingSettings(max_new_tokens=8, stop_ids=STOPS)
    envs = [ScriptedEnv([[1]])]
    with pytest.raises(ValueError, match="got 1 envs for 2 branches"):
        rollout_turns(model, state, settings, ls.Draw(n=2, seed=0), envs, max_turns=2)
    with pytest.raises(ValueError, match="needs settings.stop_ids"):
        rollout_turns(model, state, ls.SamplingSettings(max_new_tokens=8), ls.Draw(n=1, seed=0), envs, max_turns=2)
    with pytest.raises(ValueError, match="max_turns >= 1"):
        rollout_turns(model, state, settings, ls.Draw(n=1, seed=0), envs, max_turns=0)


# --- 2 ranks of a sequence-parallel group -------------------------------------------------------------------------


SAMPLED = ls.SamplingSettings(max_new_tokens=40, temperature=1.0, stop_ids=STOPS)


def _group_run(parallel=None) -> tuple[list[ls.Sample], list[ScriptedEnv]]:
    model = tiny_model("qwen3_5_text", dtype=torch.float64)
    kw = {} if parallel is None else {"parallel": parallel}
    state = ls.capture(model, PROMPT, ls.EngineConfig(prompt_chunk=8), **kw)
    envs = [ScriptedEnv(s) for s in SCRIPTS]
    return rollout_turns(model, state, SAMPLED, ls.Draw(n=3, seed=3), envs, max_turns=3, **kw), envs


def turns_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    from longstraw.parallel import SequenceParallel

    sp = SequenceParallel()
    samples, envs = _group_run(sp)
    out = {"calls": torch.tensor([len(e.calls) for e in envs])}
    for i, s in enumerate(samples):
        out |= {f"{i}.tokens": s.tokens, f"{i}.logprobs": s.logprobs, f"{i}.sampler": s.sampler_logprobs,
                f"{i}.mask": s.mask, f"{i}.turns": torch.tensor(s.turns),
                f"{i}.finish": torch.tensor(["stop", "length", "turns"].index(s.finish_reason))}
    model = tiny_model("qwen3_5_text", dtype=torch.float64)
    state = ls.capture(model, PROMPT, ls.EngineConfig(prompt_chunk=8), parallel=sp)
    try:  # a bad reply on rank 0 is the same error on every rank (none waits for the others in a collective)
        rollout_turns(model, state, SAMPLED, ls.Draw(n=1, seed=0), [BadEnv(TurnReply([97], done=False))],
                      max_turns=3, parallel=sp)
    except ValueError as e:
        out["bad_reply_named"] = torch.tensor("envs[0] (BadEnv) replied token ids [97]" in str(e))
    return out


def test_two_ranks_equal_one_rank_and_only_rank_0_calls_the_envs():
    want, envs = _group_run()
    assert any(not s.mask.all() for s in want) and any(s.finish_reason == "stop" for s in want)
    ranks = run_ranks(2, turns_rank, timeout=120)
    assert ranks[0]["calls"].tolist() == [len(e.calls) for e in envs] and sum(len(e.calls) for e in envs) > 0
    assert ranks[1]["calls"].tolist() == [0, 0, 0]
    for r in ranks:
        assert bool(r["bad_reply_named"])
        for i, s in enumerate(want):
            assert torch.equal(r[f"{i}.tokens"], s.tokens) and torch.equal(r[f"{i}.mask"], s.mask)
            assert int(r[f"{i}.turns"]) == s.turns
            assert ["stop", "length", "turns"][int(r[f"{i}.finish"])] == s.finish_reason
            torch.testing.assert_close(r[f"{i}.logprobs"], s.logprobs, atol=1e-9, rtol=0)
            torch.testing.assert_close(r[f"{i}.sampler"], s.sampler_logprobs, atol=1e-9, rtol=0, equal_nan=True)


def slice_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Each rank a sequence-parallel group of its own, sampling its slice of the branches under ZeRO-3: every
    step's forward gathers the layers from both ranks, so the slices decode in step until both have ended."""
    from longstraw.parallel import shard_model
    from tests.parallel.test_zero import _sp

    sp = _sp(world, dp=world)
    model = tiny_model("qwen3_5_text", dtype=torch.float64)
    shard_model(model, 3, sp)
    state = ls.capture(model, PROMPT, ls.EngineConfig(prompt_chunk=8), parallel=sp)
    env = ScriptedEnv(SCRIPTS[sp.dp_rank])
    s = rollout_turns(model, state, SAMPLED, ls.Draw(n=1, seed=3, first_branch=sp.dp_rank), [env], max_turns=3,
                      parallel=sp)[0]
    return {"tokens": s.tokens, "mask": s.mask, "logprobs": s.logprobs, "calls": torch.tensor(len(env.calls))}


def test_data_parallel_slices_equal_one_process():
    model = tiny_model("qwen3_5_text", dtype=torch.float64)
    state = ls.capture(model, PROMPT, ls.EngineConfig(prompt_chunk=8))
    envs = [ScriptedEnv(s) for s in SCRIPTS[:2]]
    want = rollout_turns(model, state, SAMPLED, ls.Draw(n=2, seed=3), envs, max_turns=3)
    assert len(want[0].tokens) != len(want[1].tokens)  # the slices end at different steps
    for got, s, env in zip(run_ranks(2, slice_rank, timeout=120), want, envs, strict=True):
        assert torch.equal(got["tokens"], s.tokens) and torch.equal(got["mask"], s.mask)
        torch.testing.assert_close(got["logprobs"], s.logprobs, atol=1e-9, rtol=0)
        assert int(got["calls"]) == len(env.calls) > 0  # each group's rank 0 called its own env
