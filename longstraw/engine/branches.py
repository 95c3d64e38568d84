"""`Branches`: the responses of a GRPO group (or a slice of them) with what the loss needs of each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from ..grpo import GRPOConfig, token_weights
from .checks import as_advantages, as_masks, as_responses, check_per_token

@dataclass(frozen=True)
class Branches:
    """`tokens[i]` is response i; the loss weighs its tokens by `token_weights[i]` (set by the whole group, so a
    slice of it keeps the group's weights) and its advantage. Per token: `old_logprobs` (None: on-policy, ratio
    1), `ref_logprobs` (the KL term's reference), `sampler_logprobs` (the sampler's own, for the rollout correction
    and the off-policy mask). `kept[i]` False: the branch adds nothing to the loss (a truncated response under
    `mask_truncated_completions`). `entropy_keep` / `bonus_weights` (engine/entropy.py): the tokens of the
    group's top-entropy quantile, and each branch's weight of the entropy bonus. `masks[i]` (bool per token, None:
    all True): the tokens the model wrote; the others (a tool's output in a multi-turn branch) are attended to but
    weigh 0 in every loss and count in no statistic (TRL's `tool_mask`)."""

    tokens: list[torch.Tensor]
    advantages: torch.Tensor  # float64 [n]
    token_weights: list[float]
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None
    sampler_logprobs: list[torch.Tensor] | None = None
    kept: list[bool] | None = None
    entropy_keep: list[torch.Tensor] | None = None
    bonus_weights: list[float] | None = None
    # MoE routing replay (engine/routing.py): each branch's experts [R_i, top_k] by MoE layer ({}: the model routes)
    routing: list[dict[int, torch.Tensor]] | None = None
    masks: list[torch.Tensor] | None = None

    @classmethod
    def group(cls, responses: Sequence, advantages: Sequence[float] | torch.Tensor, loss: GRPOConfig, *,
              vocab_size: int, old_logprobs: Sequence | None = None, ref_logprobs: Sequence | None = None,
              sampler_logprobs: Sequence | None = None, truncated: Sequence[bool] | None = None,
              masks: Sequence | None = None) -> "Branches":
        """A whole GRPO group, checked: token ids inside the vocab, one finite advantage per response, finite
        per-token log-probs of the responses' lengths, reference log-probs when the loss has a KL term, sampler
        log-probs when it corrects for the sampler or masks off-policy branches without old log-probs, one
        `truncated` flag per response, one bool mask per response (the sampler's log-probs may be NaN where it is
        False: the sampler did not write those tokens)."""
        tokens = as_responses(responses, vocab_size)
        masks = as_masks(masks, tokens)
        ref = check_per_token(ref_logprobs, tokens, "ref_logprobs")
        if loss.kl_coef > 0 and ref is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (log-probs of the responses under the reference model)")
        sampler = check_per_token(sampler_logprobs, tokens, "sampler_logprobs", nan_outside=masks)
        old = check_per_token(old_logprobs, tokens, "old_logprobs")
        if sampler is None:
            needs = [f"rollout_correction {loss.rollout_correction}"] if loss.rollout_correction != "off" else []
            if loss.off_policy_mask_threshold is not None and old is None:  # else it would compare the policy to itself
                needs.append("off_policy_mask_threshold (without old_logprobs)")
            if needs:
                raise ValueError(f"{' and '.join(needs)} needs sampler_logprobs (each sampled token's log-prob under "
                                 "the sampler; a rollout stored by an older longstraw has none: delete it so that its "
                                 "step samples it again); pass them, or set rollout_correction: off and leave "
                                 "off_policy_mask_threshold unset")
        kept = None
        if truncated is not None:
            if len(truncated) != len(tokens):
                raise ValueError(f"truncated has {len(truncated)} flags for {len(tokens)} responses")
            kept = [not (loss.mask_truncated_completions and bool(t)) for t in truncated]
        elif loss.mask_truncated_completions:
            raise ValueError("mask_truncated_completions needs to know which responses were truncated: pass "
                             "truncated= (one bool per response: it hit max_new_tokens without a stop token)")
        counted = None if masks is None else [int(m.sum()) for m in masks]
        return cls(tokens, as_advantages(advantages, len(tokens)),
                   token_weights([r.numel() for r in tokens], loss, kept, counted),
                   old, ref, sampler, kept, masks=masks)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def token_count(self) -> int:
        return sum(r.numel() for r in self.tokens)

    @property
    def model_token_count(self) -> int:
        """The tokens the model wrote (the loss's and the statistics' tokens)."""
        return self.token_count if self.masks is None else sum(int(m.sum()) for m in self.masks)

    def mask(self, i: int) -> torch.Tensor | None:
        return None if self.masks is None else self.masks[i]

    def is_kept(self, i: int) -> bool:
        return self.kept is None or self.kept[i]

    def padded(self, count: int) -> "Branches":
        """These branches and fillers up to `count`: one-token responses of advantage 0 and token weight 0, which
        add nothing to the loss, its gradient or its statistics (a group's ranks replay their own equal shares of
        the branches, so G need not divide by their number)."""
        extra = count - len(self)
        if extra <= 0:
            return self
        one = torch.zeros(1, dtype=torch.long, device=self.tokens[0].device)  # token 0: in every vocab
        fillers = {"tokens": one, "token_weights": 0.0, "kept": False, "bonus_weights": 0.0,
                   "entropy_keep": torch.zeros(1, dtype=torch.bool), "routing": {},
                   "masks": torch.ones(1, dtype=torch.bool)}
        grown = {}
        for name in _PER_BRANCH:
            xs = getattr(self, name)
            if xs is not None:
                grown[name] = xs + [fillers.get(name, torch.zeros(1, dtype=xs[0].dtype if torch.is_tensor(xs[0])
                                                                   else torch.float32))] * extra
        return replace(self, advantages=torch.cat([self.advantages, self.advantages.new_zeros(extra)]), **grown)

    def select(self, idx: Sequence[int]) -> "Branches":
        """The branches `idx` (e.g. a data-parallel group's share, or one replay batch)."""
        idx = list(idx)
        picked = {name: [getattr(self, name)[i] for i in idx] for name in _PER_BRANCH if getattr(self, name) is not None}
        return replace(self, advantages=self.advantages[idx], **picked)


# the per-branch lists a slice or a padding carries along (None: not given): every field but the advantages
_PER_BRANCH = tuple(f.name for f in fields(Branches) if f.name != "advantages")
