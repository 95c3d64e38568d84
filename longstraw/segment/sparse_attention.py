"""DeepSeek Sparse Attention (DSA) over a segment: the indexer's top-k over the whole visible prefix and the own rows
(`select_topk`), then softmax attention over the selected rows (`attend_sparse`), on one rank or split over the
ranks that hold the prefix (a split chunk or spread branches)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops.sparse_attention import key_block, select_topk_global, sparse_latent_attention
from ..ops.split_sparse_attention import SplitLayout, split_select_topk, split_sparse_attention
from ..state import TokenState
from .core import Segment

Tensor = torch.Tensor


def select_topk(seg: Segment, layer: int, k: int, queries: tuple[Tensor, ...],
                score: Callable[[tuple[Tensor, ...], Tensor], Tensor], keys: Callable[[TokenState], Tensor],
                own: TokenState):
    """DSA: the top-k positions per query (ties: the lower position) over the whole visible prefix (every
    rank's rows, when sharded) and the own rows: (positions [B, T, k'] ascending, valid [B, T, k']), the same
    on every rank; see `ops.sparse_attention.select_topk`. On a split chunk or spread branches: a
    `SplitSelection` of every rank's queries over the rows this rank holds, for `attend_sparse`.

    `queries` are the indexer's queries ([B, T, ...] each), `score(queries, keys)` their scores [B, T, L]
    over key rows [L, D] (the prefix streams through in blocks of `ops.sparse_attention.key_block`, one block's
    scores alive at a time) or [B, L, D]; `keys(state)` a state's index key rows; `own` the rows from
    `seg.own_rows`. The segment's own rows that a query may not see are masked here."""
    rows = seg.prefix_rows(layer)
    if seg.across_ranks:
        own_keys = keys(own)
        lay = _split_layout(seg, own.tokens, own_keys.device)
        kb = key_block(queries[0], lay.group.size)
        return split_select_topk(queries, score, None if rows is None else keys(rows), own_keys, k, lay, kb)
    kb = key_block(queries[0])
    count = 0 if rows is None else rows.tokens
    own_scores = score(queries, keys(own))
    device = own_scores.device
    positions = _row_positions(seg, device)
    # Looping over block numbers, not over range(0, count, kb), lets torch.compile keep `count` symbolic: its
    # guard is on the number of blocks
    blocks = ((torch.arange(b * kb, min((b + 1) * kb, count), device=device) if positions is None
               else positions[b * kb : (b + 1) * kb],
               score(queries, keys(rows.map(lambda t: t[..., b * kb : (b + 1) * kb, :]))))
              for b in range(-(-count // kb)))
    first = seg.prefix_length
    mine = (torch.arange(first, first + own_scores.shape[-1], device=device), _mask_own(seg, own_scores))
    return select_topk_global(blocks, mine, k, seg.parallel)


def _split_layout(seg: Segment, own_tokens: int, device: torch.device) -> SplitLayout:
    """Who holds which rows and queries, on a split chunk or spread branches."""
    group = seg.parallel
    if seg.split is not None:
        sizes, starts = seg.split.sizes, [a for a, _ in seg.split.blocks]
    else:
        sizes, starts = [own_tokens] * group.size, [seg.start] * group.size
    return SplitLayout(sizes, starts, seg.start, seg.prefix_length, seg.prefix.row_positions(device),
                       seg.spread, group)


def _row_positions(seg: Segment, device: torch.device) -> Tensor | None:
    """The positions of the held prefix rows when they are not simply 0.. (a sharded prefix), else None."""
    p = seg.prefix
    return None if p is None or p.rows is None or p.rows.blocks[0][0] == 0 and len(p.rows.blocks) == 1 \
        else p.row_positions(device)


def _mask_own(seg: Segment, s: Tensor) -> Tensor:
    """-inf where a query may not see an own row: after it (a segment's own tokens), or not yet written (the
    static decode's buffer); a dynamic decode step sees all of its branch so far."""
    if seg.cache is None:
        return s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if (visible := seg.cache.visible) is not None:
        return s.masked_fill(torch.arange(s.shape[-1], device=s.device) >= visible, float("-inf"))
    return s


def attend_sparse(seg: Segment, layer: int, q: Tensor, own: TokenState, selected, scale: float, vdim: int,
                  rows: Callable[[TokenState], Tensor]) -> Tensor:
    """DSA: softmax attention of q [B, T, H, D] over the `selected` rows (from `select_topk`) of the layer's
    prefix and `own` (from `own_rows`), one shared key/value row set for all heads (absorbed MLA: the
    values are the first `vdim` features of the keys). `rows(state)` are a state's key rows: [N, D] for the
    prefix, [B, L, D] for `own`. Returns [B, T, H, vdim]; in exact mode the backward adds into the sink."""
    pre, sink = seg.prefix_rows(layer), seg.prefix_grad(layer)
    if seg.across_ranks:
        lay = _split_layout(seg, own.tokens, q.device)
        return split_sparse_attention(q, rows(own), None if pre is None else rows(pre), selected, scale, vdim,
                                      None if sink is None else rows(sink), lay)
    return sparse_latent_attention(
        q, rows(own), None if pre is None else rows(pre), *selected, scale, vdim,
        None if sink is None else rows(sink), length=seg.prefix_length,
        row_positions=_row_positions(seg, q.device), parallel=seg.parallel)
