"""The engine's unit of work: one prompt chunk run on the state of the chunks before it.

A chunk reads the per-token rows of the earlier chunks and the fixed-size states at its start (or leaves standing
for them), and emits what it adds to the state. Capture runs chunks without autograd; exact mode runs them with
autograd, from capture (the kept graphs) or in the prompt backward (recomputed).

Over a sequence-parallel group every rank holds its block of every chunk (parallel/sequence.py), and runs only
that block, emitting its rows (the split schedule).
"""

from __future__ import annotations

import torch

from ..models.protocol import PrefixLM
from ..parallel import ONE_RANK, SequenceGroup
from ..segment import ChunkSplit, PrefixView, Segment
from ..state import LayerState, PrefixState, RowMap
from .checks import as_ids

Kept = tuple[dict[int, LayerState], list[LayerState]]  # a chunk's emitted state and the leaves it read


def chunk_ranges(length: int, chunk_size: int, start: int = 0) -> list[tuple[int, int]]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return [(s, min(s + chunk_size, length)) for s in range(start, length, chunk_size)]


def prompt_chunks(length: int, chunk_size: int, parallel: SequenceGroup = ONE_RANK) -> list[tuple[int, int]]:
    """The chunks of a `length`-token state; on a group, a last chunk too short to give every rank a token joins
    the one before it."""
    chunks = chunk_ranges(length, chunk_size)
    if len(chunks) > 1 and chunks[-1][1] - chunks[-1][0] < parallel.size:
        chunks[-2:] = [(chunks[-2][0], chunks[-1][1])]
    return chunks


def held_rows(chunks: list[tuple[int, int]], parallel: SequenceGroup = ONE_RANK) -> RowMap:
    """The positions of the rows this rank of `parallel` holds: its block of every chunk."""
    if parallel.size == 1:
        return RowMap.whole(chunks[-1][1] if chunks else 0)
    return RowMap(tuple(parallel.chunk_blocks(i, s, e)[parallel.rank] for i, (s, e) in enumerate(chunks)))


def run_chunk(
    model: PrefixLM,
    state: PrefixState,
    i: int,
    prefix: list[LayerState] | None = None,
    grad: dict[int, LayerState] | None = None,
    parallel: SequenceGroup = ONE_RANK,
    checkpoint_layers: bool = False,
    routed: dict[int, torch.Tensor] | None = None,
) -> dict[int, LayerState]:
    """Forward chunk i on the state of the chunks before it; returns what each layer adds to the state (the rows
    of this rank's block).

    `prefix` overrides the layers' states (exact mode passes boundary states as autograd leaves); per-token
    layers read their rows before the chunk. Under autograd, `grad` (dState sinks) receives dLoss/dPrefix, and
    `checkpoint_layers` keeps only each layer's input for the backward. With `routed`, each MoE layer's routing
    of the chunk's tokens is recorded into it (`Segment.routed`).
    """
    ids, seg = chunk_segment(state, i, prefix, grad, parallel, checkpoint_layers, record_routing=routed is not None)
    model.emit_states(ids, seg)
    if routed is not None:
        routed.update(seg.routed)
    return seg.emitted


def chunk_segment(state: PrefixState, i: int, prefix: list[LayerState] | None = None,
                  grad: dict[int, LayerState] | None = None, parallel: SequenceGroup = ONE_RANK,
                  checkpoint_layers: bool = False, record_routing: bool = False) -> tuple[torch.Tensor, Segment]:
    """The input ids [1, t] this rank runs of chunk i (its block) and the segment that collects what they emit.
    A state with routing (MoE routing replay) routes the chunk's tokens as it says, unless the segment records
    the routing (capture, filling it in)."""
    s, e = state.chunks[i]
    view = PrefixView(prefix or state.layers, s, grad, state.rows, parallel)
    routing = None if record_routing or state.routing is None else \
        state.routing_rows(*block_rows(state, i, parallel))
    if parallel.size == 1:
        seg = Segment(start=s, prefix=view, collect=True, checkpoint_layers=checkpoint_layers, routing=routing,
                      record_routing=record_routing)
    else:
        blocks = parallel.chunk_blocks(i, s, e)
        a, e = blocks[parallel.rank]
        seg = Segment(start=a, prefix=view, collect=True, split=ChunkSplit(blocks, parallel),
                      checkpoint_layers=checkpoint_layers, routing=routing, record_routing=record_routing)
    return state.prompt_ids[seg.start:e][None], seg


def chunk_with_graph(model: PrefixLM, state: PrefixState, i: int, grad: dict[int, LayerState],
                     boundary: dict[int, LayerState], parallel: SequenceGroup = ONE_RANK,
                     checkpoint_layers: bool = False, routed: dict[int, torch.Tensor] | None = None) -> Kept:
    """Chunk i with autograd (call it under enable_grad), reading leaves: its `boundary` states as fresh ones (so
    each chunk's graph stands alone), the per-token rows before it as themselves (their gradient goes into
    `grad`). `routed`: as `run_chunk`'s."""
    leaves = [boundary.get(j, layer).leaf() for j, layer in enumerate(state.layers)]
    return run_chunk(model, state, i, leaves, grad, parallel, checkpoint_layers, routed), leaves


def block_tokens(state: PrefixState, parallel: SequenceGroup = ONE_RANK) -> int:
    """The most tokens a rank runs of one chunk (its block of the longest), the same on every rank."""
    return max((-(-(e - s) // parallel.size) for s, e in state.chunks), default=0)


def empty_state(model: PrefixLM, prompt_ids: torch.Tensor, chunk_size: int,
                parallel: SequenceGroup = ONE_RANK) -> PrefixState:
    """The state before any chunk: this rank's rows (its block of every chunk), to fill."""
    if chunk_size < parallel.size:
        raise ValueError(f"prompt_chunk {chunk_size} is smaller than the {parallel.size} sequence-parallel ranks that "
                         f"split each chunk; use prompt_chunk >= {parallel.size}")
    p = next(model.parameters())
    chunks = prompt_chunks(prompt_ids.numel() - 1, chunk_size, parallel)
    rows = held_rows(chunks, parallel)
    layers = model.empty_state(rows.rows, p.dtype, p.device)
    return PrefixState(layers, prompt_ids.to(p.device), chunks, model.config.fingerprint, rows=rows)


def block_rows(state: PrefixState, i: int, parallel: SequenceGroup) -> tuple[int, int]:
    """(first row, rows) of this rank's block of chunk i."""
    s, e = state.chunks[i]
    a, b = parallel.chunk_blocks(i, s, e)[parallel.rank]
    return state.rows.before(a), b - a


def store_chunk(model: PrefixLM, state: PrefixState, i: int, emitted: dict[int, LayerState],
                parallel: SequenceGroup = ONE_RANK) -> None:
    """Add chunk i's emitted state (batch row 0) to the prefix state: this rank's block of its rows."""
    row, _ = block_rows(state, i, parallel)
    for j, new in emitted.items():
        state.layers[j] = state.layers[j].append(row, new.row(0))


def store_routing(state: PrefixState, i: int, routed: dict[int, torch.Tensor], parallel: SequenceGroup = ONE_RANK
                  ) -> None:
    """Add the experts chunk i's tokens were routed to (`Segment.routed`, batch row 0) to the state's routing:
    this rank's block of its rows."""
    row, count = block_rows(state, i, parallel)
    for j, ids in routed.items():
        state.routing[j][row : row + count] = ids[0]


def check_prompt(model: PrefixLM, prompt_ids, parallel: SequenceGroup = ONE_RANK) -> torch.Tensor:
    """The prompt as int64 ids, checked against the vocab, the model's positions and the group (the same prompt
    on every rank, at least one token per rank)."""
    cfg = model.config
    prompt = as_ids(prompt_ids, "prompt", cfg.vocab_size)
    if prompt.numel() > cfg.max_positions:
        raise ValueError(cfg.positions_error(f"prompt of {prompt.numel():,} tokens", prompt.numel()))
    parallel.check_same(prompt, "prompt")
    if parallel.size > 1 and prompt.numel() - 1 < parallel.size:  # one rank may hold an empty state
        raise ValueError(f"a prompt of {prompt.numel()} tokens leaves some of the {parallel.size} sequence-parallel "
                         f"ranks without a token; use fewer ranks or a longer prompt")
    return prompt
