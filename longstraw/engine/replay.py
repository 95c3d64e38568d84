"""Replay branches on a prefix state: `[prompt[-1]] + response[:-1]` at positions P-1.., scored on `response`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..models.protocol import PrefixLM
from ..parallel import SequenceParallel
from ..state import LayerState, PrefixState, PrefixView, Segment
from .checks import as_responses, check_positions, check_state


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets], computed in fp32 (or fp64 for fp64 models)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def replay_logprobs(
    model: PrefixLM,
    state: PrefixState,
    responses: list[torch.Tensor],
    grad: dict[int, LayerState] | None = None,
    prefix: list[LayerState] | None = None,
    parallel: SequenceParallel | None = None,
) -> list[torch.Tensor]:
    """Per-token log-probs of a batch of responses, replayed together (right-padded) on the shared state.

    The state is read, never written; with `grad` (dState sinks), backward adds dLoss/dPrefix of the per-token
    layers into it. `prefix` overrides the layers' states (exact mode passes `leaf()`s, views of the state).
    """
    device = state.prompt_ids.device
    longest = max(r.numel() for r in responses)
    inputs = torch.zeros(len(responses), longest, dtype=torch.long, device=device)
    targets = torch.zeros_like(inputs)
    for i, r in enumerate(responses):
        r = r.to(device)
        inputs[i, 0] = state.prompt_ids[-1]
        inputs[i, 1 : r.numel()] = r[:-1]
        targets[i, : r.numel()] = r
    view = PrefixView(prefix or state.layers, state.length, grad, state.offset, parallel)
    seg = Segment(start=state.length, prefix=view)
    # right padding is safe: causal mixers keep real tokens from seeing the padding after them
    logp = token_logprobs(model(inputs, seg), targets)
    return [logp[i, : r.numel()] for i, r in enumerate(responses)]


@torch.no_grad()
def score(model: PrefixLM, state: PrefixState, responses: Sequence, branch_batch: int = 1, *,
          parallel: SequenceParallel | None = None) -> list[torch.Tensor]:
    """Per-token log-probabilities of each response given the captured prompt (no autograd). With `parallel`,
    every rank of the group passes its shard of the state and the same responses, and gets the same result."""
    check_state(model, state, parallel)
    resp = as_responses(responses, model.config.vocab_size)
    check_positions(state.length + 1, resp, model.config.max_position_embeddings)
    out: list[torch.Tensor] = []
    for b in range(0, len(resp), branch_batch):
        out += replay_logprobs(model, state, resp[b : b + branch_batch], parallel=parallel)
    return out
