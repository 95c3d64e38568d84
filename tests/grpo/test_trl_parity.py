"""Every GRPO option == TRL 1.16's own `GRPOTrainer._compute_loss` (called, tests/grpo/trl_reference.py): loss and
gradient of every parameter, exact mode, dense (qwen3) and hybrid (qwen3_5_text), off-policy with ratios inside and
outside the clip bounds, on one transformers checkpoint that LongStraw loads with `load_model`. Every case runs
again on multi-turn branches ("..., tool_mask"): tokens the model did not write masked (LongStraw's `masks`, TRL's
`tool_mask`), where LongStraw gets NaN sampler log-probs and TRL the 0.0 its tool loop writes there.

Controls: LongStraw with one option against TRL with its neighbour (token vs sequence level, cispo vs grpo, ...) must
disagree far beyond the tolerance, so that a pass says the option was compared. Table of worst relative errors:

    .venv/bin/python -m tests.grpo.test_trl_parity
"""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch

import longstraw as ls
from tests.conftest import rel_err, tiny_config
from tests.grpo.trl_reference import trl_batch, trl_config, trl_loss_and_grad

MODEL_TYPES = ("qwen3", "qwen3_5_text")
PROMPT_LEN, LENGTHS = 20, (5, 1, 9, 4)
ADV = [1.0, -0.5, 0.9, -1.2]  # sums to 0.2: the on-policy grpo loss is not 0, so its relative error means something
TRUNCATED = [False, False, True, False]  # the longest response hit max_new_tokens
CLIP_LOW, CLIP_HIGH, DELTA = 0.2, 0.28, 1.5
IS_MIN, IS_MAX = 0.5, 3.0  # rollout correction bounds
OFF_POLICY_THRESHOLD = 0.5  # with the sampler's log-probs
OLD_OFF_POLICY_THRESHOLD = 0.2  # without them: TRL (and LongStraw) then measure the drift from the old log-probs
# tokens a tool wrote (False) in each response; response 0's third token (ratio above cispo's cap) and response 2's
# fourth (correction weight above IS_MAX) stay the model's, so the masked cases still reach those bounds
TOOL_MASK = [[1, 0, 1, 0, 1], [1], [1, 1, 1, 1, 0, 0, 1, 0, 1], [1, 0, 0, 1]]
ENTROPY_COEF, KL_COEF = 0.5, 0.2  # large enough that their terms move the gradient well past the tolerance
# fp32 on both sides, same weights, different kernels (TRL's chunked fused head over full prompt+completion rows vs
# LongStraw's prompt capture + branch replay). Measured worst over all cases and both models: gradient 9.3e-7, loss
# 8.6e-6. The loss is ~-0.02 made of terms of size ~1 (ratios x advantages) that cancel, so fp32 rounding of those
# terms (~1e-7 absolute) is ~5e-6 of it; the gradient has no such cancellation. Both bounds leave ~6-10x margin.
GRAD_TOL, LOSS_TOL = 1e-5, 5e-5
# the prompt's gradient flows back through 3 chunks; branches replay two at a time (right-padded together)
ENGINE = ls.EngineConfig(prompt_chunk=8, branch_batch=2)
CONTROL_MIN = 1e-3  # a control's disagreement: 100x the gradient tolerance at least

# LongStraw option -> TRL 1.16 option; every other loss option has the same name in both
RENAMED = {"clip_low": "epsilon", "clip_high": "epsilon_high", "kl_coef": "beta",
           "rollout_correction_min": "vllm_importance_sampling_clip_min",
           "rollout_correction_max": "vllm_importance_sampling_clip_max"}
SAME = ("loss_type", "importance_sampling_level", "delta", "use_bias_correction_kl", "sapo_temperature_neg",
        "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
        "off_policy_mask_threshold", "top_entropy_quantile", "entropy_coef", "mask_truncated_completions")

OFF = dict(clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
ROLL = dict(OFF, rollout_correction_min=IS_MIN, rollout_correction_max=IS_MAX)
# name -> (LongStraw GRPOConfig options, data): data "off" = off-policy old log-probs, "on" = none (ratio 1)
CASES: dict[str, tuple[dict, str]] = {
    "grpo on-policy": ({}, "on"),
    "grpo": (OFF, "off"),
    "bnpo": (dict(OFF, loss_type="bnpo"), "off"),
    "dapo": (dict(OFF, loss_type="dapo"), "off"),
    "dr_grpo max_completion_length=16": (dict(OFF, loss_type="dr_grpo", max_completion_length=16), "off"),
    "dr_grpo default length": (dict(OFF, loss_type="dr_grpo"), "off"),
    "cispo clip_high=5": (dict(OFF, loss_type="cispo", clip_high=5.0), "off"),
    "sapo": (dict(OFF, loss_type="sapo"), "off"),
    "luspo sequence": (dict(OFF, loss_type="luspo", importance_sampling_level="sequence"), "off"),
    "luspo token": (dict(OFF, loss_type="luspo"), "off"),
    "vespo": (dict(OFF, loss_type="vespo"), "off"),
    "grpo sequence": (dict(OFF, importance_sampling_level="sequence"), "off"),
    "dapo sequence": (dict(OFF, loss_type="dapo", importance_sampling_level="sequence"), "off"),
    "cispo sequence": (dict(OFF, loss_type="cispo", clip_high=5.0, importance_sampling_level="sequence"), "off"),
    "sapo sequence": (dict(OFF, loss_type="sapo", importance_sampling_level="sequence"), "off"),
    "delta": (dict(OFF, delta=DELTA), "off"),
    "delta sequence": (dict(OFF, delta=DELTA, importance_sampling_level="sequence"), "off"),
    "off_policy_mask": (dict(OFF, off_policy_mask_threshold=OFF_POLICY_THRESHOLD), "off"),
    "off_policy_mask without sampler": (dict(OFF, off_policy_mask_threshold=OLD_OFF_POLICY_THRESHOLD),
                                        "off, no sampler"),
    "top_entropy_quantile=0.2": (dict(OFF, top_entropy_quantile=0.2), "off"),
    "top_entropy_quantile=0.5": (dict(OFF, top_entropy_quantile=0.5), "off"),
    "entropy_coef": (dict(OFF, entropy_coef=ENTROPY_COEF), "off"),
    "entropy_coef + top_entropy_quantile=0.5": (dict(OFF, entropy_coef=ENTROPY_COEF, top_entropy_quantile=0.5), "off"),
    "entropy_coef dapo": (dict(OFF, loss_type="dapo", entropy_coef=ENTROPY_COEF), "off"),
    "truncated, not masked": (OFF, "off"),
    "mask_truncated_completions": (dict(OFF, mask_truncated_completions=True), "off"),
    "mask_truncated_completions dapo": (dict(OFF, loss_type="dapo", mask_truncated_completions=True), "off"),
    "mask_truncated_completions + entropy": (
        dict(OFF, mask_truncated_completions=True, entropy_coef=ENTROPY_COEF, top_entropy_quantile=0.5), "off"),
    "kl_coef": (dict(OFF, kl_coef=KL_COEF), "off"),
    "kl_coef use_bias_correction_kl": (dict(OFF, kl_coef=KL_COEF, use_bias_correction_kl=True), "off"),
    "kl_coef use_bias_correction_kl sequence": (
        dict(OFF, kl_coef=KL_COEF, use_bias_correction_kl=True, importance_sampling_level="sequence"), "off"),
    "kl_coef dapo": (dict(OFF, loss_type="dapo", kl_coef=KL_COEF), "off"),
    "kl_coef luspo sequence": (dict(OFF, loss_type="luspo", importance_sampling_level="sequence", kl_coef=KL_COEF),
                               "off"),
    "rollout token_truncate": (dict(ROLL, rollout_correction="token_truncate"), "off"),
    "rollout token_mask": (dict(ROLL, rollout_correction="token_mask"), "off"),
    "rollout sequence_truncate": (dict(ROLL, rollout_correction="sequence_truncate"), "off"),
    "rollout sequence_mask": (dict(ROLL, rollout_correction="sequence_mask"), "off"),
    "rollout token_truncate max only": (dict(OFF, rollout_correction="token_truncate"), "off"),
    "rollout token_truncate on-policy": (dict(ROLL, rollout_correction="token_truncate"), "on"),
    "rollout sequence_mask on-policy": (dict(ROLL, rollout_correction="sequence_mask"), "on"),
    "vespo rollout token_truncate": (dict(ROLL, loss_type="vespo", rollout_correction="token_truncate"), "off"),
    "vespo rollout token_mask": (dict(ROLL, loss_type="vespo", rollout_correction="token_mask"), "off"),
    "all at once": (dict(ROLL, loss_type="dapo", delta=DELTA, kl_coef=KL_COEF, use_bias_correction_kl=True,
                         off_policy_mask_threshold=OFF_POLICY_THRESHOLD, top_entropy_quantile=0.5,
                         entropy_coef=ENTROPY_COEF, mask_truncated_completions=True,
                         rollout_correction="token_truncate"), "off"),
}
CASES |= {f"{name}, tool_mask": (options, f"{kind}, tool_mask") for name, (options, kind) in CASES.items()}
# (LongStraw case, TRL case): the same data, one option apart; they must disagree. bnpo has no control: on one
# micro-batch of one process it is dapo (both divide by the micro-batch's token count); they part only when TRL
# accumulates several micro-batches, which a group never is
CONTROLS = [
    ("grpo", "grpo sequence"),  # token vs sequence level
    ("cispo clip_high=5", "grpo"),
    ("dapo", "grpo"),
    ("dr_grpo max_completion_length=16", "dapo"),
    ("dr_grpo default length", "dr_grpo max_completion_length=16"),
    ("luspo sequence", "grpo sequence"),
    ("sapo", "grpo"),
    ("vespo", "dapo"),
    ("delta", "grpo"),
    ("off_policy_mask", "grpo"),
    ("off_policy_mask without sampler", "grpo"),
    ("entropy_coef", "grpo"),
    ("top_entropy_quantile=0.2", "grpo"),
    ("mask_truncated_completions", "truncated, not masked"),
    ("kl_coef use_bias_correction_kl", "kl_coef"),
    ("kl_coef", "grpo"),
    ("rollout token_truncate", "grpo"),
    ("rollout sequence_mask", "grpo"),
    ("rollout token_truncate", "rollout token_mask"),
    ("rollout sequence_truncate", "rollout sequence_mask"),
    ("rollout token_truncate", "rollout sequence_truncate"),
    ("vespo rollout token_truncate", "vespo"),
    ("grpo", "grpo on-policy"),
    ("rollout token_truncate on-policy", "grpo on-policy"),
    # the mask against none, for every normalisation and sequence-level reduction
    *[(f"{case}, tool_mask", case) for case in ("grpo", "bnpo", "dapo", "dr_grpo default length", "cispo clip_high=5",
                                                "sapo", "luspo sequence", "vespo", "grpo sequence", "off_policy_mask",
                                                "entropy_coef + top_entropy_quantile=0.5", "kl_coef",
                                                "rollout sequence_truncate")],
]


def trl_options(cfg: ls.GRPOConfig, lengths: list[int]) -> dict:
    """TRL 1.16's options for LongStraw's `cfg`, under the names of RENAMED; rollout_correction on = TRL's vLLM
    correction on; dr_grpo's length defaults to the group's longest response (LongStraw's documented default)."""
    mine = cfg.model_dump()
    opts = {name: mine[name] for name in SAME} | {theirs: mine[ours] for ours, theirs in RENAMED.items()}
    opts["max_completion_length"] = cfg.max_completion_length or max(lengths)
    on = cfg.rollout_correction != "off"
    opts |= dict(use_vllm=on, vllm_importance_sampling_correction=on)
    if on:
        opts["vllm_importance_sampling_mode"] = cfg.rollout_correction
    return opts


# ---- one checkpoint, two loaders ------------------------------------------------------------------------------


@functools.cache
def checkpoint(model_type: str):
    """A random transformers model saved with save_pretrained, loaded back by LongStraw; the group and its
    off-policy log-probs, derived from the model's own log-probs (plain log-softmax of transformers' logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config(model_type)), dtype=torch.float32)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = ls.load_model(d)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 97, (PROMPT_LEN,), generator=g)  # 0 is TRL's completion padding
    responses = [torch.randint(1, 97, (n,), generator=g) for n in LENGTHS]
    with torch.no_grad():
        cur = plain_logprobs(hf, prompt, responses)

    def noisy(base, offsets, std):
        return [b + o + std * torch.randn(b.shape, generator=g) for b, o in zip(base, offsets)]

    # per-response offsets put the sequence ratios exp(mean(cur - old)) on both sides of the clip bounds (~1.5 with
    # A > 0: high clip; ~1.7 with A < 0: above DELTA; ~1; ~0.75 with A < 0: low clip); the token noise spreads token
    # ratios over both sides; one token's ratio ~9 exceeds cispo's cap of 5
    old = noisy(cur, [-0.4, -1.0, 0.0, 0.5], 0.3)
    old[0][2] -= 1.8
    ref = noisy(cur, [0.0] * 4, 0.2)
    # sampler: mean(sampler - cur) ~0.9 on response 1 (A < 0, dropped by the off-policy mask at 0.5) and ~0.1 on
    # response 3 (A < 0, kept); correction weights exp(old - sampler) on both sides of [IS_MIN, IS_MAX], per token
    # (one bumped above IS_MAX) and per sequence
    sampler = noisy(old, [-0.1, 1.5, 0.02, -0.45], 0.3)
    sampler[2][3] -= 1.0
    return hf, ours, prompt, responses, dict(cur=cur, old=old, ref=ref, sampler=sampler)


def plain_logprobs(hf, prompt: torch.Tensor, responses: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for r in responses:
        logits = hf(torch.cat([prompt, r])[None]).logits[0, prompt.numel() - 1: -1]
        out.append(torch.log_softmax(logits.float(), -1).gather(-1, r[:, None])[:, 0])
    return out


@functools.cache
def longstraw_side(model_type: str, case: str) -> tuple[float, torch.Tensor]:
    hf, ours, prompt, responses, data = checkpoint(model_type)
    options, kind = CASES[case]
    cfg = ls.GRPOConfig(**options)
    ours.zero_grad(set_to_none=True)
    masks = [torch.tensor(m, dtype=torch.bool) for m in TOOL_MASK] if "tool_mask" in kind else None
    sampler = None if "no sampler" in kind else data["sampler"]
    if sampler is not None and masks is not None:  # the sampler scored only what it wrote
        sampler = [s.masked_fill(~m, float("nan")) for s, m in zip(sampler, masks)]
    stats = ls.grpo_backward(
        ours, prompt, responses, ADV, mode="exact", config=cfg, engine=ENGINE,
        old_logprobs=None if kind.startswith("on") else data["old"],
        ref_logprobs=data["ref"] if cfg.kl_coef > 0 else None,
        sampler_logprobs=sampler, truncated=TRUNCATED, masks=masks)
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for _, p in ours.named_parameters()])
    return stats["loss"], grad


@functools.cache
def trl_side(model_type: str, case: str) -> tuple[float, torch.Tensor]:
    hf, ours, prompt, responses, data = checkpoint(model_type)
    options, kind = CASES[case]
    cfg = ls.GRPOConfig(**options)
    opts = trl_options(cfg, [r.numel() for r in responses])
    masks = [torch.tensor(m, dtype=torch.bool) for m in TOOL_MASK] if "tool_mask" in kind else None
    sampler = None if "no sampler" in kind else data["sampler"]
    if sampler is not None and masks is not None:  # TRL's tool loop gives a tool's tokens the log-prob 0.0
        sampler = [s.masked_fill(~m, 0.0) for s, m in zip(sampler, masks)]
    batch = trl_batch(
        prompt, responses, ADV,
        old=None if kind.startswith("on") else data["old"], ref=data["ref"] if cfg.kl_coef > 0 else None,
        sampler=sampler, truncated=TRUNCATED if cfg.mask_truncated_completions else None,
        rollout=(cfg.rollout_correction, cfg.rollout_correction_min, cfg.rollout_correction_max)
        if cfg.rollout_correction != "off" else None, generation_logps=data["cur"], tool_mask=masks)
    loss, grads = trl_loss_and_grad(hf, trl_config(**opts), batch)
    return loss, torch.cat([grads[n].flatten() for n, _ in ours.named_parameters()])


def errors(model_type: str, ours_case: str, trl_case: str) -> tuple[float, float]:
    """Relative error of LongStraw's loss and gradient (case `ours_case`) against TRL's (case `trl_case`)."""
    loss, grad = longstraw_side(model_type, ours_case)
    ref_loss, ref_grad = trl_side(model_type, trl_case)
    return abs(loss - ref_loss) / abs(ref_loss), rel_err(grad, ref_grad)


# ---- tests ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_data_reaches_both_sides_of_every_bound(model_type):
    """The off-policy data is not vacuous: token and sequence ratios fall inside and outside the clip bounds where
    the clip acts (by the advantage's sign), above DELTA with A < 0, above cispo's cap; the off-policy mask drops one
    negative-advantage response and keeps another (another one when it measures from the old log-probs); the
    correction weights fall inside and outside their bounds."""
    _, _, _, responses, data = checkpoint(model_type)
    adv = torch.tensor(ADV)

    def clip_acts(ratios):  # per response: where the clip replaces the ratio
        return [((r > 1 + CLIP_HIGH) & (a > 0)) | ((r < 1 - CLIP_LOW) & (a < 0)) for r, a in zip(ratios, adv)]

    tok = [torch.exp(c - o) for c, o in zip(data["cur"], data["old"])]
    seq = [torch.exp((c - o).mean()).reshape(1) for c, o in zip(data["cur"], data["old"])]
    for ratios in (tok, seq):
        acts = torch.cat(clip_acts(ratios))
        assert acts.any() and not acts.all()
        assert any(((r > DELTA) & (a < 0)).any() for r, a in zip(ratios, adv))
    assert any((r > 5.0).any() for r in tok)
    seq_kl = torch.stack([(s - c).mean() for s, c in zip(data["sampler"], data["cur"])])
    dropped = (adv < 0) & (seq_kl > OFF_POLICY_THRESHOLD)
    assert dropped.any() and ((adv < 0) & ~dropped).any()
    old_kl = torch.stack([(o - c).mean() for o, c in zip(data["old"], data["cur"])])
    dropped_old = (adv < 0) & (old_kl > OLD_OFF_POLICY_THRESHOLD)
    assert dropped_old.any() and ((adv < 0) & ~dropped_old).any() and not torch.equal(dropped, dropped_old)
    tok_w = torch.cat([torch.exp(o - s) for o, s in zip(data["old"], data["sampler"])])
    seq_w = torch.stack([torch.exp((o - s).sum()) for o, s in zip(data["old"], data["sampler"])])
    for w in (tok_w, seq_w):
        inside = (w >= IS_MIN) & (w <= IS_MAX)
        assert inside.any() and (w < IS_MIN).any() and (w > IS_MAX).any()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_equals_trl(model_type, case):
    loss_err, grad_err = errors(model_type, case, case)
    assert loss_err <= LOSS_TOL, f"loss: rel err {loss_err:.2e}"
    assert grad_err <= GRAD_TOL, f"gradient: rel err {grad_err:.2e}"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("ours,theirs", CONTROLS, ids=[f"{a} vs {b}" for a, b in CONTROLS])
def test_control_disagrees(model_type, ours, theirs):
    loss_err, grad_err = errors(model_type, ours, theirs)
    assert grad_err > CONTROL_MIN, f"{ours} vs TRL's {theirs}: gradients agree to {grad_err:.2e}"


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for case in CASES:
        worst = [max(e) for e in zip(*(errors(m, case, case) for m in MODEL_TYPES))]
        rows.append((case, *worst))
    width = max(len(c) for c in CASES)
    print(f"{'option':<{width}}  {'loss rel err':>12}  {'grad rel err':>12}   (worst of {', '.join(MODEL_TYPES)})")
    for case, le, ge in rows:
        print(f"{case:<{width}}  {le:12.2e}  {ge:12.2e}")
    print(f"{'worst':<{width}}  {max(r[1] for r in rows):12.2e}  {max(r[2] for r in rows):12.2e}")
    print(f"{'tolerance':<{width}}  {LOSS_TOL:12.0e}  {GRAD_TOL:12.0e}")
    print("\ncontrols (LongStraw option vs TRL neighbour; must exceed", f"{CONTROL_MIN:.0e}):")
    for ours, theirs in CONTROLS:
        least = min(errors(m, ours, theirs)[1] for m in MODEL_TYPES)
        print(f"  {ours} vs {theirs}: grad rel err {least:.2e}")


if __name__ == "__main__":
    main()
