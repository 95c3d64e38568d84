"""The library stages of a step, run by hand (no Prefect): their gradients equal `grpo_backward`'s naive mode,
the optimizer stage equals a hand-written AdamW step, and what they store is verified when read."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import longstraw as ls
from longstraw.train import stages
from longstraw.grpo.rewards import get_reward
from longstraw.train.artifacts import load_json, load_tensors, save_json
from longstraw.train.checkpoint import load_checkpoint, read_trainer
from longstraw.train.config import TrainConfig
from longstraw.train.data import prompt_ids, step_example
from longstraw.train.optim import build_optimizer, lr_at
from longstraw.data.tokenizer import load_tokenizer
from tests.conftest import flat_grad, rel_err, tiny_config, tiny_model

ADV = [1.0, -0.5, 0.7, -1.2]


def make_cfg(tmp_path, model_type="qwen3", **kw) -> TrainConfig:
    model = tiny_config(model_type, vocab_size=260, max_position_embeddings=1024)
    base = dict(model={"random": model}, prompt_tokens=256, groups=1, responses=4, max_new_tokens=5,
                grpo={"prompt_chunk": 96}, run_dir=str(tmp_path / "run"), optim={"lr": 1e-3})
    return TrainConfig.model_validate(base | kw)


def step_group(cfg: TrainConfig) -> tuple[dict, dict, dict, dict]:
    """init -> capture -> rollout, and a reward record with fixed, non-zero advantages."""
    init = stages.init_run(cfg)
    cap = stages.capture_stage(cfg, init["checkpoint"], step=0, group=0, epoch=0)
    roll = stages.rollout_stage(cfg, init["checkpoint"], cap["url"], step=0, group=0)
    path = cfg.paths().step(0) / "rewards-fixed.json"
    rew = {"path": str(path), "sha256": save_json(path, {"advantages": ADV})}
    return init, cap, {"path": roll["path"], "sha256": roll["sha256"]}, rew


def summed_param_grads(model, refs) -> torch.Tensor:
    params = dict(model.named_parameters())
    for p in params.values():
        p.grad = None
    for r in refs:
        for k, g in load_tensors(r["path"], r["sha256"]).items():
            if k.startswith("param."):
                p = params[k[6:]]
                p.grad = g.clone() if p.grad is None else p.grad + g
    return flat_grad(model)


def reference_grad(cfg, init, roll, mode) -> torch.Tensor:
    """grpo_backward in one call on the same prompt, responses and advantages."""
    model = ls.load_model(init["checkpoint"])
    tok = load_tokenizer(cfg.tokenizer)
    prompt = prompt_ids(tok, step_example(cfg, tok, 0, 0))
    responses, _, _ = stages.load_rollout(cfg, roll)
    model.zero_grad(set_to_none=True)
    ls.grpo_backward(model, prompt, responses, ADV, mode=mode, config=cfg.grpo)
    return flat_grad(model)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_exact_stages_equal_naive(tmp_path, model_type):
    cfg = make_cfg(tmp_path, model_type)
    init, cap, roll, rew = step_group(cfg)
    # uneven slices of branches, as separate replay tasks would take them
    replays = [stages.replay_stage(cfg, init["checkpoint"], cap["url"], roll, rew, None, 0, 0, 0, b)
               for b in ([0, 1], [2], [3])]
    prompt = stages.prompt_stage(cfg, init["checkpoint"], cap["url"], replays, 0, 0, 0)
    got = summed_param_grads(ls.load_model(init["checkpoint"]), replays + [prompt])
    want = reference_grad(cfg, init, roll, "naive")
    assert want.norm() > 0
    assert rel_err(got, want) <= 1e-5
    # the replays alone are the detached gradient, which differs from naive: the prompt stage is not a no-op
    assert rel_err(summed_param_grads(ls.load_model(init["checkpoint"]), replays), want) > 1e-2


def test_detached_and_naive_modes(tmp_path):
    for mode in ("detached", "naive"):
        cfg = make_cfg(tmp_path / mode, mode=mode)
        init, cap, roll, rew = step_group(cfg)
        replays = [stages.replay_stage(cfg, init["checkpoint"], cap["url"], roll, rew, None, 0, 0, 0, b)
                   for b in ([0, 2], [1, 3])]
        got = summed_param_grads(ls.load_model(init["checkpoint"]), replays)
        assert rel_err(got, reference_grad(cfg, init, roll, mode)) <= 1e-5, mode


def test_optimizer_stage_is_one_adamw_step(tmp_path):
    cfg = make_cfg(tmp_path, optim={"lr": 1e-3, "grad_clip": 0.05, "weight_decay": 0.1})
    init, cap, roll, rew = step_group(cfg)
    replays = [stages.replay_stage(cfg, init["checkpoint"], cap["url"], roll, rew, None, 0, 0, 0, [0, 1, 2, 3])]
    prompt = stages.prompt_stage(cfg, init["checkpoint"], cap["url"], replays, 0, 0, 0)
    out = stages.optimizer_stage(cfg, init["checkpoint"], replays + [prompt], update=0, step=0)

    model = ls.load_model(init["checkpoint"])
    summed_param_grads(model, replays + [prompt])
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    opt.step()
    assert out["grad_norm"] == pytest.approx(float(norm), rel=1e-6)
    assert out["grad_norm"] > 0.05  # the clip was active
    new = ls.load_model(out["checkpoint"])
    for (n, p), q in zip(model.named_parameters(), new.parameters()):
        assert torch.equal(p, q), n
    assert read_trainer(out["checkpoint"])["update"] == 1
    # optimizer moments come back with the checkpoint
    _, reloaded, _ = load_checkpoint(out["checkpoint"], lambda m: build_optimizer(m, cfg.optim))
    want = [opt.state[p]["exp_avg_sq"] for p in model.parameters()]
    got = [reloaded.state[p]["exp_avg_sq"] for p in reloaded.param_groups[0]["params"]]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_corrupted_artefacts_are_refused(tmp_path):
    cfg = make_cfg(tmp_path)
    init, cap, roll, rew = step_group(cfg)
    shard = Path(roll["path"]) / "tokens" / "c" / "0"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="rollout at .* is corrupted"):
        stages.replay_stage(cfg, init["checkpoint"], cap["url"], roll, rew, None, 0, 0, 0, [0])
    weights = tmp_path / "run" / "checkpoints" / "update-000000" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors does not match"):
        stages.capture_stage(cfg, init["checkpoint"], step=0, group=0, epoch=0)


def test_the_prompt_is_made_once_per_step(tmp_path, monkeypatch):
    """The capture stage makes the example; the state stores it, the rollout carries it to the reward, which
    scores with it instead of making the prompt again."""
    cfg = make_cfg(tmp_path)
    made = []
    real = stages.step_example
    monkeypatch.setattr(stages, "step_example", lambda *a: made.append(a[2:]) or real(*a))
    init = stages.init_run(cfg)
    cap = stages.capture_stage(cfg, init["checkpoint"], step=0, group=0, epoch=0)
    roll = stages.rollout_stage(cfg, init["checkpoint"], {"url": cap["url"], "sha256": cap["sha256"]}, 0, 0)
    rew = stages.reward_stage(cfg, roll, 0, 0)
    assert made == [(0, 0)]
    ex = real(cfg, load_tokenizer(cfg.tokenizer), 0, 0)
    texts = json.loads((Path(roll["path"]) / "manifest.json").read_text())["meta"]["texts"]
    fn = get_reward(cfg.task)
    assert load_json(rew["path"], rew["sha256"])["rewards"] == [fn(ex.meta | {"answer": ex.answer}, t) for t in texts]


def test_edited_manifests_are_refused(tmp_path):
    """A manifest's own fields (a state's chunks, a rollout's texts) are covered by the digest a stage hands on:
    an edit is refused by the next stage, as corruption it can recompute."""
    from longstraw.files import CorruptArtefact

    cfg = make_cfg(tmp_path)
    init, cap, roll, rew = step_group(cfg)
    state = {"url": cap["url"], "sha256": cap["sha256"]}
    stages.replay_stage(cfg, init["checkpoint"], state, roll, rew, None, 0, 0, 0, [0])  # as written: fine
    for path, edit in ((Path(roll["path"]) / "manifest.json", lambda m: m["meta"]["texts"].reverse()),
                       (Path(cap["url"]) / "manifest.json", lambda m: m["chunks"].pop())):
        manifest = json.loads(path.read_text())
        edit(manifest)
        path.write_text(json.dumps(manifest))
    with pytest.raises(CorruptArtefact, match="rollout at .* is not the one this stage was given"):
        stages.reward_stage(cfg, roll, 0, 0)
    with pytest.raises(CorruptArtefact, match="prefix state at .* is not the one this stage was given"):
        stages.prompt_stage(cfg, init["checkpoint"], state, [], 0, 0, 0)


def test_state_from_other_weights_is_refused(tmp_path):
    cfg = make_cfg(tmp_path)
    init, cap, roll, rew = step_group(cfg)
    replays = [stages.replay_stage(cfg, init["checkpoint"], cap["url"], roll, rew, None, 0, 0, 0, [0, 1, 2, 3])]
    out = stages.optimizer_stage(cfg, init["checkpoint"], replays, update=0, step=0)
    with pytest.raises(ValueError, match="weights"):  # the state was captured with the update-0 weights
        stages.replay_stage(cfg, out["checkpoint"], cap["url"], roll, rew, None, 0, 0, 0, [0])


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
    (dict(prompt_tokens=1020), "exceeds the model's max_position_embeddings 1024"),
])
def test_preflight_fails_before_any_work(tmp_path, kw, match):
    cfg = make_cfg(tmp_path, **kw)
    with pytest.raises(ValueError, match=match):
        stages.preflight(cfg)
    assert not (tmp_path / "run").exists()
    stages.preflight(make_cfg(tmp_path))  # the base config passes


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


def test_second_epoch_replays_against_the_rollout_logprobs(tmp_path):
    """epochs > 1: the ratio's denominator is the sampling log-prob from the rollout, so after one update the
    replay clips, and its gradient equals naive grpo_backward given those old log-probs."""
    cfg = make_cfg(tmp_path, epochs=2, optim={"lr": 0.05, "grad_clip": None}, grpo={"prompt_chunk": 96, "clip_low": 0.02, "clip_high": 0.02})
    init, cap, roll, rew = step_group(cfg)
    r0 = [stages.replay_stage(cfg, init["checkpoint"], cap["url"], roll, rew, None, 0, 0, 0, [0, 1, 2, 3])]
    p0 = stages.prompt_stage(cfg, init["checkpoint"], cap["url"], r0, 0, 0, 0)
    assert r0[0]["clipped_tokens"] == 0  # same weights as the sampler: ratios are 1 up to rounding
    ckpt1 = stages.optimizer_stage(cfg, init["checkpoint"], r0 + [p0], update=0, step=0)["checkpoint"]
    cap1 = stages.capture_stage(cfg, ckpt1, step=0, group=0, epoch=1)
    r1 = [stages.replay_stage(cfg, ckpt1, cap1["url"], roll, rew, None, 0, 0, 1, [0, 1, 2, 3])]
    p1 = stages.prompt_stage(cfg, ckpt1, cap1["url"], r1, 0, 0, 1)
    assert r1[0]["clipped_tokens"] > 0
    got = summed_param_grads(ls.load_model(ckpt1), r1 + [p1])

    model = ls.load_model(ckpt1)
    tok = load_tokenizer(cfg.tokenizer)
    responses, old, _ = stages.load_rollout(cfg, roll)
    ls.grpo_backward(model, prompt_ids(tok, step_example(cfg, tok, 0, 0)), responses, ADV, mode="naive",
                     old_logprobs=old, config=cfg.grpo)
    assert rel_err(got, flat_grad(model)) <= 1e-5


def test_task_pool_cycles_through_a_fixed_set_of_prompts(tmp_path):
    tok = load_tokenizer("byte")
    cfg = make_cfg(tmp_path, groups=3, task_pool=6)
    prompts = [[step_example(cfg, tok, s, g).prompt for g in range(3)] for s in range(4)]
    assert prompts[2] == prompts[0] and prompts[3] == prompts[1] and prompts[1] != prompts[0]
    assert len({p for row in prompts for p in row}) == 6
    fresh = make_cfg(tmp_path, groups=3)
    assert step_example(fresh, tok, 2, 0).prompt != step_example(fresh, tok, 0, 0).prompt
