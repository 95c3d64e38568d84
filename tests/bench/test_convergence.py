"""The convergence study as an end-to-end check of exactness: GRPO training in `naive` and `exact` mode from the
same seed gives the same run (sampled answers, rewards, weights) up to float rounding; `detached` does not. Its
gradient-fidelity sweep runs (one prompt, in seconds)."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import longstraw as ls
from longstraw.data import load_tokenizer
from longstraw.problems import make_problem
from longstraw.train.config import OptimConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from convergence import GROUPS, PLANS, RunConfig, TaskSpec, sweep, train_run  # noqa: E402

TINY = dict(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
MODELS = {
    "dense": dict(TINY, model_type="qwen3"),
    # one Gated DeltaNet layer + one gated attention layer: the recurrent state's prompt path is checked too
    "qwen3_5": dict(TINY, model_type="qwen3_5_text", layer_types=["linear_attention", "full_attention"],
                    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_conv_kernel_dim=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}


def byte_sum(meta: dict, text: str) -> float:
    """A reward that varies over a random model's answers (the task's own would be 0 for all of them)."""
    return (sum(text.encode()) % 7) / 6


def run(model, mode: str, steps: int = 3):
    tok = load_tokenizer("byte")
    pool = [make_problem("kv-retrieval", 100 + i, 190, tok) for i in range(2)]
    held = [make_problem("kv-retrieval", 200, 190, tok)]
    cfg = RunConfig(mode=mode, steps=steps, seed=3, responses=4, eval_every=2,
                    optim=OptimConfig(lr=1e-2, grad_clip=1.0, warmup_updates=1),
                    engine=ls.EngineConfig(prompt_chunk=64, prompt_graph_budget=0))  # chunks recomputed, as at scale
    history = train_run(model, tok, pool, held, TaskSpec(byte_sum, byte_sum, 6), cfg, progress=False)
    return history, model


@pytest.mark.parametrize("family", sorted(MODELS))
def test_naive_and_exact_train_alike_detached_does_not(family):
    torch.manual_seed(0)
    base = ls.build_model(MODELS[family], dtype=torch.float64)
    runs = {m: run(copy.deepcopy(base), m) for m in ("naive", "exact", "detached")}
    (naive, wn), (exact, we), (detached, wd) = runs["naive"], runs["exact"], runs["detached"]

    for a, b in zip(naive, exact):  # the same answers sampled, hence the same rewards, at every step
        assert a.get("tokens_sha256") == b.get("tokens_sha256")
        for key in ("reward_mean", "accuracy"):
            assert a.get(key) == b.get(key)
        for key in ("grad_norm", "cos", "rel_l2"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12)
        assert a.get("grad_vs_probe", 0.0) < 1e-10  # naive's gradient is exact's
    # AdamW divides by the root of the second moment, so a weight whose gradient is ~0 moves by rounding noise
    # of its own size: the weights agree to 1e-9 (lr 1e-2), the gradients to 1e-10 relative (above)
    with torch.no_grad():
        for (name, p), q in zip(wn.named_parameters(), we.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
        moved = max(float((p - q).abs().max()) for p, q in zip(we.parameters(), base.parameters()))
        differ = max(float((p - q).abs().max()) for p, q in zip(wd.parameters(), we.parameters()))
    assert moved > 1e-4  # the runs trained

    # the detached gradient really differs, so the test can fail: it loses part of the gradient
    steps = [h for h in exact if "cos" in h]
    assert steps and all(h["rel_l2"] > 1e-3 for h in steps)
    assert set(steps[0]["groups"]) <= set(GROUPS)
    # and the replay part of exact mode, which the study compares with, is what detached mode steps with
    assert all(h.get("grad_vs_probe", 0.0) < 1e-10 for h in detached)
    assert differ > 1e-6


def test_sweep_compares_the_exact_and_detached_gradients():
    """The sweep once called `exact_and_detached` with an older signature's arguments, and no test ran it."""
    plan = dataclasses.replace(PLANS["quick"], sweep_tokens=(205,), sweep_prompts=1)
    rows = sweep("dense", "kv-retrieval", None, plan, load_tokenizer("byte"), False)
    assert len(rows) == 1 and rows[0]["prompt_tokens"] == 205
    row = rows[0]
    # detaching the prompt drops part of the gradient: not the same direction, not the same norm
    assert -1.0 <= row["cos"] < 0.999 and row["rel_l2"] > 1e-3 and row["norm_ratio"] > 0
