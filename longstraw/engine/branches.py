"""`Branches`: the responses of a GRPO group (or a slice of them) with what the loss needs of each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..grpo import GRPOConfig, token_weights
from .checks import as_advantages, as_responses, check_per_token


@dataclass(frozen=True)
class Branches:
    """`tokens[i]` is response i; the loss weighs its tokens by `token_weights[i]` (set by the whole group, so a
    slice of it keeps the group's weights) and its advantage. `old_logprobs` (None: on-policy, ratio 1) and
    `ref_logprobs` (the KL term's reference) are per token."""

    tokens: list[torch.Tensor]
    advantages: torch.Tensor  # float64 [n]
    token_weights: list[float]
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None

    @classmethod
    def group(cls, responses: Sequence, advantages: Sequence[float] | torch.Tensor, loss: GRPOConfig, *,
              vocab_size: int, old_logprobs: Sequence | None = None, ref_logprobs: Sequence | None = None
              ) -> "Branches":
        """A whole GRPO group, checked: token ids inside the vocab, one finite advantage per response, finite
        per-token log-probs of the responses' lengths, and reference log-probs when the loss has a KL term."""
        tokens = as_responses(responses, vocab_size)
        ref = check_per_token(ref_logprobs, tokens, "ref_logprobs")
        if loss.kl_coef > 0 and ref is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (log-probs of the responses under the reference model)")
        return cls(tokens, as_advantages(advantages, len(tokens)), token_weights([r.numel() for r in tokens], loss),
                   check_per_token(old_logprobs, tokens, "old_logprobs"), ref)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def token_count(self) -> int:
        return sum(r.numel() for r in self.tokens)

    def padded(self, count: int) -> "Branches":
        """These branches and fillers up to `count`: one-token responses of advantage 0 and token weight 0, which
        add nothing to the loss, its gradient or its statistics (a group's ranks replay their own equal shares of
        the branches, so G need not divide by their number)."""
        extra = count - len(self)
        if extra <= 0:
            return self
        one = torch.zeros(1, dtype=torch.long, device=self.tokens[0].device)  # token 0: in every vocab
        fill = lambda xs: None if xs is None else xs + [torch.zeros(1, dtype=xs[0].dtype)] * extra  # noqa: E731
        return Branches(self.tokens + [one] * extra, torch.cat([self.advantages, self.advantages.new_zeros(extra)]),
                        self.token_weights + [0.0] * extra, fill(self.old_logprobs), fill(self.ref_logprobs))

    def select(self, idx: Sequence[int]) -> "Branches":
        """The branches `idx` (e.g. a data-parallel group's share, or one replay batch)."""
        idx = list(idx)
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        return Branches(pick(self.tokens), self.advantages[idx], pick(self.token_weights), pick(self.old_logprobs),
                        pick(self.ref_logprobs))
