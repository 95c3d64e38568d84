"""Softmax attention of a segment's queries: over the layer's visible prefix and the segment's own rows, on
whichever case the segment is (own tokens, a decode step, a split chunk or spread branches)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops.attention import SegmentContext, decode_attention, segment_attention
from ..ops.split_attention import KeyValues, SplitQueries, split_chunk_attention
from ..state import TokenState
from .core import QueryTile, Segment

Tensor = torch.Tensor


def attend(seg: Segment, layer: int, q: Tensor, own: TokenState, scale: float,
           heads: Callable[[TokenState], tuple[Tensor, Tensor]], tile: QueryTile | None = None) -> Tensor:
    """Softmax attention of q [B, H, T, d] over the layer's visible prefix and `own` (from `seg.own_rows`):
    causal over a segment's own tokens, or a decode step over its branch so far; merged over the group when the
    prefix is sharded; in exact mode the backward adds dLoss/dPrefix into the prefix's sink.

    `heads(state)` are the (keys, values) of a layer state's rows: [Hkv, N, d] for the prefix, [B, Hkv, L, d] for
    `own` (k and v may be one tensor: absorbed MLA's shared latent head). With `tile`, q are a tile of the
    segment's queries, `own` their own rows, and the keys before them come with the tile."""
    k, v = heads(own)
    lead, lead_grad = (None, None) if tile is None else (tile.lead, tile.lead_grad)
    if seg.across_ranks:
        group = seg.parallel
        sink = seg.prefix_grad(layer)
        block = None
        if tile is not None:  # the earlier blocks' keys come with their ranks' attention of these queries
            queries = SplitQueries(tile.sizes, group)
            if seg.split is not None:  # the later blocks' tiles see this rank's whole block
                queries = SplitQueries(tile.sizes, group, later=tuple(seg.split.later))
                block = KeyValues(*tile.block, tile.block_grad)
        elif seg.split is not None:
            queries = SplitQueries(seg.split.sizes, group, seg.split.earlier)
        else:
            queries = SplitQueries([q.shape[2]] * group.size, group)
        prefix = KeyValues(*heads(seg.visible_prefix(layer)), None if sink is None else heads(sink))
        return split_chunk_attention(q, k, v, scale, prefix, queries, lead=None if lead is None else
                                     KeyValues(*lead, lead_grad), block=block)
    rows = seg.prefix_rows(layer)
    prefix = None if rows is None else heads(rows)
    if seg.cache is not None:
        return decode_attention(q, k, v, scale, prefix, parallel=seg.parallel, own_visible=seg.cache.visible)
    sink = seg.prefix_grad(layer)
    return segment_attention(q, k, v, scale, SegmentContext(prefix, None if sink is None else heads(sink), lead,
                                                            lead_grad, parallel=seg.parallel))
