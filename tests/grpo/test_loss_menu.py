"""Every option of the loss menu in every mode: exact == naive (fp64), the chunked LM head == one chunk, N ranks ==
one process, LoRA; the sampler correction's weights; controls that must disagree. (TRL parity: test_trl_parity.py.)

Naive mode is the reference: every branch forwards prompt + response with autograd and one LM head chunk, so each
whole-branch term (sequence ratio, off-policy mask, VESPO's weight) and each whole-group term (entropy quantile,
bonus count) is computed there from the full forward, independently of capture, replay and the prompt backward.
"""

from __future__ import annotations

import math

import pytest
import torch

import longstraw as ls
from longstraw.grpo import correction_weights
from longstraw.parallel import SequenceParallel
from tests.conftest import flat_grad, rel_err, tiny_model, with_adapters
from tests.parallel.launch import run_ranks

LENGTHS = (5, 1, 9, 4)
ADV = [1.0, -0.5, -0.7, -1.2]
TRUNCATED = [False, False, True, False]
OPTIONS: dict[str, dict] = {
    "grpo": {},
    "bnpo": {"loss_type": "bnpo"},
    "dapo": {"loss_type": "dapo", "clip_high": 0.28},
    "dr_grpo": {"loss_type": "dr_grpo", "max_completion_length": 12},
    "cispo": {"loss_type": "cispo", "clip_high": 1.1},
    "sapo": {"loss_type": "sapo"},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "vespo": {"loss_type": "vespo", "rollout_correction": "token_truncate", "rollout_correction_max": 1.5},
    "gspo": {"importance_sampling_level": "sequence"},
    "delta": {"delta": 1.25},
    "off_policy_mask": {"off_policy_mask_threshold": 0.05},
    "top_entropy": {"top_entropy_quantile": 0.4},
    "entropy_bonus": {"entropy_coef": 0.05},
    "entropy_bonus_top": {"entropy_coef": 0.05, "top_entropy_quantile": 0.5, "loss_type": "dapo"},
    "mask_truncated": {"mask_truncated_completions": True, "loss_type": "dapo"},
    "kl_bias_corrected": {"kl_coef": 0.1, "use_bias_correction_kl": True, "importance_sampling_level": "sequence"},
    "token_mask": {"rollout_correction": "token_mask", "rollout_correction_min": 0.8, "rollout_correction_max": 1.2},
    "sequence_truncate": {"rollout_correction": "sequence_truncate", "rollout_correction_max": 1.1},
    "sequence_mask": {"rollout_correction": "sequence_mask", "rollout_correction_max": 2.0},
}


def group(model, seed: int = 0, prompt_len: int = 30):
    """A group with off-policy old log-probs (ratios on both sides of the clip range), a KL reference, a sampler
    that differs from the trainer, and one truncated response."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (prompt_len,), generator=g)
    responses = [torch.randint(0, 97, (n,), generator=g) for n in LENGTHS]
    logps = ls.score(model, ls.capture(model, prompt), responses)
    noisy = lambda s: [lp + s * torch.randn(lp.shape, generator=g, dtype=lp.dtype) for lp in logps]  # noqa: E731
    sampler = noisy(0.15)
    sampler[-1] = sampler[-1] + 0.1  # the sampler liked the last (negative-advantage) response more: off-policy
    return prompt, responses, {"old_logprobs": noisy(0.3), "ref_logprobs": noisy(0.2),
                               "sampler_logprobs": sampler, "truncated": TRUNCATED}


def grad_of(model, mode: str, prompt, responses, config: ls.GRPOConfig, inputs: dict, **kw):
    model.zero_grad(set_to_none=True)
    stats = ls.grpo_backward(model, prompt, responses, ADV, mode=mode, config=config, **inputs, **kw)
    return flat_grad(model), stats


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_exact_equals_naive_and_chunked_head_equals_one_chunk(model_type, option):
    """Exact mode's gradient and statistics are naive mode's, with the LM head in 3-token chunks or in one; detached
    mode computes the same loss."""
    model = tiny_model(model_type, dtype=torch.float64)
    prompt, responses, inputs = group(model)
    cfg = ls.GRPOConfig(**OPTIONS[option])
    g_naive, s_naive = grad_of(model, "naive", prompt, responses, cfg, inputs)
    g_exact, s_exact = grad_of(model, "exact", prompt, responses, cfg, inputs,
                               engine=ls.EngineConfig(prompt_chunk=7, head_chunk=3, branch_batch=2))
    g_whole, s_whole = grad_of(model, "exact", prompt, responses, cfg, inputs,
                               engine=ls.EngineConfig(prompt_chunk=7, branch_batch=2))
    _, s_detached = grad_of(model, "detached", prompt, responses, cfg, inputs,
                            engine=ls.EngineConfig(prompt_chunk=7, head_chunk=3))
    assert g_naive.abs().max() > 0
    assert rel_err(g_exact, g_naive) <= 1e-10
    assert rel_err(g_exact, g_whole) <= 1e-12
    assert s_detached["loss"] == pytest.approx(s_naive["loss"], rel=1e-10, abs=1e-12)  # its gradient stops at the prompt
    for key in ("loss", "clip_frac", "kl", "entropy", "entropy_kept_frac", "off_policy_masked",
                "sampler_logp_diff_mean", "sampler_logp_diff_max", "sampler_kl", "correction_weight_mean"):
        assert s_exact[key] == pytest.approx(s_naive[key], rel=1e-10, abs=1e-12), key
        assert s_exact[key] == pytest.approx(s_whole[key], rel=1e-12, abs=1e-14), key


def test_options_are_not_vacuous():
    """On this data the ratios fall on both sides of the clip range, a negative-advantage response is masked as
    off-policy, the entropy mask drops tokens, and the corrections move the weights off 1."""
    model = tiny_model("qwen3", dtype=torch.float64)
    prompt, responses, inputs = group(model)
    stats = {name: grad_of(model, "exact", prompt, responses, ls.GRPOConfig(**OPTIONS[name]), inputs)[1]
             for name in ("grpo", "off_policy_mask", "top_entropy", "token_mask", "sequence_truncate")}
    assert 0 < stats["grpo"]["clip_frac"] < 1
    assert stats["off_policy_mask"]["off_policy_masked"] >= 1
    assert 0.3 < stats["top_entropy"]["entropy_kept_frac"] < 0.7
    assert stats["token_mask"]["correction_weight_mean"] != pytest.approx(1.0, abs=1e-3)
    assert stats["sequence_truncate"]["correction_weight_mean"] != pytest.approx(1.0, abs=1e-3)


# controls: each option changes the gradient on this data (so an equality above is not vacuous)
CONTROLS = [("grpo", "gspo"), ("grpo", "cispo"), ("grpo", "delta"), ("grpo", "sapo"), ("dapo", "vespo"),
            ("grpo", "off_policy_mask"), ("grpo", "top_entropy"), ("grpo", "entropy_bonus"), ("dapo", "mask_truncated"),
            ("grpo", "token_mask"), ("grpo", "sequence_truncate"), ("grpo", "bnpo"), ("grpo", "luspo")]


@pytest.mark.parametrize("a,b", CONTROLS)
def test_each_option_changes_the_gradient(a, b):
    model = tiny_model("qwen3", dtype=torch.float64)
    prompt, responses, inputs = group(model)
    ga, _ = grad_of(model, "exact", prompt, responses, ls.GRPOConfig(**OPTIONS[a]), inputs)
    gb, _ = grad_of(model, "exact", prompt, responses, ls.GRPOConfig(**OPTIONS[b]), inputs)
    assert rel_err(ga, gb) > 1e-3


@pytest.mark.parametrize("option", ["gspo", "cispo", "entropy_bonus_top", "vespo", "off_policy_mask"])
def test_lora_exact_equals_naive(option):
    model = with_adapters(tiny_model("qwen3_5_text", dtype=torch.float64))
    prompt, responses, inputs = group(model)
    cfg = ls.GRPOConfig(**OPTIONS[option])
    g_naive, _ = grad_of(model, "naive", prompt, responses, cfg, inputs)
    g_exact, _ = grad_of(model, "exact", prompt, responses, cfg, inputs, engine=ls.EngineConfig(prompt_chunk=7))
    assert g_naive.abs().max() > 0
    assert rel_err(g_exact, g_naive) <= 1e-10


RANK_OPTIONS = ["gspo", "cispo", "vespo", "off_policy_mask", "entropy_bonus_top", "mask_truncated", "sequence_mask"]


def options_on_ranks(rank: int, world: int, dp: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh

    sp = SequenceParallel.from_mesh(init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "sp")))
    model = tiny_model("qwen3_5_text", dtype=torch.float64)
    prompt, responses, inputs = group(model)
    out = {}
    for name in RANK_OPTIONS:
        grad, stats = grad_of(model, "exact", prompt, responses, ls.GRPOConfig(**OPTIONS[name]), inputs,
                              engine=ls.EngineConfig(prompt_chunk=7), parallel=sp)
        out[f"grad.{name}"] = grad
        out[f"stats.{name}"] = torch.tensor([stats["loss"], stats["entropy_kept_frac"], stats["sampler_logp_diff_max"],
                                             stats["correction_weight_mean"]], dtype=torch.float64)
    return out


@pytest.mark.parametrize("dp", [1, 2])
def test_two_ranks_equal_one_process(dp):
    """2 ranks as one sequence-parallel group (the state sharded, each rank replaying half the branches) or as two
    data-parallel groups: every option's gradient and statistics are the one process's."""
    ranks = run_ranks(2, options_on_ranks, dp, timeout=180)
    model = tiny_model("qwen3_5_text", dtype=torch.float64)
    prompt, responses, inputs = group(model)
    for name in RANK_OPTIONS:
        grad, stats = grad_of(model, "exact", prompt, responses, ls.GRPOConfig(**OPTIONS[name]), inputs,
                              engine=ls.EngineConfig(prompt_chunk=7))
        want = torch.tensor([stats["loss"], stats["entropy_kept_frac"], stats["sampler_logp_diff_max"],
                             stats["correction_weight_mean"]], dtype=torch.float64)
        for r in ranks:
            assert rel_err(r[f"grad.{name}"], grad) <= 1e-10, name
            assert torch.allclose(r[f"stats.{name}"], want, rtol=1e-10, atol=1e-12), name


# ---- the sampler correction ------------------------------------------------------------------------------------

def test_correction_is_the_identity_when_the_sampler_is_the_trainer():
    model = tiny_model("qwen3", dtype=torch.float64)
    prompt, responses, inputs = group(model)
    inputs = {"sampler_logprobs": ls.score(model, ls.capture(model, prompt), responses)}  # on-policy, same kernels
    g_off, _ = grad_of(model, "exact", prompt, responses, ls.GRPOConfig(), inputs)
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        cfg = ls.GRPOConfig(rollout_correction=mode, rollout_correction_min=0.5, rollout_correction_max=2.0)
        g_on, stats = grad_of(model, "exact", prompt, responses, cfg, inputs)
        assert rel_err(g_on, g_off) <= 1e-12, mode
        assert stats["correction_weight_mean"] == pytest.approx(1.0, abs=1e-12)
        assert stats["sampler_logp_diff_max"] <= 1e-12


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_correction_weights_follow_the_formula(mode):
    """exp(trainer - sampler) per token, or exp of its sum per sequence; truncated into [0.7, 1.3] or zeroed outside."""
    g = torch.Generator().manual_seed(1)
    old = torch.randn(40, generator=g, dtype=torch.float64) - 3.0
    sampler = old + 0.4 * torch.randn(40, generator=g, dtype=torch.float64)
    cfg = ls.GRPOConfig(rollout_correction=mode, rollout_correction_min=0.7, rollout_correction_max=1.3)
    got = correction_weights(old, sampler, cfg)
    diffs = [a - b for a, b in zip(old.tolist(), sampler.tolist())]
    raw = [math.exp(sum(diffs))] if mode.startswith("sequence") else [math.exp(d) for d in diffs]
    if mode.endswith("truncate"):
        want = [min(max(w, 0.7), 1.3) for w in raw]
        assert any(w < 0.7 for w in raw) or mode.startswith("sequence")
    else:
        want = [w if 0.7 <= w <= 1.3 else 0.0 for w in raw]
    assert got.tolist() == pytest.approx(want, rel=1e-12)
    inside = got[got != 0]
    assert ((inside >= 0.7) & (inside <= 1.3)).all()


# ---- bad settings ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("settings,message", [
    ({"loss_type": "cispo"}, "cispo caps the ratio at clip_high itself"),
    ({"loss_agg": "token_mean"}, "'loss_agg' is now loss_type"),
    ({"beta": 0.1}, "'beta' is now kl_coef"),
    ({"rollout_correction": "token_truncate", "rollout_correction_max": None}, "set at least one of them"),
    ({"delta": 1.1}, "must exceed 1 \\+ clip_high"),
    ({"loss_type": "vespo", "rollout_correction": "sequence_mask"}, "token_truncate or token_mask"),
])
def test_bad_settings_name_the_fix(settings, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        ls.GRPOConfig(**settings)


@pytest.mark.parametrize("settings,drop,message", [
    ({"rollout_correction": "token_mask"}, "sampler_logprobs", "needs sampler_logprobs"),
    ({"mask_truncated_completions": True}, "truncated", "pass truncated="),
])
def test_missing_inputs_name_the_fix(settings, drop, message):
    model = tiny_model("qwen3", dtype=torch.float64)
    prompt, responses, inputs = group(model)
    inputs.pop(drop)
    with pytest.raises(ValueError, match=message):
        ls.grpo_backward(model, prompt, responses, ADV, config=ls.GRPOConfig(**settings), **inputs)
    assert all(p.grad is None for p in model.parameters())


def test_step_cli_runs_every_option_on_two_ranks(tmp_path, capsys):
    """`longstraw step` with a recipe that turns on every kind of option (its sampler, reference and truncation
    made up around the model's own log-probs): exact equals naive, and 2 torchrun ranks equal one process."""
    import json

    import yaml

    from longstraw.cli import main
    from tests.conftest import tiny_config

    grpo = {"loss_type": "cispo", "clip_high": 5.0, "importance_sampling_level": "sequence", "kl_coef": 0.05,
            "use_bias_correction_kl": True, "rollout_correction": "token_truncate", "rollout_correction_min": 0.9,
            "off_policy_mask_threshold": 0.01, "top_entropy_quantile": 0.5, "entropy_coef": 0.01,
            "mask_truncated_completions": True}
    cfg = {"model": {"random": tiny_config("qwen3_5_text")}, "prompt_tokens": 60, "responses": 4,
           "response_tokens": [3, 6], "modes": ["naive", "exact"], "threads": 1, "engine": {"prompt_chunk": 16},
           "grpo": grpo}
    path = tmp_path / "step.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["step", "--config", str(path), "--nproc", "2", "--json", str(tmp_path / "r.json"),
                 "--no-progress"]) == 0
    rows = {r["mode"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert rows["exact"]["grad_rel_err_vs_naive"] <= 1e-5
    assert rows["exact x2"]["grad_rel_err_vs_one_process"] <= 1e-5
    assert rows["exact"]["entropy_kept_frac"] < 1.0 and rows["exact"]["sampler_kl"] > 0
    assert "exact x2" in capsys.readouterr().out
