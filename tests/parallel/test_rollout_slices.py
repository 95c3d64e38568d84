"""Rollout split over data-parallel groups under ZeRO-3: each group samples its slice of the branches
(`first_branch`), and the slices end at different steps. Every decode step's forward gathers each layer's
parameters from every rank, so the groups must agree on when all branches have stopped; the samples equal one
process sampling all branches with the unsharded model, and the worker's gather of the slices (`gather_samples`)
puts them, their log-probs and sampler log-probs in branch order on every rank."""

from __future__ import annotations

import torch

import longstraw as ls
from longstraw.parallel import shard_model
from longstraw.train.answers import gather_samples
from longstraw.train.spmd import Ranks
from tests.conftest import tiny_model
from tests.parallel.launch import run_ranks
from tests.parallel.test_zero import _sp

STOPS = list(range(0, 97, 3))  # a third of the vocab ends a branch: slices stop after a few tokens, at random
# tempered and filtered: the sampler's log-probs differ from the temperature-1 ones
SETTINGS = ls.SamplingSettings(max_new_tokens=24, temperature=0.8, top_k=40, stop_ids=STOPS)
EVERY_STEP = ls.DecodeOptions(stop_check_every=1)


def _setup():
    model = tiny_model("qwen3")
    prompt = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(4))
    return model, prompt


def slice_rank(rank: int, world: int, seed: int) -> dict[str, torch.Tensor]:
    sp = _sp(world, dp=world)  # every rank its own sequence-parallel group of 1: `world` data-parallel groups
    model, prompt = _setup()
    shard_model(model, 3, sp)
    state = ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=16), parallel=sp)
    sample = ls.rollout(model, state, SETTINGS, ls.Draw(n=1, seed=seed, first_branch=sp.dp_rank), parallel=sp,
                        decode=EVERY_STEP)[0]
    gathered = gather_samples(Ranks(sp, None, rank, world), [sample])
    out = {"tokens": sample.tokens, "logprobs": sample.logprobs, "sampler_logprobs": sample.sampler_logprobs}
    for i, s in enumerate(gathered):
        out |= {f"gathered.{i}.tokens": s.tokens, f"gathered.{i}.logprobs": s.logprobs,
                f"gathered.{i}.sampler_logprobs": s.sampler_logprobs,
                f"gathered.{i}.stopped": torch.tensor(s.finish_reason == "stop")}
    return out


def test_slices_that_stop_apart_under_zero3_equal_one_process():
    model, prompt = _setup()
    state = ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=16))
    # a seed whose two branches stop at different steps (the case where a group would stop decoding alone)
    runs = ((s, ls.rollout(model, state, SETTINGS, ls.Draw(n=2, seed=s), decode=EVERY_STEP)) for s in range(50))
    seed, whole = next((s, w) for s, w in runs if len(w[0].tokens) != len(w[1].tokens))
    ranks = run_ranks(2, slice_rank, seed, timeout=120)
    for got, want in zip(ranks, whole, strict=True):
        assert torch.equal(got["tokens"], want.tokens)
        torch.testing.assert_close(got["logprobs"], want.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(got["sampler_logprobs"], want.sampler_logprobs, atol=1e-5, rtol=0)
    assert not torch.allclose(whole[0].sampler_logprobs, whole[0].logprobs)
    for got in ranks:  # every rank holds every slice, in branch order, exactly as its rank sampled it
        assert sorted({k.split(".")[1] for k in got if k.startswith("gathered.")}) == ["0", "1"]
        for i, mine in enumerate(ranks):
            for field in ("tokens", "logprobs", "sampler_logprobs"):
                assert torch.equal(got[f"gathered.{i}.{field}"], mine[field])
            assert bool(got[f"gathered.{i}.stopped"]) == (int(mine["tokens"][-1]) in STOPS)
