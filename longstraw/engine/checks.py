"""Input validation shared by capture, score and grpo_backward: clear errors before any compute."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..models.config import ModelConfig
from ..models.protocol import PrefixLM
from ..parallel import ONE_RANK, SequenceGroup
from ..state import PrefixState


def as_ids(ids, what: str, vocab: int) -> torch.Tensor:
    t = torch.as_tensor(ids)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise ValueError(f"{what} must be a 1-D sequence of token ids, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{what} is empty; every prompt and response needs at least one token")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{what} must hold integer token ids, got {t.dtype}")
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= vocab:
        bad = hi if hi >= vocab else lo
        raise ValueError(f"{what} has token id {bad} outside the model vocab [0, {vocab}); check the tokenizer")
    return t.long()


def as_responses(responses: Sequence, vocab: int) -> list[torch.Tensor]:
    if len(responses) == 0:
        raise ValueError("responses is empty; a GRPO group needs at least one response")
    return [as_ids(r, f"response {i}", vocab) for i, r in enumerate(responses)]


def check_positions(prompt_len: int, responses: list[torch.Tensor], model_config: ModelConfig) -> None:
    """Prompt + the longest response within the positions the model accepts (`ModelConfig.max_positions`)."""
    longest = max(r.numel() for r in responses)
    if prompt_len + longest > model_config.max_positions:
        raise ValueError(model_config.positions_error(
            f"prompt ({prompt_len:,}) + longest response ({longest:,}) = {prompt_len + longest:,} tokens",
            prompt_len + longest))


def check_per_token(values: Sequence | None, responses: list[torch.Tensor], what: str,
                    nan_outside: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
    """Per-token values, one finite value per response token. `nan_outside` (each response's mask): NaN is
    allowed where the mask is False (tokens the model did not write, which the sampler never scored)."""
    if values is None:
        return None
    if len(values) != len(responses):
        raise ValueError(f"{what} has {len(values)} entries for {len(responses)} responses")
    out = []
    for i, (v, r) in enumerate(zip(values, responses)):
        v = torch.as_tensor(v, dtype=torch.float32 if not torch.is_tensor(v) else None).flatten()
        if v.numel() != r.numel():
            raise ValueError(f"{what}[{i}] has {v.numel()} values for a response of {r.numel()} tokens")
        bad = ~torch.isfinite(v)
        if nan_outside is not None:
            bad &= ~(torch.isnan(v) & ~nan_outside[i].to(v.device))
        if bad.any():
            wrote = ", which the model wrote" if nan_outside is not None else ""
            raise ValueError(f"{what}[{i}] holds non-finite values (NaN or inf) at token {int(bad.nonzero()[0])}"
                             f"{wrote}; log-probs must be finite (recompute them, or check the sampler)")
        out.append(v)
    return out


def as_masks(masks: Sequence | None, responses: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Each response's loss mask (bool [R_i], True where the model wrote the token), checked; None: all."""
    if masks is None:
        return None
    if len(masks) != len(responses):
        raise ValueError(f"masks has {len(masks)} entries for {len(responses)} responses (one bool mask each)")
    out = []
    for i, (m, r) in enumerate(zip(masks, responses)):
        m = torch.as_tensor(m)
        if m.dtype != torch.bool:
            raise ValueError(f"masks[{i}] has dtype {m.dtype}; a mask is bool, True where the model wrote the "
                             "token (pass mask.bool())")
        m = m.flatten()
        if m.numel() != r.numel():
            raise ValueError(f"masks[{i}] has {m.numel()} values for a response of {r.numel()} tokens")
        out.append(m)
    return out


def as_advantages(advantages, count: int) -> torch.Tensor:
    """One finite advantage per response, as float64 [count]."""
    adv = torch.as_tensor(advantages, dtype=torch.float64)
    if adv.dim() > 1:
        raise ValueError(f"advantages must be 1-D, one per response, got shape {tuple(adv.shape)}")
    adv = adv.flatten()
    if adv.numel() != count:
        raise ValueError(f"advantages has {adv.numel()} values for {count} responses (one per response)")
    if not torch.isfinite(adv).all():
        raise ValueError(f"advantages hold non-finite values {adv.tolist()}; check the rewards (a group whose "
                         "rewards are all equal has zero advantages, not NaN)")
    return adv


def check_state(model: PrefixLM, state: PrefixState, parallel: SequenceGroup = ONE_RANK) -> None:
    """The state was captured with this model's architecture, and holds this rank's token range of the group."""
    if state.model_fingerprint != model.config.fingerprint:
        raise ValueError(
            "this prefix state was captured with a different model architecture "
            f"({state.model_fingerprint} != {model.config.fingerprint}); capture the prompt again with this model"
        )
    expected = [parallel.chunk_blocks(i, s, e)[parallel.rank] for i, (s, e) in enumerate(state.chunks)]
    if parallel.size == 1:
        expected = [(0, state.length)]
    if list(state.rows.blocks) != expected:
        if parallel.size == 1:
            raise ValueError(f"this prefix state is one rank's shard ({state.rows.rows} of {state.length} tokens); "
                             "pass the `parallel` group it was captured with")
        raise ValueError(f"this prefix state is not rank {parallel.rank}'s part (its block of every chunk) of this "
                         f"{parallel.size}-rank group; capture it with the same `parallel` group")
