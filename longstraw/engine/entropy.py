"""What the entropy options need of the whole group before any branch's backward.

`top_entropy_quantile` keeps in the policy loss the tokens whose entropy reaches the group's quantile (TRL's
`get_high_entropy_mask`, over every kept token of the group); `entropy_coef`'s bonus is a mean over the tokens the
policy loss keeps. Both are functions of the whole group, while a replay batch holds a few branches: so the
threshold comes from one no-autograd pass over the group's branches first (each rank scores them all: a forward
of G short branches, against the replay's forward and backward), and enters each branch's loss as a fixed mask
and weight. The mask is piecewise constant in the parameters, so it adds no gradient of its own; the bonus's
gradient comes from the replay's entropies, which carry autograd. Tokens the model did not write (`Branches.masks`
False) are in neither: not in the quantile's pool, never kept, not counted by the bonus.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ..grpo import GRPOConfig
from .branches import Branches


def quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """The q-quantile of a 1-D tensor with linear interpolation between order statistics (`torch.quantile`'s
    default), without its limit of 2**24 values."""
    s = values.sort().values
    pos = q * (s.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, s.numel() - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def with_entropy_weights(branches: Branches, cfg: GRPOConfig,
                         entropies: Callable[[], list[torch.Tensor]]) -> Branches:
    """`branches` (a whole group) with `entropy_keep` (top-entropy quantile < 1) and `bonus_weights`
    (entropy_coef > 0) set; `entropies()` gives each branch's per-token entropies, asked only for the quantile."""
    if not cfg.entropy_needed:
        return branches
    keep = None
    if cfg.top_entropy_quantile < 1.0:
        ents = [e.detach().cpu().flatten() for e in entropies()]
        masks = [None if (m := branches.mask(i)) is None else m.cpu() for i in range(len(ents))]
        pool = [e if masks[i] is None else e[masks[i]] for i, e in enumerate(ents) if branches.is_kept(i)]
        if pool and (flat := torch.cat(pool)).numel():
            threshold = quantile(flat, 1.0 - cfg.top_entropy_quantile)
            keep = [(e >= threshold) & branches.is_kept(i) for i, e in enumerate(ents)]
            keep = [k if m is None else k & m for k, m in zip(keep, masks)]
        else:
            keep = [torch.zeros(e.numel(), dtype=torch.bool) for e in ents]
    bonus = None
    if cfg.entropy_coef > 0.0:
        count = sum(int(keep[i].sum()) if keep is not None else
                    (r.numel() if branches.masks is None else int(branches.masks[i].sum()))
                    for i, r in enumerate(branches.tokens) if branches.is_kept(i))
        bonus = [cfg.entropy_coef / count if count and branches.is_kept(i) else 0.0 for i in range(len(branches))]
    return replace(branches, entropy_keep=keep, bonus_weights=bonus)
