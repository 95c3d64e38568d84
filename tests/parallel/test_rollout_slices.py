"""Rollout split over data-parallel groups under ZeRO-3: each group samples its slice of the branches
(`first_branch`), and the slices end at different steps. Every decode step's forward gathers each layer's
parameters from every rank, so the groups must agree on when all branches have stopped; the samples equal one
process sampling all branches with the unsharded model."""

from __future__ import annotations

import torch

import longstraw as ls
from longstraw.parallel import shard_model
from tests.conftest import tiny_model
from tests.parallel.launch import run_ranks
from tests.parallel.test_zero import _sp

STOPS = list(range(0, 97, 3))  # a third of the vocab ends a branch: slices stop after a few tokens, at random
KW = dict(n=1, max_new_tokens=24, temperature=1.0, stop_ids=STOPS, stop_check_every=1)


def _setup():
    model = tiny_model("qwen3")
    prompt = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(4))
    return model, prompt


def slice_rank(rank: int, world: int, seed: int) -> dict[str, torch.Tensor]:
    sp = _sp(world, dp=world)  # every rank its own sequence-parallel group of 1: `world` data-parallel groups
    model, prompt = _setup()
    shard_model(model, 3, sp)
    state = ls.capture(model, prompt, 16, parallel=sp)
    sample = ls.rollout(model, state, seed=seed, first_branch=sp.dp_rank, parallel=sp, **KW)[0]
    return {"tokens": sample.tokens, "logprobs": sample.logprobs}


def test_slices_that_stop_apart_under_zero3_equal_one_process():
    model, prompt = _setup()
    state = ls.capture(model, prompt, 16)
    # a seed whose two branches stop at different steps (the case where a group would stop decoding alone)
    runs = ((s, ls.rollout(model, state, seed=s, **KW | {"n": 2})) for s in range(50))
    seed, whole = next((s, w) for s, w in runs if len(w[0].tokens) != len(w[1].tokens))
    ranks = run_ranks(2, slice_rank, seed, timeout=120)
    for got, want in zip(ranks, whole, strict=True):
        assert torch.equal(got["tokens"], want.tokens)
        torch.testing.assert_close(got["logprobs"], want.logprobs, atol=1e-5, rtol=0)
