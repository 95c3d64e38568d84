"""Prompt capture: run prompt[:-1] in chunks without autograd and keep each layer's prefix state."""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from ..state import AttentionState, PrefixState, Segment
from .checks import as_ids

DEFAULT_CHUNK = 2048


def chunk_ranges(length: int, chunk_size: int) -> list[tuple[int, int]]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return [(s, min(s + chunk_size, length)) for s in range(0, length, chunk_size)]


def run_chunk(
    model: nn.Module, state: PrefixState, start: int, end: int, grad: list[AttentionState] | None = None
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Forward prompt[start:end] over the state of prompt[:start]; returns each layer's new K/V [1, Hkv, C, d].

    Under autograd, `grad` receives dLoss/d(state[:start]) during the backward of the returned K/V.
    """
    ids = state.prompt_ids[start:end][None]
    seg = Segment(start=start, prefix=state.layers, prefix_len=start, grad=grad, collect=True)
    model(ids, seg, logits_from=None)
    return seg.emitted


def empty_state(model: nn.Module, prompt_ids: torch.Tensor, chunk_size: int) -> PrefixState:
    p = next(model.parameters())
    n = prompt_ids.numel() - 1
    layers = [
        AttentionState(
            torch.empty(h, n, d, dtype=p.dtype, device=p.device), torch.empty(h, n, d, dtype=p.dtype, device=p.device)
        )
        for h, d in model.state_layers()
    ]
    return PrefixState(layers, prompt_ids.to(p.device), chunk_ranges(n, chunk_size), model.config.fingerprint)


def store_chunk(state: PrefixState, start: int, emitted: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    for i, (k, v) in emitted.items():
        n = k.shape[2]
        state.layers[i].k[:, start : start + n] = k[0]
        state.layers[i].v[:, start : start + n] = v[0]


@torch.no_grad()
def capture(
    model: nn.Module, prompt_ids, chunk_size: int = DEFAULT_CHUNK, *, progress: bool = False
) -> PrefixState:
    """State of `prompt[:-1]` (K/V per attention layer), computed chunk by chunk without autograd."""
    cfg = model.config
    prompt = as_ids(prompt_ids, "prompt", cfg.vocab_size)
    if prompt.numel() > cfg.max_position_embeddings:
        raise ValueError(f"prompt of {prompt.numel()} tokens exceeds max_position_embeddings {cfg.max_position_embeddings}")
    state = empty_state(model, prompt, chunk_size)
    for s, e in tqdm(state.chunks, desc="capture", unit="chunk", disable=not progress, leave=False):
        store_chunk(state, s, run_chunk(model, state, s, e))
    return state
