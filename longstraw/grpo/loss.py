"""GRPO objective: group advantages, the clipped surrogate with optional KL, and the loss aggregations."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

# what EngineConfig (longstraw/engine/config.py) holds: how the gradient is computed, not what it is
ENGINE_KEYS = ("prompt_chunk", "prompt_graph_budget", "branch_batch", "boundary_every")
LossAgg = Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"]


class GRPOConfig(BaseModel):
    """The GRPO loss: clipping, KL, aggregation. How the engine computes its gradient is `EngineConfig`."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="ratio clipped below at 1 - clip_low")
    clip_high: float = Field(0.2, ge=0.0, description="ratio clipped above at 1 + clip_high (DAPO: clip-higher)")
    kl_coef: float = Field(0.0, ge=0.0, description="weight of the k3 KL estimator to the reference policy")
    loss_agg: LossAgg = Field(
        "seq_mean_token_mean",
        description="seq_mean_token_mean: original GRPO; token_mean: DAPO; seq_mean_token_sum_norm: Dr. GRPO",
    )
    norm_len: int | None = Field(
        None, ge=1, description="Dr. GRPO's constant length divisor; default: the group's longest response"
    )

    @model_validator(mode="before")
    @classmethod
    def _engine_keys(cls, data):
        moved = sorted(k for k in ENGINE_KEYS if isinstance(data, dict) and k in data)
        if moved:
            raise ValueError(f"{', '.join(moved)} moved from the loss's settings to the engine's: write "
                             f"engine: {{{moved[0]}: ...}} (EngineConfig), not grpo: {{{moved[0]}: ...}}")
        return data


def group_advantages(rewards: Sequence[float] | torch.Tensor, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """r - mean(r), divided by the (unbiased) std of the group when `scale` (Dr. GRPO sets scale=False)."""
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if r.numel() == 0:
        raise ValueError("group_advantages needs at least one reward")
    adv = r - r.mean()
    if scale and r.numel() > 1:
        adv = adv / (r.std() + eps)
    return adv


def token_weights(lengths: Sequence[int], cfg: GRPOConfig) -> list[float]:
    """Weight of every token of branch i in the group loss; the loss is a weighted sum over branch tokens."""
    g = len(lengths)
    if cfg.loss_agg == "seq_mean_token_mean":
        return [1.0 / (g * n) for n in lengths]
    if cfg.loss_agg == "token_mean":
        return [1.0 / sum(lengths)] * g
    norm = cfg.norm_len or max(lengths)
    return [1.0 / (g * norm)] * g


def branch_loss(
    logp: torch.Tensor,
    advantage: float,
    weight: float,
    cfg: GRPOConfig,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted GRPO loss of one branch's tokens (logp: [R], with autograd) and its token-summed stats."""
    old = logp.detach() if old_logp is None else old_logp.to(logp)
    ratio = torch.exp(logp - old)
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * advantage
    per_token = -torch.minimum(unclipped, clipped)
    stats = {"clipped_tokens": float((clipped < unclipped).sum())}
    if cfg.kl_coef > 0.0 or ref_logp is not None:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (log-probs of the responses under the reference model)")
        delta = ref_logp.to(logp) - logp
        kl = torch.exp(delta) - delta - 1.0  # k3 estimator, unbiased and >= 0
        per_token = per_token + cfg.kl_coef * kl
        stats["kl_sum"] = float(kl.detach().sum())
    loss = per_token.sum() * weight
    stats["loss"] = float(loss.detach())
    return loss, stats
