"""Prompt capture: run prompt[:-1] in chunks without autograd and keep each layer's prefix state.

With a sequence-parallel group (`parallel`), every rank runs every chunk (see longstraw/parallel/sequence.py);
each keeps the rows of its own token range, and chunks never straddle two ranges.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..models.protocol import PrefixLM
from ..parallel import SequenceParallel
from ..state import LayerState, PrefixState, PrefixView, Segment, boundary_states
from .checks import as_ids

DEFAULT_CHUNK = 2048


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
    parallel: SequenceParallel | None = None,
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


def empty_state(model: PrefixLM, prompt_ids: torch.Tensor, chunk_size: int,
                parallel: SequenceParallel | None = None) -> PrefixState:
    p = next(model.parameters())
    n = prompt_ids.numel() - 1
    if parallel is None:
        layers = model.empty_state(n, p.dtype, p.device)
        return PrefixState(layers, prompt_ids.to(p.device), chunk_ranges(n, chunk_size), model.config.fingerprint)
    ranges = parallel.ranges(n)
    a, b = ranges[parallel.rank]
    chunks = [c for ra, rb in ranges for c in chunk_ranges(rb, chunk_size, ra)]
    layers = model.empty_state(b - a, p.dtype, p.device)
    return PrefixState(layers, prompt_ids.to(p.device), chunks, model.config.fingerprint, shard=(a, b))


def store_chunk(state: PrefixState, start: int, emitted: dict[int, LayerState]) -> None:
    """Add a chunk's emitted state (batch row 0) to the prefix state: its rows where they are owned."""
    owned = state.owns(start)
    for i, new in emitted.items():
        layer = state.layers[i]
        state.layers[i] = layer.append(start - state.offset, new.row(0)) if owned else layer.advance(new.row(0))


def check_prompt(model: PrefixLM, prompt_ids, parallel: SequenceParallel | None) -> torch.Tensor:
    cfg = model.config
    prompt = as_ids(prompt_ids, "prompt", cfg.vocab_size)
    if prompt.numel() > cfg.max_position_embeddings:
        raise ValueError(f"prompt of {prompt.numel()} tokens exceeds max_position_embeddings {cfg.max_position_embeddings}")
    if parallel is not None:
        parallel.check_same(prompt, "prompt")
        if prompt.numel() - 1 < parallel.size:
            raise ValueError(f"a prompt of {prompt.numel()} tokens leaves some of the {parallel.size} sequence-parallel "
                             f"ranks without a token; use fewer ranks or a longer prompt")
    return prompt


@torch.no_grad()
def capture(
    model: PrefixLM,
    prompt_ids,
    chunk_size: int = DEFAULT_CHUNK,
    *,
    progress: bool = False,
    parallel: SequenceParallel | None = None,
    boundary_every: int | None = None,
) -> PrefixState:
    """State of `prompt[:-1]` per layer, computed chunk by chunk without autograd (this rank's shard of it, with
    `parallel`; every rank of the group passes the same prompt).

    `boundary_every=k` also keeps exact mode's boundary states at the start of chunks 0, k, 2k, ... (those this
    rank owns) in `state.boundaries`, so that a stored state can run the prompt backward without a recapture.
    """
    prompt = check_prompt(model, prompt_ids, parallel)
    return capture_checked(model, prompt, chunk_size, progress, parallel, boundary_every=boundary_every)


@torch.no_grad()
def capture_checked(model: PrefixLM, prompt: torch.Tensor, chunk_size: int, progress: bool = False,
                    parallel: SequenceParallel | None = None, *, boundary_every: int | None = None) -> PrefixState:
    """`capture` of a prompt that `check_prompt` has already checked (its checks are collectives with `parallel`)."""
    if boundary_every is not None and (isinstance(boundary_every, bool) or not isinstance(boundary_every, int)
                                       or boundary_every < 1):
        raise ValueError(f"boundary_every must be an integer >= 1 (keep every k-th chunk's boundary states) or None "
                         f"(keep none), got {boundary_every!r}")
    state = empty_state(model, prompt, chunk_size, parallel)
    if boundary_every is not None:
        state.boundary_every = boundary_every
    for i, (s, e) in enumerate(tqdm(state.chunks, desc="capture", unit="chunk", disable=not progress, leave=False)):
        # as exact mode's capture keeps them (global chunk index, owner only), before the chunk moves the state on
        if boundary_every is not None and i % boundary_every == 0 and state.owns(s):
            state.boundaries[i] = boundary_states(state.layers)
        store_chunk(state, s, run_chunk(model, state, s, e, parallel=parallel))
    return state
