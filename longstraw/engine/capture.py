"""Prompt capture: run prompt[:-1] in chunks without autograd and keep each layer's prefix state."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..models.protocol import PrefixLM
from ..state import LayerState, PrefixState, PrefixView, Segment
from .checks import as_ids

DEFAULT_CHUNK = 2048


def chunk_ranges(length: int, chunk_size: int) -> list[tuple[int, int]]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return [(s, min(s + chunk_size, length)) for s in range(0, length, chunk_size)]


def run_chunk(
    model: PrefixLM,
    state: PrefixState,
    start: int,
    end: int,
    prefix: list[LayerState] | None = None,
    grad: dict[int, LayerState] | None = None,
) -> dict[int, LayerState]:
    """Forward prompt[start:end] on the state of prompt[:start]; returns what each layer adds to the state.

    `prefix` overrides the layers' states (exact mode passes boundary states as autograd leaves); per-token
    layers read their rows [:start]. Under autograd, `grad` (dState sinks) receives dLoss/dPrefix.
    """
    ids = state.prompt_ids[start:end][None]
    seg = Segment(start=start, prefix=PrefixView(prefix or state.layers, start, grad), collect=True)
    model.emit_states(ids, seg)
    return seg.emitted


def empty_state(model: PrefixLM, prompt_ids: torch.Tensor, chunk_size: int) -> PrefixState:
    p = next(model.parameters())
    n = prompt_ids.numel() - 1
    layers = model.empty_state(n, p.dtype, p.device)
    return PrefixState(layers, prompt_ids.to(p.device), chunk_ranges(n, chunk_size), model.config.fingerprint)


def store_chunk(state: PrefixState, start: int, emitted: dict[int, LayerState]) -> None:
    """Add a chunk's emitted state (batch row 0) to the prefix state."""
    for i, new in emitted.items():
        state.layers[i] = state.layers[i].append(start, new.row(0))


@torch.no_grad()
def capture(
    model: PrefixLM,
    prompt_ids,
    chunk_size: int = DEFAULT_CHUNK,
    *,
    progress: bool = False,
) -> PrefixState:
    """State of `prompt[:-1]` per layer, computed chunk by chunk without autograd."""
    cfg = model.config
    prompt = as_ids(prompt_ids, "prompt", cfg.vocab_size)
    if prompt.numel() > cfg.max_position_embeddings:
        raise ValueError(f"prompt of {prompt.numel()} tokens exceeds max_position_embeddings {cfg.max_position_embeddings}")
    state = empty_state(model, prompt, chunk_size)
    for s, e in tqdm(state.chunks, desc="capture", unit="chunk", disable=not progress, leave=False):
        store_chunk(state, s, run_chunk(model, state, s, e))
    return state
