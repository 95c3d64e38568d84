"""GRPO advantages from one or several reward functions, as TRL 1.16's `GRPOTrainer` defines them.

Rewards come as an [N, K] table: N answers, group-major (G answers of prompt 0, then of prompt 1, ...), K reward
functions. A NaN is a function that does not apply to that answer (the function returned None); an answer that no
function applies to is unscorable: it is left out of every mean and std and its advantage is 0.

- sum_then_normalize: r = the weighted sum over the functions (NaNs skipped); advantage = r - the group's mean,
  divided by std + 1e-4, the std of the group (`scale_rewards` group), of all N (batch), or not at all (none).
- normalize_then_sum (GDPO): each function normalized in its group, (x - mean) / (std + 1e-4); the weighted sum
  then normalized over all N, (s - mean) / (std + 1e-4). `scale_rewards` plays no part (as in TRL).
Every std is the unbiased one over the values present. With fewer than two values it is undefined: the group's
advantages are then 0 (sum_then_normalize), or that function adds 0 to the sum (normalize_then_sum). A group of
one answer (group_size 1) has std 0, as in TRL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

ScaleRewards = Literal["group", "batch", "none"]
Aggregation = Literal["sum_then_normalize", "normalize_then_sum"]
EPS = 1e-4  # TRL's: added to every std before dividing


def needs_batch(scale_rewards: ScaleRewards, aggregation: Aggregation) -> bool:
    """Whether an answer's advantage depends on other groups' rewards (then all the step's groups must be scored
    before any advantage is computed)."""
    return scale_rewards == "batch" or aggregation == "normalize_then_sum"


def _nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased std along `dim` (kept) over the non-NaN values; NaN where fewer than two are present."""
    present = (~x.isnan()).sum(dim=dim, keepdim=True)
    squares = ((x - x.nanmean(dim=dim, keepdim=True)) ** 2).nansum(dim=dim, keepdim=True)
    return torch.where(present > 1, squares / (present - 1), float("nan")).sqrt()


def _batch_std(s: torch.Tensor) -> torch.Tensor:
    """The std over all the step's answers (0 for a single answer)."""
    return _nanstd(s, 0) if s.numel() > 1 else torch.zeros(1, dtype=s.dtype)


def weighted_rewards(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N] weighted sums of the [N, K] rewards over the functions that apply (NaN where none does)."""
    return _weighted(rewards, weights, rewards.isnan().all(dim=1))


def _weighted(values: torch.Tensor, weights: torch.Tensor, unscorable: torch.Tensor) -> torch.Tensor:
    return (values * weights).nansum(dim=1).masked_fill(unscorable, float("nan"))  # nansum would make them 0


def advantages(rewards: Sequence[float] | Sequence[Sequence[float]] | torch.Tensor, group_size: int,
               weights: Sequence[float] | None = None, scale_rewards: ScaleRewards = "group",
               aggregation: Aggregation = "sum_then_normalize", eps: float = EPS) -> torch.Tensor:
    """Advantages (float64, [N]) of N = groups x `group_size` answers from their rewards ([N, K]: one column per
    reward function, NaN where a function does not apply; [N] for one function), with one weight per function
    (default 1 each). `scale_rewards` batch and `aggregation` normalize_then_sum use all N answers' rewards, so
    pass every group of the step."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.dim() == 1:
        r = r[:, None]
    if r.dim() != 2 or r.numel() == 0:
        raise ValueError(f"advantages needs rewards of shape [answers, reward functions] (or [answers]), got "
                         f"{tuple(r.shape)}")
    n, k = r.shape
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} answers do not split into groups of {group_size}; pass every answer of every group, "
                         "group after group")
    w = torch.ones(k, dtype=torch.float64) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    if w.shape != (k,):
        raise ValueError(f"{w.numel()} reward weights for {k} reward functions; give one weight per function")
    if r.isinf().any():
        raise ValueError("a reward is infinite; rewards must be finite numbers (or NaN: the function does not apply)")
    groups = n // group_size
    unscorable = r.isnan().all(dim=1)
    if aggregation == "sum_then_normalize":
        s = _weighted(r, w, unscorable)
        grouped = s.view(groups, group_size)
        adv = (grouped - grouped.nanmean(dim=1, keepdim=True)).flatten()
        if scale_rewards == "group":
            std = _nanstd(grouped, 1) if group_size > 1 else torch.zeros(groups, 1, dtype=s.dtype)
            adv = adv / (std.expand(groups, group_size).flatten() + eps)
        elif scale_rewards == "batch":
            adv = adv / (_batch_std(s) + eps)
        elif scale_rewards != "none":
            raise ValueError(f"scale_rewards {scale_rewards!r}: use group, batch or none")
    elif aggregation == "normalize_then_sum":
        per = r.view(groups, group_size, k)
        std_k = _nanstd(per, 1) if group_size > 1 else torch.zeros(groups, 1, k, dtype=r.dtype)
        normalized = ((per - per.nanmean(dim=1, keepdim=True)) / (std_k + eps)).view(n, k)
        # a function normalized to NaN (one answer of the group had it) adds 0 to a scorable answer
        s = _weighted(normalized, w, unscorable)
        adv = (s - s.nanmean()) / (_batch_std(s) + eps)
    else:
        raise ValueError(f"multi_objective_aggregation {aggregation!r}: use sum_then_normalize or normalize_then_sum")
    return adv.nan_to_num(nan=0.0)  # unscorable answers, and groups too small for a std, carry no signal


def group_advantages(rewards: Sequence[float] | torch.Tensor, scale: bool = True, eps: float = EPS) -> torch.Tensor:
    """One group, one reward: r - mean(r), divided by the group's (unbiased) std + eps when `scale` (Dr. GRPO sets
    scale=False). A NaN reward is unscorable: left out of the mean and std, advantage 0."""
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if r.numel() == 0:
        raise ValueError("group_advantages needs at least one reward")
    return advantages(r, r.numel(), scale_rewards="group" if scale else "none", eps=eps)
