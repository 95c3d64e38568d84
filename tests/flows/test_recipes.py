"""The recipes in configs/ (GSPO, CISPO) run through `longstraw train`: each inherits train-tiny.yaml through
`base:`, and one step of it on a tiny random model (in place of the warm start) updates the weights with its loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flows.cli import main
from longstraw.config import load_config, read_yaml
from longstraw.train.config import TrainConfig
from tests.conftest import tiny_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("recipe,loss", [("gspo-tiny.yaml", {"importance_sampling_level": "sequence"}),
                                         ("cispo-tiny.yaml", {"loss_type": "cispo", "clip_high": 5.0})])
def test_recipe_runs_through_longstraw_train(recipe, loss, tmp_path, capsys):
    cfg = load_config(CONFIGS / recipe, TrainConfig)
    assert cfg.grpo.model_dump() | loss == cfg.grpo.model_dump()
    assert cfg.task == load_config(CONFIGS / "train-tiny.yaml", TrainConfig).task  # inherited from the base
    run_dir = tmp_path / "run"
    override = {"base": str(CONFIGS / recipe), "run_dir": str(run_dir), "steps": 1, "groups": 1, "responses": 4,
                "task_pool": 1, "max_new_tokens": 4, "reward": "tests.flows.rewards:digit_share", "engine": {"prompt_chunk": 64},
                "model": {"path": None, "random": tiny_config("qwen3", vocab_size=260, max_position_embeddings=512)},
                "pipeline": {"retries": 0, "branches_per_task": 2}}
    if recipe.startswith("cispo"):  # a random model rarely stops within 4 tokens: every answer would be masked
        override["grpo"] = {"mask_truncated_completions": False}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(override))
    assert main(["train", "--config", str(path), "--no-progress"]) == 0, capsys.readouterr().err
    history = json.loads((run_dir / "history.json").read_text())
    step = history[0]
    assert len(history) == 1 and step["reward_std"] > 0
    if recipe.startswith("gspo"):  # the second update is off-policy: GSPO's narrow sequence clip catches it
        assert step["clip_frac"] > 0
    else:  # CISPO never clips a gradient away; its sampler comparison reaches the step's metrics
        assert step["grad_norm"] > 0 and "correction_weight_mean" in step


def test_a_base_that_includes_itself_is_refused(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("base: b.yaml\n")
    b.write_text("base: a.yaml\n")
    with pytest.raises(ValueError, match="includes itself"):
        read_yaml(a)


def test_every_option_through_longstraw_train_on_two_ranks_equals_one(tmp_path):
    """One YAML turning on every kind of loss option (sequence ratio, delta, bias-corrected KL against the
    reference model, off-policy mask, top-entropy mask and bonus, sampler correction, two weighted rewards with batch
    scaling, two updates per rollout) through `longstraw train` on 2 gloo ranks (sequence-parallel: the state
    sharded, each rank replaying its share of the branches) and on 1: the same weights (float64)."""
    import torch
    from safetensors.torch import load_file

    from tests.flows.test_ranks import _cli
    from tests.flows.test_train_flow import config

    grpo = {"loss_type": "dapo", "importance_sampling_level": "sequence", "delta": 1.5, "kl_coef": 0.05,
            "use_bias_correction_kl": True, "off_policy_mask_threshold": 0.01, "top_entropy_quantile": 0.5,
            "entropy_coef": 0.01, "rollout_correction": "token_truncate", "rollout_correction_min": 0.5,
            "rollout_correction_max": 2.0, "scale_rewards": "batch", "reward_weights": [1.0, 0.5]}
    finals = {}
    for ranks in (1, 2):
        name = f"ranks{ranks}"
        cfg = config(tmp_path / name, dtype="float64", threads=1, steps=1, groups=2, epochs=2, grpo=grpo,
                     reward=["tests.flows.rewards:digit_share", "tests.flows.rewards:letter_share"])
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        done = _cli(["train", "--config", str(path), "--nproc", str(ranks)], tmp_path)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        history = json.loads((tmp_path / name / "history.json").read_text())
        assert 0 < history[0]["entropy_kept_frac"] < 1 and history[0]["kl"] > 0, history[0]
        finals[ranks] = load_file(str(tmp_path / name / "checkpoints" / "update-000002" / "model.safetensors"))
    start = load_file(str(tmp_path / "ranks1" / "checkpoints" / "update-000000" / "model.safetensors"))
    assert any(not torch.equal(finals[1][k], start[k]) for k in start)
    for k in finals[1]:
        assert torch.allclose(finals[2][k], finals[1][k], rtol=0, atol=1e-6), k
