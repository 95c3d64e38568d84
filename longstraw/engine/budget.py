"""How much memory exact mode's kept prompt-chunk graphs take: autograd-saved bytes per token, measured.

The measurement runs two probe chunks (on top of a one-token prefix, so every mixer takes the path a real chunk
takes) with autograd and sums the storage of every tensor autograd saves, each storage once. The difference of
the two, per token, cancels what does not grow with the chunk (the parameters autograd saves, fixed-size
states). It is measured once per model, dtype and device. What it cannot see: DSA's selected positions grow with
min(index_topk, visible tokens), which the short probe keeps below index_topk.
"""

from __future__ import annotations

import weakref

import torch

from ..memory import free_bytes
from ..models.protocol import PrefixLM
from ..parallel import ONE_RANK, SequenceGroup
from ..state import PrefixView, Segment
from .chunks import empty_state, run_chunk, store_chunk

PROBE_TOKENS = 64  # and twice that: whole chunks of the chunked delta rule, which pads to 64
_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _saved_bytes(model: PrefixLM, ids: torch.Tensor, prefix: list, tokens: int) -> int:
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    seg = Segment(start=1, prefix=PrefixView(prefix, 1), collect=True)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.emit_states(ids[None, 1 : 1 + tokens], seg)
    return sum(storages.values())


def activation_bytes_per_token(model: PrefixLM) -> int:
    """Autograd-saved bytes per token of a prompt chunk run with autograd (what a kept chunk graph holds)."""
    p = next(model.parameters())
    key = (p.dtype, p.device)
    cache = _MEASURED.setdefault(model, {})
    if key not in cache:
        n = 2 * PROBE_TOKENS
        ids = torch.arange(1 + n, device=p.device) % model.config.vocab_size
        state = empty_state(model, ids[:2], 1)
        with torch.no_grad():
            store_chunk(model, state, 0, run_chunk(model, state, 0))
        small = _saved_bytes(model, ids, state.layers, PROBE_TOKENS)
        large = _saved_bytes(model, ids, state.layers, n)
        cache[key] = max(1, -(-(large - small) // PROBE_TOKENS))
    return cache[key]


def checkpointed_bytes_per_token(model: PrefixLM) -> int:
    """What a chunk's graph keeps per token under per-layer checkpointing: each layer's input."""
    p = next(model.parameters())
    return len(model.decoder_layers) * model.config.hidden_size * p.element_size()


def kept_chunk_count(model: PrefixLM, chunks: list[tuple[int, int]], budget: int,
                     checkpoint_layers: bool = False) -> int:
    """How many final prompt chunks fit the graph budget (graphs of checkpointed layers, with
    `checkpoint_layers`)."""
    if budget <= 0:  # nothing to measure
        return 0
    per_token = checkpointed_bytes_per_token(model) if checkpoint_layers else activation_bytes_per_token(model)
    kept, used = 0, 0
    for s, e in reversed(chunks):
        used += (e - s) * per_token
        if used > budget:
            break
        kept += 1
    return kept


def checkpoints_layers(model: PrefixLM, setting: bool | None, tokens: int, parallel: SequenceGroup = ONE_RANK) -> bool:
    """`EngineConfig.checkpoint_layers` for a forward of `tokens` tokens with autograd: as set, or (None) whether
    the whole model's activations of those tokens exceed a quarter of free memory (the least over the group: its
    ranks must agree, since a recomputed layer repeats its collectives in the backward)."""
    if setting is not None:
        return setting
    free = parallel.agree_min(free_bytes(next(model.parameters()).device))
    return activation_bytes_per_token(model) * tokens > free // 4
