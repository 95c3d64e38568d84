"""The engine's unit of work: one prompt chunk run on the state of the chunks before it.

A chunk reads the per-token rows of the earlier chunks and the fixed-size states at its start (or leaves standing
for them), and emits what it adds to the state. Capture runs chunks without autograd; exact mode runs them with
autograd, from capture (the kept graphs) or in the prompt backward (recomputed). Sharded over a
sequence-parallel group, every rank runs every chunk (longstraw/parallel/sequence.py); each keeps the rows of
its own token range, and chunks never straddle two ranges.
"""

from __future__ import annotations

import torch

from ..models.protocol import PrefixLM
from ..parallel import ONE_RANK, SequenceGroup
from ..state import LayerState, PrefixState, PrefixView, Segment
from .checks import as_ids

Kept = tuple[dict[int, LayerState], list[LayerState]]  # a chunk's emitted state and the leaves it read


def chunk_ranges(length: int, chunk_size: int, start: int = 0) -> list[tuple[int, int]]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return [(s, min(s + chunk_size, length)) for s in range(start, length, chunk_size)]


def run_chunk(
    model: PrefixLM,
    state: PrefixState,
    start: int,
    end: int,
    prefix: list[LayerState] | None = None,
    grad: dict[int, LayerState] | None = None,
    parallel: SequenceGroup = ONE_RANK,
) -> dict[int, LayerState]:
    """Forward prompt[start:end] on the state of prompt[:start]; returns what each layer adds to the state.

    `prefix` overrides the layers' states (exact mode passes boundary states as autograd leaves); per-token
    layers read their rows [:start]. Under autograd, `grad` (dState sinks) receives dLoss/dPrefix.
    """
    ids = state.prompt_ids[start:end][None]
    view = PrefixView(prefix or state.layers, start, grad, state.offset, parallel)
    seg = Segment(start=start, prefix=view, collect=True)
    model.emit_states(ids, seg)
    return seg.emitted


def chunk_with_graph(model: PrefixLM, state: PrefixState, i: int, grad: dict[int, LayerState],
                     boundary: dict[int, LayerState], parallel: SequenceGroup = ONE_RANK) -> Kept:
    """Chunk i with autograd (call it under enable_grad), reading leaves: its `boundary` states as fresh ones (so
    each chunk's graph stands alone), the per-token rows before it as themselves (their gradient goes into
    `grad`)."""
    s, e = state.chunks[i]
    leaves = [boundary.get(j, layer).leaf() for j, layer in enumerate(state.layers)]
    return run_chunk(model, state, s, e, leaves, grad, parallel), leaves


def empty_state(model: PrefixLM, prompt_ids: torch.Tensor, chunk_size: int,
                parallel: SequenceGroup = ONE_RANK) -> PrefixState:
    """The state before any chunk: this rank's rows of its token range, to fill; chunks cut at the ranges."""
    p = next(model.parameters())
    ranges = parallel.ranges(prompt_ids.numel() - 1)
    a, b = ranges[parallel.rank]
    chunks = [c for ra, rb in ranges for c in chunk_ranges(rb, chunk_size, ra)]
    layers = model.empty_state(b - a, p.dtype, p.device)
    return PrefixState(layers, prompt_ids.to(p.device), chunks, model.config.fingerprint, shard=(a, b))


def chunks_per_rank(state: PrefixState, parallel: SequenceGroup) -> list[int]:
    owners = [parallel.owner(s, state.length) for s, _ in state.chunks]
    return [owners.count(r) for r in range(parallel.size)]


def store_chunk(state: PrefixState, start: int, emitted: dict[int, LayerState]) -> None:
    """Add a chunk's emitted state (batch row 0) to the prefix state: its rows where they are owned."""
    owned = state.owns(start)
    for i, new in emitted.items():
        layer = state.layers[i]
        state.layers[i] = layer.append(start - state.offset, new.row(0)) if owned else layer.advance(new.row(0))


def check_prompt(model: PrefixLM, prompt_ids, parallel: SequenceGroup = ONE_RANK) -> torch.Tensor:
    """The prompt as int64 ids, checked against the vocab, the model's positions and the group (the same prompt
    on every rank, at least one token per rank)."""
    cfg = model.config
    prompt = as_ids(prompt_ids, "prompt", cfg.vocab_size)
    if prompt.numel() > cfg.max_position_embeddings:
        raise ValueError(f"prompt of {prompt.numel()} tokens exceeds max_position_embeddings {cfg.max_position_embeddings}")
    parallel.check_same(prompt, "prompt")
    if parallel.size > 1 and prompt.numel() - 1 < parallel.size:  # one rank may hold an empty state
        raise ValueError(f"a prompt of {prompt.numel()} tokens leaves some of the {parallel.size} sequence-parallel "
                         f"ranks without a token; use fewer ranks or a longer prompt")
    return prompt
