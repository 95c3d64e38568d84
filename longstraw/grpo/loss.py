"""The GRPO loss of one branch, for every `loss_type` of `GRPOConfig`, and the group's token weights.

A group's loss is a weighted sum over its branches' tokens (`token_weights`, fixed by the whole group), so a branch
replayed on its own, or on another rank, adds exactly its share. Every term that looks at a whole response (the
sequence-level ratio, the off-policy mask, the sequence-level correction, VESPO's weight) is computed inside
`branch_loss` from that branch's own tokens, which a replay batch always holds whole. What needs the whole group
(the entropy quantile, the bonus's token count) comes in as `keep` and `bonus_weight` (engine/entropy.py).

A multi-turn branch holds tokens the model did not write (a tool's output), marked False in its `mask`: as in TRL's
`tool_mask`, they weigh 0 in every term, every sequence-level mean or sum runs over the model's tokens only, and no
statistic counts them; the old, reference and sampler log-probs given there (the sampler's are NaN) never reach a
result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .config import GRPOConfig

RATIO_CLIPPED = ("grpo", "bnpo", "dapo", "dr_grpo", "luspo")
VESPO_LOG_MIN = math.log(1e-8)  # VESPO's floor of a log-weight (its reference implementation's)


def token_weights(lengths: Sequence[int], cfg: GRPOConfig, kept: Sequence[bool] | None = None,
                  counted: Sequence[int] | None = None) -> list[float]:
    """Weight of every token of branch i in the group's policy loss (0 for a branch not `kept`: a truncated
    response under `mask_truncated_completions`). The group stands where TRL has one micro-batch. `counted`: each
    branch's tokens written by the model (None: all `lengths`), which the means count; dr_grpo's default
    length stays the longest whole response (TRL's max_completion_length bounds tool output too)."""
    g = len(lengths)
    kept = [True] * g if kept is None else list(kept)
    counted = lengths if counted is None else counted
    if cfg.loss_type in ("grpo", "sapo"):  # a branch of no model tokens has none to weigh (TRL clamps to 1)
        return [1.0 / (g * max(n, 1)) if k else 0.0 for n, k in zip(counted, kept)]
    if cfg.loss_type == "dr_grpo":
        norm = cfg.max_completion_length or max(lengths)
        return [1.0 / (g * norm) if k else 0.0 for k in kept]
    if cfg.loss_type == "luspo":
        return [1.0 / g if k else 0.0 for k in kept]
    total = max(sum(n for n, k in zip(counted, kept) if k), 1)  # bnpo, dapo, cispo, vespo: the group's token mean
    return [1.0 / total if k else 0.0 for k in kept]


def correction_weights(old: torch.Tensor, sampler: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """Importance weights exp(trainer - sampler log-prob) of one branch ([R], or [1] at sequence level), truncated
    to [rollout_correction_min, _max] or zeroed outside it (no autograd). A sampler log-prob that is NaN (not
    scored) counts as no mismatch."""
    diff = torch.nan_to_num(old - sampler, nan=0.0)
    level, how = cfg.rollout_correction.split("_")
    w = torch.exp(diff.sum().reshape(1) if level == "sequence" else diff)
    lo, hi = cfg.rollout_correction_min, cfg.rollout_correction_max
    if how == "truncate":
        return w.clamp(min=lo, max=hi)
    outside = torch.zeros_like(w, dtype=torch.bool)
    if lo is not None:
        outside |= w < lo
    if hi is not None:
        outside |= w > hi
    return w.masked_fill(outside, 0.0)


@torch.no_grad()
def vespo_weight(log_ratio: torch.Tensor, advantage: float, cfg: GRPOConfig,
                 correction: torch.Tensor | None = None) -> torch.Tensor:
    """VESPO's Gamma weight phi(w) = exp(lambda + k log w - lambda w) of the branch's sequence ratio w (the product
    of its token ratios, and of the token-level sampler correction when on), [1], no autograd."""
    log_w = log_ratio.clamp(-20.0, 20.0).sum()
    if correction is not None:
        log_w = log_w + correction.log().clamp(VESPO_LOG_MIN, 20.0).sum()
    log_w = log_w.clamp(VESPO_LOG_MIN, 20.0)
    k, lam = ((cfg.vespo_k_pos, cfg.vespo_lambda_pos) if advantage >= 0 else (cfg.vespo_k_neg, cfg.vespo_lambda_neg))
    lam = max(lam, 1e-4)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp())
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0).reshape(1)


def branch_loss(
    logp: torch.Tensor,
    advantage: float,
    weight: float,
    cfg: GRPOConfig,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    sampler_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    bonus_weight: float = 0.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted GRPO loss of one branch's tokens (`logp` [R], with autograd) and its token-summed statistics.

    `old_logp` (None: on-policy, the ratio is 1 with gradient) and `ref_logp` (the KL term's) are the trainer's;
    `sampler_logp` the sampler's (the rollout correction and the off-policy mask). `keep` [R] bool: the tokens the
    policy loss keeps (the group's top-entropy quantile); `entropy` [R] with autograd and `bonus_weight` (entropy_coef
    over the group's kept tokens): the entropy bonus on the kept tokens. `mask` [R] bool (None: all True): the
    tokens the model wrote; the others weigh 0 and count in no statistic (module docstring).
    """
    old = logp.detach() if old_logp is None else old_logp.to(logp)
    sampler = None if sampler_logp is None else sampler_logp.to(logp)
    ref = None if ref_logp is None else ref_logp.to(logp)
    m = mf = None
    if mask is not None:
        m = mask.to(device=logp.device, dtype=torch.bool)
        mf = m.to(logp.dtype)
        # where the model did not write, every log-prob is the current one: ratio 1, no KL, no sampler mismatch, so
        # whatever was passed there (NaN included) reaches no term before the mask zeroes it
        here = logp.detach()
        old = torch.where(m, old, here)
        ref = None if ref is None else torch.where(m, ref, here)
        sampler = None if sampler is None else torch.where(m, sampler, old)
    adv = float(advantage)
    log_ratio = logp - old
    if cfg.importance_sampling_level == "sequence":  # GSPO: the geometric mean of the token ratios, for every token
        if m is None:
            log_ratio_used = log_ratio.mean().reshape(1)
        else:  # over the model's tokens, and no gradient to the others
            log_ratio_used = ((log_ratio * mf).sum() / mf.sum().clamp(min=1.0)).reshape(1)
    else:
        log_ratio_used = log_ratio
    ratio = torch.exp(log_ratio_used)
    correction = None
    if cfg.rollout_correction != "off":
        if sampler is None:
            raise ValueError(f"rollout_correction {cfg.rollout_correction} needs the sampler's log-probs "
                             "(sampler_logprobs); pass them, or set rollout_correction: off")
        correction = correction_weights(old, sampler, cfg)
        if m is not None and correction.numel() == m.numel():  # token level: weight 1 where the sampler did not write
            correction = torch.where(m, correction, torch.ones_like(correction))

    stats: dict[str, float] = {}
    n = logp.numel()
    if cfg.loss_type == "cispo":
        per_token = -ratio.clamp(max=cfg.clip_high).detach() * adv * logp
    elif cfg.loss_type == "sapo":
        tau = cfg.sapo_temperature_pos if adv > 0 else cfg.sapo_temperature_neg
        per_token = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
    elif cfg.loss_type == "vespo":
        per_token = -vespo_weight(log_ratio if m is None else log_ratio * mf, adv, cfg, correction) * adv * logp
    else:
        clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv
        capped = ratio if cfg.delta is None else ratio.clamp(max=cfg.delta)
        per_token = -torch.minimum(capped * adv, clipped)
    if cfg.loss_type in RATIO_CLIPPED:
        r = ratio.detach()
        hit = ((r < 1.0 - cfg.clip_low) & (adv < 0)) | ((r > 1.0 + cfg.clip_high) & (adv > 0))
        hit = hit.expand(n)
        stats["clipped_tokens"] = float(hit.sum() if m is None else (hit & m).sum())
    else:
        stats["clipped_tokens"] = 0.0
    per_token = per_token.expand(n)

    if cfg.off_policy_mask_threshold is not None:
        behaviour = old if sampler is None else sampler
        token_kl = torch.nan_to_num(behaviour - logp.detach(), nan=0.0)
        seq_kl = token_kl.mean() if m is None else (token_kl * mf).sum() / mf.sum().clamp(min=1.0)
        dropped = adv < 0 and float(seq_kl) > cfg.off_policy_mask_threshold
        stats["off_policy_masked"] = float(dropped)
        if dropped:
            per_token = per_token * 0.0  # kept in the graph: every branch of a batch back-propagates alike
    if keep is not None:
        per_token = per_token * keep.to(per_token.dtype)
    if correction is not None and cfg.loss_type != "vespo":  # VESPO took it into its weight
        per_token = per_token * correction
    if sampler is not None:
        d = torch.nan_to_num(old - sampler, nan=0.0)
        # (d is 0 where the model did not write: those tokens add to no sum and leave the max >= 0 as it is)
        stats |= {"mismatch_abs_sum": float(d.abs().sum()), "mismatch_abs_max": float(d.abs().max()),
                  "mismatch_kl_sum": float((torch.exp(d) - d - 1.0).sum()),
                  "sampler_tokens": float(n if m is None else m.sum())}
        if correction is not None:
            weights = correction.expand(n)
            stats["correction_weight_sum"] = float(weights.sum() if m is None else (weights * mf).sum())
    if cfg.kl_coef > 0.0 or ref is not None:
        if ref is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (log-probs of the responses under the reference model)")
        delta = ref - logp
        kl = torch.exp(delta) - delta - 1.0  # k3 estimator, unbiased and >= 0
        stats["kl_sum"] = float(kl.detach().sum() if m is None else (kl.detach() * mf).sum())
        if cfg.use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + cfg.kl_coef * kl
    if m is not None:
        per_token = per_token * mf
    loss = per_token.sum() * weight
    if bonus_weight:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs each token's entropy with autograd")
        kept = entropy if keep is None else entropy * keep.to(entropy.dtype)
        if m is not None:
            kept = kept * m.to(entropy.dtype)
        loss = loss - bonus_weight * kept.sum()
    stats["loss"] = float(loss.detach())
    return loss, stats
