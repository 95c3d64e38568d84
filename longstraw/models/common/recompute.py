"""Per-layer activation checkpointing: a layer keeps only its input for the backward, and runs its forward again
when the backward reaches it (torch's non-reentrant checkpoint), so a chunk or a branch holds its layers' inputs
plus one layer's activations at a time, not every layer's.

Two things make a layer of ours more than a function of its input:
- it reads and writes its `Segment`: the state it emits, and DSA's top-k selection that the next "shared" layers
  reuse. The recompute runs with the selection the layer saw the first time, sends a MoE's tokens to the experts
  the first run chose, and leaves the segment as it found it;
- on a sequence-parallel group its forward makes collectives. The recompute is always whole (no early stop), so
  every rank makes the same collectives in the same order whatever tensors its own backward needs.

An attention layer with a dense MLP recomputes itself over tiles of its queries (`query_tiled`, as many tiles as
its MLP's `recompute_tiles`): its keys and values are computed for all its tokens, then each tile's queries
attend over the prefix, the keys before the tile and its own, and run the MLP, one tile at a time; so it holds
one tile's activations (queries, attention output, MLP) at a time, and the chunk's keys and values. Other layers
(Gated DeltaNet, MLA) recompute whole, their feed-forward half (post-attention norm and a dense MLP: token-wise,
and the widest activations of a layer, intermediate >> hidden) in token tiles (`token_tiled`): it keeps only its
input, and its backward runs each tile again on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ...segment import QueryTile, Segment
from ...state import AttentionState

Out = TypeVar("Out")


def recomputed(fn: Callable[[torch.Tensor, tuple, Segment], Out], x: torch.Tensor, rope: tuple, seg: Segment) -> Out:
    """fn(x, rope, seg) (a layer's forward, `capture` or `emit_state`) under activation checkpointing."""
    selection = seg.dsa_topk
    first = True
    chosen: dict[int, torch.Tensor] = {}  # the experts the first run sent the tokens to, by MoE layer

    def run(x: torch.Tensor) -> Out:
        nonlocal first
        if first:
            first = False
            recording, routed = seg.record_routing, seg.routed
            seg.record_routing, seg.routed = True, chosen
            try:
                return fn(x, rope, seg)
            finally:
                seg.record_routing, seg.routed = recording, routed
                if recording:
                    routed.update(chosen)
        emitted, after, routing, recording = dict(seg.emitted), seg.dsa_topk, seg.routing, seg.record_routing
        seg.dsa_topk = selection
        # a near-tie of the router may fall the other way in the recompute (kernels that are not bitwise
        # deterministic): the recompute routes as the forward did
        seg.routing, seg.record_routing = {**(routing or {}), **chosen}, False
        try:
            return fn(x, rope, seg)
        finally:
            seg.emitted.clear()
            seg.emitted.update(emitted)
            seg.dsa_topk, seg.routing, seg.record_routing = after, routing, recording

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


def tile_bounds(sizes: list[int], tiles: int) -> list[list[tuple[int, int]]] | None:
    """Each rank's (start, end) of `tiles` query tiles, balanced, for ranks with `sizes` tokens (one size: one
    rank); None when a rank has fewer tokens than tiles (every tile of every rank must hold a query, since the
    ranks attend tile by tile together) or there is one tile only."""
    if tiles < 2 or min(sizes) < tiles:
        return None
    return [[(i * n // tiles, (i + 1) * n // tiles) for i in range(tiles)] for n in sizes]


def query_tiled(layer, x: torch.Tensor, rope: tuple, seg: Segment, bounds: list[list[tuple[int, int]]],
                params: list[torch.nn.Parameter]) -> tuple[torch.Tensor, AttentionState]:
    """A recomputed decoder layer whose mixer is attention (keys and values: `AttentionState`) over tiles of its
    queries: (output, the state it emits for x) as `layer._block` gives them, keeping only x for the backward,
    which runs the layer again one tile at a time (`_QueryTiles`). `bounds`: every rank's tiles (`tile_bounds`),
    this rank's at `seg.parallel.rank` when the queries meet every rank's rows, else the only ones."""
    out, k, v = _QueryTiles.apply(x, layer, rope, seg, bounds, *params)
    return out, AttentionState(k, v)


class _QueryTiles(torch.autograd.Function):
    """The layer's keys and values are computed for all its tokens (tile by tile: the normed input never exists
    whole), then each tile of queries (with the MLP after its attention) runs on its own over the prefix, the keys
    before the tile and its own. So the backward holds one tile's activations at a time besides the layer's keys
    and values and their gradients, which gather over the tiles (the keys before a tile and, on a split chunk,
    this block's for the later blocks' queries, add theirs in row blocks) and go back through the key/value
    projections at the end, again tile by tile. The weights' gradients add into `.grad` tile by tile (as
    `_TokenTiles`). On a split chunk the ranks run their tiles together: tile i's queries of every rank visit
    every rank's prefix rows and the blocks before theirs, so the keys never move."""

    @staticmethod
    def forward(ctx, x, layer, rope, seg, bounds, *params):
        ctx.layer, ctx.rope, ctx.seg, ctx.bounds = layer, rope, seg, bounds
        ctx.save_for_backward(x)
        tiles = _mine(bounds, seg)
        k, v = _keys(layer, x, rope, tiles)
        out = torch.empty_like(x)
        for i, (s, e) in enumerate(tiles):
            out[:, s:e] = _tile(layer, x[:, s:e], (k[:, :, s:e], v[:, :, s:e]), (k, v), None, bounds, i, rope, seg)
        return out, k, v

    @staticmethod
    def backward(ctx, dy, dk_emitted, dv_emitted):
        (x,) = ctx.saved_tensors
        layer, rope, seg, bounds = ctx.layer, ctx.rope, ctx.seg, ctx.bounds
        want_dx = ctx.needs_input_grad[0]
        tiles = _mine(bounds, seg)
        k, v = _keys(layer, x, rope, tiles)
        dx = torch.zeros_like(x) if want_dx else None
        # the keys' gradients add up over the tiles, in fp32 for half types
        acc = torch.promote_types(k.dtype, torch.float32)
        dkv = tuple(torch.zeros_like(t, dtype=acc) if g is None else g.to(acc, copy=True)
                    for t, g in ((k, dk_emitted), (v, dv_emitted)))
        for i, (s, e) in reversed(list(enumerate(tiles))):
            with torch.enable_grad():
                x_t = x[:, s:e].detach().requires_grad_(want_dx)
                own = (k[:, :, s:e].detach().requires_grad_(), v[:, :, s:e].detach().requires_grad_())
                out = _tile(layer, x_t, own, (k, v), dkv, bounds, i, rope, seg)
                if out.requires_grad:
                    torch.autograd.backward(out, dy[:, s:e])
            if want_dx and x_t.grad is not None:
                dx[:, s:e].add_(x_t.grad)
            for d, o in zip(dkv, own):
                if o.grad is not None:
                    d[:, :, s:e].add_(o.grad)
            del out, own
        for s, e in tiles:  # the keys' and values' gradients through their projections and the input norm
            with torch.enable_grad():
                x_t = x[:, s:e].detach().requires_grad_(want_dx)
                kv = layer.mixer._kv(layer.input_layernorm(x_t), _rows(rope, s, e))
                live = [(o, d[:, :, s:e].to(o.dtype)) for o, d in zip((kv.k, kv.v), dkv) if o.requires_grad]
                if live:
                    torch.autograd.backward(*map(list, zip(*live)))
            if want_dx and x_t.grad is not None:
                dx[:, s:e].add_(x_t.grad)
        # the segment holds this function's outputs (the state it emitted), which hold ctx: a cycle that would
        # keep the chunk's emitted state alive until the garbage collector runs
        ctx.seg = ctx.layer = ctx.rope = None
        return dx, None, None, None, None, *(None for _ in ctx.needs_input_grad[5:])


def _mine(bounds: list[list[tuple[int, int]]], seg: Segment) -> list[tuple[int, int]]:
    return bounds[seg.parallel.rank] if len(bounds) > 1 else bounds[0]


def _rows(rope: tuple, s: int, e: int) -> tuple:
    return tuple(t[s:e] for t in rope)


def _keys(layer, x: torch.Tensor, rope: tuple, tiles: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's keys and values for x, tile by tile, without autograd."""
    with torch.no_grad():
        parts = [layer.mixer._kv(layer.input_layernorm(x[:, s:e]), _rows(rope, s, e)) for s, e in tiles]
    return torch.cat([p.k for p in parts], dim=2), torch.cat([p.v for p in parts], dim=2)


def _tile(layer, x, own, keys, sinks, bounds, i, rope, seg) -> torch.Tensor:
    """Tile i's output, given its input x, its keys and values `own`, the layer's (`keys`) and the sinks for their
    gradient (`sinks`, None in the forward): the tile's queries see those before it, and on a split chunk the
    later blocks' queries see all of them."""
    s, e = _mine(bounds, seg)[i]
    lead = tuple(t[:, :, :s] for t in keys) if s else None
    lead_grad = tuple(t[:, :, :s] for t in sinks) if s and sinks else None
    tile = QueryTile(lead, [rank[i][1] - rank[i][0] for rank in bounds], lead_grad, keys, sinks)
    return layer._tile_block(x, _rows(rope, s, e), AttentionState(*own), tile, seg)
