"""longstraw sft: a short run trains, measures reward with the task verifier, and writes a loadable checkpoint."""

import json

import torch

import longstraw as ls
import pytest

from longstraw.train.sft import SFTConfig, _batch, encode, prompt_length, run_sft
from longstraw.problems import make_problem
from longstraw.data.tokenizer import ByteTokenizer
from tests.conftest import tiny_config


def test_batch_masks_everything_but_the_answer():
    tok = ByteTokenizer()
    pairs = [encode(tok, make_problem("kv-retrieval", s, 220, tok)) for s in (1, 2)]
    inputs, targets = _batch(pairs, tok.pad_id)
    for (p, a), row, tgt in zip(pairs, inputs, targets):
        assert row[: len(p)].tolist() == p
        assert tgt[len(p) - 1 : len(p) - 1 + len(a)].tolist() == a  # position t predicts token t+1
        assert (tgt[: len(p) - 1] == -100).all() and (tgt[len(p) - 1 + len(a) :] == -100).all()
        assert a[-1] == tok.eos_id


def test_short_run_lowers_loss_and_writes_checkpoint(tmp_path):
    cfg = SFTConfig(
        model={"random": tiny_config("qwen3", vocab_size=300, max_position_embeddings=1024)},
        prompt_tokens=220, steps=30, batch=4, lr=3e-3, warmup=5, eval_examples=2, out=str(tmp_path / "ckpt"),
    )
    r = run_sft(cfg, progress=False)
    assert 0.0 <= r["reward_before"] <= 1.0 and 0.0 <= r["reward_after"] <= 1.0
    assert r["final_loss"] < 3.0  # from ~ln(300) = 5.7 at init: answers are digits and eos
    model = ls.load_model(r["checkpoint"])
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["vocab_size"] == 300
    ids = torch.randint(0, 300, (1, 12))
    assert torch.isfinite(model(ids)).all()
    assert not list(tmp_path.glob(".ckpt.*"))  # no temporary directory left behind


def test_curriculum_stages_then_prompt_tokens():
    stages = [(190, 0.3), (200, 0.2)]
    lengths = [prompt_length(s, 10, 256, stages) for s in range(10)]
    assert lengths == [190] * 3 + [200] * 2 + [256] * 5
    assert prompt_length(0, 10, 256, []) == 256
    base = {"model": {"random": tiny_config("qwen3")}}
    with pytest.raises(ValueError, match="curriculum"):
        SFTConfig(**base, curriculum=[(190, 0.6), (200, 0.4)])  # no steps left at prompt_tokens
    with pytest.raises(ValueError, match="unknown task"):
        SFTConfig(**base, per_task={"nope": {"prompt_tokens": 300}})


def test_per_task_settings_and_options_reach_the_task(tmp_path):
    cfg = SFTConfig(
        model={"random": tiny_config("qwen3", vocab_size=300, max_position_embeddings=1024)},
        prompt_tokens=220, task_options={"key_chars": 2, "value_digits": 2}, curriculum=[(200, 0.5)],
        per_task={"needle-count": {"prompt_tokens": 320, "curriculum": []}},
        steps=4, batch=2, warmup=1, eval_examples=2, out=str(tmp_path / "ckpt"),
    )
    assert cfg.settings() == (220, [(200, 0.5)], {"key_chars": 2, "value_digits": 2})
    r = run_sft(cfg, progress=False)
    assert r["task_options"] == {"key_chars": 2, "value_digits": 2} and r["prompt_tokens"] == 220
    needle = cfg.model_copy(update={"task": "needle-count"})
    assert needle.settings() == (320, [], {})  # kv-retrieval's options are not passed to needle-count
