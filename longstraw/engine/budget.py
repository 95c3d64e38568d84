"""How much memory exact mode's kept prompt-chunk graphs take: autograd-saved bytes per token, measured.

The measurement runs two probe chunks (on top of a one-token prefix, so every mixer takes the path a real chunk
takes) with autograd and sums the storage of every tensor autograd saves, each storage once. The difference of
the two, per token, cancels what does not grow with the chunk (the parameters autograd saves, fixed-size
states). It is measured once per model, dtype and device. What it cannot see: DSA's selected positions grow with
min(index_topk, visible tokens), which the short probe keeps below index_topk.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from ..models.protocol import PrefixLM
from ..segment import PrefixView, Segment
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


def kept_chunk_count(chunk_tokens: Sequence[int], budget: int, per_token: Callable[[], int]) -> int:
    """How many final prompt chunks (of `chunk_tokens` tokens each) have graphs that fit `budget` bytes at
    `per_token()` bytes a token (asked only for a budget)."""
    if budget <= 0:  # nothing to measure
        return 0
    per = per_token()
    kept, used = 0, 0
    for t in reversed(chunk_tokens):
        used += t * per
        if used > budget:
            break
        kept += 1
    return kept
