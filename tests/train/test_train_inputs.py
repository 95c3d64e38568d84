"""What a step needs besides the model (inputs.py: preflight checks, the reward, the prompt of a step) and the pieces
the ops share (the optimizer step, the lr schedule, the config's checks)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from longstraw.data.tokenizer import load_tokenizer
from longstraw.train import inputs
from longstraw.train.config import TrainConfig
from longstraw.train.data import step_example
from longstraw.train.optim import build_optimizer, lr_at
from tests.conftest import tiny_config, tiny_model


def make_cfg(tmp_path, model_type="qwen3", **kw) -> TrainConfig:
    model = tiny_config(model_type, vocab_size=260, max_position_embeddings=1024)
    base = dict(model={"random": model}, prompt_tokens=256, groups=1, responses=4, max_new_tokens=5,
                engine={"prompt_chunk": 96}, run_dir=str(tmp_path / "run"), optim={"lr": 1e-3})
    return TrainConfig.model_validate(base | kw)


def test_non_finite_updates_are_skipped_or_refused():
    """A non-finite gradient norm skips the update (weights and moments untouched, said in a warning and in
    `skipped`); a step that makes weights non-finite raises before anything is committed; lr: inf does not
    validate."""
    from pydantic import ValidationError

    from longstraw.train.config import OptimConfig
    from longstraw.train.optim import optimizer_step

    with pytest.raises(ValidationError, match="finite"):
        OptimConfig(lr=float("inf"))
    model = tiny_model("qwen3")
    cfg = OptimConfig(lr=1e-3)
    opt = build_optimizer(model, cfg)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    next(model.parameters()).grad[0, 0] = float("nan")
    with pytest.warns(UserWarning, match="skipped the update"):
        out = optimizer_step(model, opt, cfg, 0, 1)
    assert out["skipped"] == 1.0 and not math.isfinite(out["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state
    assert all(p.grad is None for p in model.parameters())
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    huge = OptimConfig(lr=1e33, grad_clip=None, weight_decay=0.0)
    big = build_optimizer(model, huge)
    with torch.no_grad():
        next(model.parameters()).fill_(-torch.finfo(torch.float32).max)  # the update (-lr x sign(grad)) pushes it past float32's range
    with pytest.raises(FloatingPointError, match="made .* weights non-finite"):
        optimizer_step(model, big, huge, 0, 1)

@pytest.mark.parametrize("kw,match", [
    (dict(reward="math:pi"), "is a float, not a function"),
    (dict(reward="no_such_reward"), "unknown reward 'no_such_reward'"),
    (dict(task="kv-retreival"), "unknown task 'kv-retreival'"),
    (dict(task_options={"key_char": 3}), r"task_options \['key_char'\] are not options of task 'kv-retrieval'; "
                                          "its options: key_chars, value_digits"),
    (dict(prompt_tokens=1020), "exceeds the model's 1,024 positions; extend them with RoPE scaling"),
])
def test_preflight_fails_before_any_work(tmp_path, kw, match):
    cfg = make_cfg(tmp_path, **kw)
    with pytest.raises(ValueError, match=match):
        inputs.preflight(cfg)
    assert not (tmp_path / "run").exists()
    inputs.preflight(make_cfg(tmp_path))  # the base config passes

def test_a_long_prompt_gets_the_advice_that_shortens_it(tmp_path):
    # prompt_tokens sizes a generated task; it cannot shorten a dataset's prompts
    with pytest.raises(ValueError, match=r"\(prompt_tokens 1020 and the chat template\).*; or lower prompt_tokens$"):
        inputs.preflight(make_cfg(tmp_path, prompt_tokens=1020))
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "x " * 600, "answer": "1"}) + "\n")
    with pytest.raises(ValueError) as e:
        inputs.preflight(make_cfg(tmp_path, task=None, dataset=str(data), reward="exact_match"))
    msg = str(e.value)
    assert f"the first example of {data}" in msg and msg.endswith("; or shorten the dataset's prompts")
    assert "prompt_tokens" not in msg


def test_lr_schedule():
    from longstraw.train.config import OptimConfig

    cfg = OptimConfig(lr=1.0, warmup_updates=2, schedule="cosine", min_lr_ratio=0.1)
    lrs = [lr_at(u, 6, cfg) for u in range(6)]
    assert lrs[:2] == [0.5, 1.0]
    assert lrs[2] == pytest.approx(1.0) and lrs[-1] < lrs[3] < lrs[2]
    assert lr_at(6, 6, cfg) == pytest.approx(0.1)
    assert lr_at(4, 6, OptimConfig(lr=1.0, schedule="linear")) == pytest.approx(1 / 3)

def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="exactly one of `task`"):
        TrainConfig.model_validate({"model": {"random": {"model_type": "qwen3"}}, "task": None})
    with pytest.raises(ValueError, match="needs a `reward`"):
        TrainConfig.model_validate({"model": {"random": {"model_type": "qwen3"}}, "task": None, "dataset": "x.jsonl"})
    with pytest.raises(ValueError, match="stepz"):
        TrainConfig.model_validate({"model": {"random": {"model_type": "qwen3"}}, "stepz": 3})

def test_task_pool_cycles_through_a_fixed_set_of_prompts(tmp_path):
    tok = load_tokenizer("byte")
    cfg = make_cfg(tmp_path, groups=3, task_pool=6)
    prompts = [[step_example(cfg, tok, s, g).prompt for g in range(3)] for s in range(4)]
    assert prompts[2] == prompts[0] and prompts[3] == prompts[1] and prompts[1] != prompts[0]
    assert len({p for row in prompts for p in row}) == 6
    fresh = make_cfg(tmp_path, groups=3)
    assert step_example(fresh, tok, 2, 0).prompt != step_example(fresh, tok, 0, 0).prompt
