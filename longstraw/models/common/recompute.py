"""Per-layer activation checkpointing: a layer keeps only its input for the backward, and runs its forward again
when the backward reaches it (torch's non-reentrant checkpoint), so a chunk or a branch holds its layers' inputs
plus one layer's activations at a time, not every layer's.

Two things make a layer of ours more than a function of its input:
- it reads and writes its `Segment`: the state it emits, and DSA's top-k selection that the next "shared" layers
  reuse. The recompute runs with the selection the layer saw the first time and leaves the segment as it found
  it;
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

from ...parallel.sequence import pad_to
from ...state import AttentionState, QueryTile, Segment

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
    and values and their gradients, which gather over the tiles and go back through the key/value projections at
    the end, again tile by tile. The weights' gradients add into `.grad` tile by tile (as `_TokenTiles`).

    On a split chunk the earlier blocks' keys and values are gathered once per pass (forward, and again in the
    backward), and their gradient goes back to their owners once, after the last tile: every rank makes the same
    collectives in the same order."""

    @staticmethod
    def forward(ctx, x, layer, rope, seg, bounds, *params):
        ctx.layer, ctx.rope, ctx.seg, ctx.bounds = layer, rope, seg, bounds
        ctx.save_for_backward(x)
        tiles = _mine(bounds, seg)
        k, v = _keys(layer, x, rope, tiles)
        (k_all, v_all), early = _with_earlier(k, v, seg)
        out = torch.empty_like(x)
        for i, (s, e) in enumerate(tiles):
            a, b = early + s, early + e
            lead = (k_all[:, :, :a], v_all[:, :, :a]) if a else None
            out[:, s:e] = _tile(layer, x[:, s:e], (k_all[:, :, a:b], v_all[:, :, a:b]), lead, None, bounds, i,
                                rope, seg)
        return out, k, v

    @staticmethod
    def backward(ctx, dy, dk_emitted, dv_emitted):
        (x,) = ctx.saved_tensors
        layer, rope, seg, bounds = ctx.layer, ctx.rope, ctx.seg, ctx.bounds
        want_dx = ctx.needs_input_grad[0]
        tiles = _mine(bounds, seg)
        (k_all, v_all), early = _with_earlier(*_keys(layer, x, rope, tiles), seg)
        dx = torch.zeros_like(x) if want_dx else None
        # the keys' gradients add up over the tiles (in fp32 for half types), the earlier blocks' first
        acc = torch.promote_types(k_all.dtype, torch.float32)
        dkv = (torch.zeros_like(k_all, dtype=acc), torch.zeros_like(v_all, dtype=acc))
        for d, g in zip(dkv, (dk_emitted, dv_emitted)):
            _add(d, early, g)
        for i, (s, e) in reversed(list(enumerate(tiles))):
            a, b = early + s, early + e
            with torch.enable_grad():
                x_t = x[:, s:e].detach().requires_grad_(want_dx)
                own = tuple(t[:, :, a:b].detach().requires_grad_() for t in (k_all, v_all))
                lead = (k_all[:, :, :a], v_all[:, :, :a]) if a else None  # their gradient goes into dkv
                out = _tile(layer, x_t, own, lead, tuple(d[:, :, :a] for d in dkv), bounds, i, rope, seg)
                if out.requires_grad:
                    torch.autograd.backward(out, dy[:, s:e])
            if want_dx and x_t.grad is not None:
                dx[:, s:e].add_(x_t.grad)
            for d, o in zip(dkv, own):
                _add(d, a, o.grad, b)
            del out, own
        if seg.split is not None:  # the earlier blocks' share of the gradient to their owners, this block's back
            mine = _to_owners(*(d[:, :, :early] if early else None for d in dkv), k_all, v_all, early, seg)
            for d, m in zip(dkv, mine):
                _add(d, early, m)
        for s, e in tiles:  # the keys' and values' gradients through their projections and the input norm
            with torch.enable_grad():
                x_t = x[:, s:e].detach().requires_grad_(want_dx)
                kv = layer.mixer._kv(layer.input_layernorm(x_t), _rows(rope, s, e))
                live = [(o, d[:, :, early + s:early + e].to(o.dtype)) for o, d in zip((kv.k, kv.v), dkv)
                        if o.requires_grad]
                if live:
                    torch.autograd.backward(*map(list, zip(*live)))
            if want_dx and x_t.grad is not None:
                dx[:, s:e].add_(x_t.grad)
        # the segment holds this function's outputs (the state it emitted), which hold ctx: a cycle that would
        # keep the chunk's emitted state alive until the garbage collector runs
        ctx.seg = ctx.layer = ctx.rope = None
        return dx, None, None, None, None, *(None for _ in ctx.needs_input_grad[5:])


def _add(into: torch.Tensor, start: int, grad: torch.Tensor | None, end: int | None = None) -> None:
    """into[:, :, start:end] += grad (keys' rows on dim 2), when there is a gradient."""
    if grad is not None:
        into[:, :, start:end].add_(grad)


def _mine(bounds: list[list[tuple[int, int]]], seg: Segment) -> list[tuple[int, int]]:
    return bounds[seg.parallel.rank] if len(bounds) > 1 else bounds[0]


def _rows(rope: tuple, s: int, e: int) -> tuple:
    return tuple(t[s:e] for t in rope)


def _keys(layer, x: torch.Tensor, rope: tuple, tiles: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's keys and values for x, tile by tile, without autograd."""
    with torch.no_grad():
        parts = [layer.mixer._kv(layer.input_layernorm(x[:, s:e]), _rows(rope, s, e)) for s, e in tiles]
    return torch.cat([p.k for p in parts], dim=2), torch.cat([p.v for p in parts], dim=2)


def _tile(layer, x, own, lead, lead_grad, bounds, i, rope, seg) -> torch.Tensor:
    """Tile i's output, given its input x, its keys and values `own` and those its queries see before them
    (`lead`: the earlier blocks' and the block's tokens before the tile; None for none) with the sinks for their
    gradient (`lead_grad`)."""
    s, e = _mine(bounds, seg)[i]
    tile = QueryTile(lead, [rank[i][1] - rank[i][0] for rank in bounds], lead_grad if lead else None)
    return layer._tile_block(x, _rows(rope, s, e), AttentionState(*own), tile, seg)


def _with_earlier(k: torch.Tensor, v: torch.Tensor, seg: Segment) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """((keys, values) of the earlier blocks of a split chunk (gathered: a collective every rank makes) followed
    by this block's, how many rows are the earlier blocks'); elsewhere ((k, v), 0)."""
    if seg.split is None:
        return (k, v), 0
    blocks = seg.split.group.gather_blocks(torch.cat([k, v], dim=-1), seg.split.sizes, dim=2)
    earlier = [blocks[r] for r in seg.split.earlier]
    if not earlier:
        return (k, v), 0
    w = k.shape[-1]
    both = (torch.cat([b[..., :w] for b in earlier] + [k], dim=2), torch.cat([b[..., w:] for b in earlier] + [v], dim=2))
    return both, both[0].shape[2] - k.shape[2]


def _to_owners(dk: torch.Tensor | None, dv: torch.Tensor | None, k_all: torch.Tensor, v_all: torch.Tensor,
               early: int, seg: Segment) -> tuple[torch.Tensor, torch.Tensor]:
    """The earlier blocks' gradients (dk, dv over their rows in position order; None when none) sent to their
    owners; returns this rank's block's share from the later blocks (every rank calls it: an all-to-all)."""
    split = seg.split
    sizes, longest, w = split.sizes, max(split.sizes), k_all.shape[-1]
    zeros = k_all.new_zeros(k_all.shape[0], k_all.shape[1], longest, w + v_all.shape[-1])
    back = [zeros] * len(sizes)
    if dk is not None:
        both = torch.cat([dk, dv], dim=-1).to(k_all.dtype)
        for r, part in zip(split.earlier, both.split([sizes[r] for r in split.earlier], dim=2)):
            back[r] = pad_to(part, longest, dim=2)
    mine = sum(split.group.exchange(back)).narrow(2, 0, k_all.shape[2] - early)
    return mine[..., :w], mine[..., w:]
