"""Per-layer activation checkpointing: a layer keeps only its input for the backward, and runs its forward again
when the backward reaches it (torch's non-reentrant checkpoint), so a chunk or a branch holds its layers' inputs
plus one layer's activations at a time, not every layer's.

Two things make a layer of ours more than a function of its input:
- it reads and writes its `Segment`: the state it emits, and DSA's top-k selection that the next "shared" layers
  reuse. The recompute runs with the selection the layer saw the first time and leaves the segment as it found
  it;
- on a sequence-parallel group its forward makes collectives. The recompute is always whole (no early stop), so
  every rank makes the same collectives in the same order whatever tensors its own backward needs.

Within a recomputed layer, the feed-forward half (post-attention norm and a dense MLP: token-wise, and the
widest activations of a layer, intermediate >> hidden) runs in token tiles (`token_tiled`): it keeps only its
input, and its backward runs each tile again on its own, so it holds one tile's MLP activations at a time, not
the chunk's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ...state import Segment

Out = TypeVar("Out")


def recomputed(fn: Callable[[torch.Tensor, tuple, Segment], Out], x: torch.Tensor, rope: tuple, seg: Segment) -> Out:
    """fn(x, rope, seg) (a layer's forward, `capture` or `emit_state`) under activation checkpointing."""
    selection = seg.dsa_topk
    first = True

    def run(x: torch.Tensor) -> Out:
        nonlocal first
        if first:
            first = False
            return fn(x, rope, seg)
        emitted, after = dict(seg.emitted), seg.dsa_topk
        seg.dsa_topk = selection
        try:
            return fn(x, rope, seg)
        finally:
            seg.emitted.clear()
            seg.emitted.update(emitted)
            seg.dsa_topk = after

    with set_checkpoint_early_stop(False):
        return checkpoint(run, x, use_reentrant=False)


def token_tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tiles: int,
                params: list[torch.nn.Parameter]) -> torch.Tensor:
    """fn(x) for a token-wise `fn` of x [B, T, ...] whose weights are `params`: with tiles > 1, over that many
    slices of the T tokens, keeping only x for the backward, which runs `fn` again one slice at a time."""
    if tiles <= 1 or x.shape[1] < 2:
        return fn(x)
    return _TokenTiles.apply(x, fn, -(-x.shape[1] // tiles), *params)


class _TokenTiles(torch.autograd.Function):
    """Each slice's backward is a backward of its own, so its weight gradients add into `.grad` at once: one
    graph over all slices would hold a weight-sized sum per weight until the last slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Callable, size: int, *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.size = fn, size
        ctx.save_for_backward(x)
        return torch.cat([fn(part) for part in x.split(size, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x,) = ctx.saved_tensors
        want_dx = ctx.needs_input_grad[0]
        dx = torch.empty_like(x) if want_dx else None
        for i, (part, dpart) in enumerate(zip(x.split(ctx.size, dim=1), dy.split(ctx.size, dim=1))):
            with torch.enable_grad():
                leaf = part.detach().requires_grad_(want_dx)
                out = ctx.fn(leaf)
                if out.requires_grad:
                    torch.autograd.backward(out, dpart)
            if want_dx:
                dx.narrow(1, i * ctx.size, part.shape[1]).copy_(leaf.grad)
        return dx, None, None, *(None for _ in ctx.needs_input_grad[3:])
