"""DSA (DeepSeek sparse attention) pieces: deterministic top-k selection and attention over gathered positions.

Positions 0..N-1 are the prefix state (constant to autograd; the backward adds into a gradient sink), positions
N..N+T-1 the segment's own tokens (ordinary autograd inputs). Memory stays bounded: selection streams over the
prefix in blocks, attention processes queries in blocks and recomputes the gathers in backward.

Sharded over a sequence-parallel group whose ranks all run the same queries (decoding, branches that do not
split over the ranks), a rank holds some prefix rows only, at the positions `row_positions` gives (ascending).
Selection is global: each rank's top-k candidates are gathered and merged with the own tokens under the same tie
rule. (A split prompt chunk or spread branches: ops/split_sparse_attention.py.)
Attention is two partial softmaxes, over the selected prefix rows (this rank's, merged by log-sum-exp over the
group) and over the selected own rows; the backward uses the merged output, and sums the ranks' shares of dq.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..parallel.sequence import ONE_RANK, SequenceGroup
from .attention import merge_over, merge_parts
from .fp32_matmul import matmul_fp32, operand_dtype

Tensor = torch.Tensor
KEY_BLOCK = 4096  # the most prefix keys scored at once
SCORE_BYTES = 2**28  # and at most this many bytes of one block's per-head index scores
QUERY_BLOCK = 64
NEG = float("-inf")


def key_block(queries: Tensor, ranks: int = 1) -> int:
    """Prefix keys per block of the index scores: KEY_BLOCK, fewer when a block's per-head scores of `queries`
    [..., H, D] (of `ranks` ranks, gathered) would pass SCORE_BYTES. The indexer scores every query head over the
    block before it weights and sums them: at GLM-5's 32 index heads, 32 ranks' 1024-token branches in blocks of
    4096 keys would hold 8.6 GB of scores. The scores are fp32 (wider for fp64 queries) whatever the queries'
    dtype. The selection does not depend on the block size."""
    per_key = queries[..., 0].numel() * ranks * torch.promote_types(queries.dtype, torch.float32).itemsize
    return max(1, min(KEY_BLOCK, SCORE_BYTES // max(per_key, 1)))


def _keep_topk(vals: Tensor, pos: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k best of candidates listed in position order; equal scores: the earlier candidate (lower position)
    wins, and the kept ones stay in list order."""
    if vals.shape[-1] <= k:
        return vals, pos
    keep = torch.sort(vals, dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values
    return vals.gather(-1, keep), pos.gather(-1, keep)


def topk_candidates(score_blocks, k: int) -> tuple[Tensor, Tensor] | None:
    """(scores, positions) [B, T, k'] of the k best positions over an iterator of (positions [L], scores
    [B, T, L]) in increasing position order (None if it is empty); -inf marks positions a query may not see."""
    run = None
    for positions, s in score_blocks:
        pos = positions.expand_as(s)
        run = (s, pos) if run is None else (torch.cat([run[0], s], dim=-1), torch.cat([run[1], pos], dim=-1))
        run = _keep_topk(*run, k)
    return run


def select_topk(score_blocks, k: int) -> tuple[Tensor, Tensor]:
    """Top-k positions per query (see `topk_candidates`). Returns (positions [B, T, k'] ascending, valid
    [B, T, k']) with k' = min(k, positions seen)."""
    vals, pos = topk_candidates(score_blocks, k)
    return pos, vals > NEG


def select_topk_global(prefix_blocks, own: tuple[int, Tensor], k: int,
                       parallel: SequenceGroup = ONE_RANK) -> tuple[Tensor, Tensor]:
    """`select_topk` over the whole prefix, sharded over `parallel` (this rank's blocks, at global positions),
    followed by the own tokens (first position, scores), the same on every rank."""
    if parallel.size == 1:
        return select_topk(itertools.chain(prefix_blocks, [own]), k)
    own_positions, own_scores = own
    local = topk_candidates(prefix_blocks, k)
    shape = (*own_scores.shape[:-1], k)
    vals = own_scores.new_full(shape, NEG)
    pos = torch.zeros(shape, dtype=torch.long, device=own_scores.device)
    if local is not None:  # pad to k: every rank gathers the same shape; padding is -inf, never chosen over a row
        vals[..., : local[0].shape[-1]], pos[..., : local[1].shape[-1]] = local
    vals = torch.cat([*parallel.gather(vals), own_scores], -1)
    pos = torch.cat([*parallel.gather(pos), own_positions.expand_as(own_scores)], -1)
    # the ranks' rows interleave: into position order, so that the tie rule (the lower position) holds
    order = pos.argsort(dim=-1, stable=True)
    vals, pos = _keep_topk(vals.gather(-1, order), pos.gather(-1, order), k)
    return pos, vals > NEG


def _local_rows(pos: Tensor, rows: int, row_positions: Tensor | None) -> tuple[Tensor, Tensor]:
    """(row index, held) of global prefix positions `pos` on this rank, whose rows sit at `row_positions`
    (ascending; None: rows 0..rows-1 are positions 0..rows-1)."""
    if row_positions is None:
        return pos.clamp(0, max(rows - 1, 0)), pos < rows
    if rows == 0:
        return torch.zeros_like(pos), torch.zeros_like(pos, dtype=torch.bool)
    local = torch.searchsorted(row_positions, pos).clamp(max=rows - 1)
    return local, row_positions[local] == pos


def _where_rows(prefix: Tensor | None, own: Tensor, pos: Tensor, n: int, row_positions: Tensor | None):
    """The rows at global positions `pos` ([B, t, k]) of prefix (this rank's rows, see `_local_rows`) ++ own
    [B, T, D] -> (keys [B, t, k, D], in_prefix, mine: the prefix rows this rank holds, local: their row)."""
    b = own.shape[0]
    in_prefix = pos < n
    rows = 0 if prefix is None else prefix.shape[0]
    local, held = _local_rows(pos, rows, row_positions)
    mine = in_prefix & held
    keys = own[torch.arange(b, device=own.device)[:, None, None], (pos - n).clamp(min=0)]
    if rows:
        keys = torch.where(mine[..., None], prefix[local], keys)
    return keys, in_prefix, mine, local


def _partial(s: Tensor, keep: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention over the kept entries: (out [B, t, H, vdim], lse [B, t, H]); none kept: (0, -inf)."""
    s = s.masked_fill(~keep, NEG)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return matmul_fp32(p.to(operand_dtype(values)), values), lse


@dataclass(frozen=True)
class SparseRead:
    """What `sparse_latent_attention` reads besides the queries, the own rows and the selection, all constant to
    autograd: this rank's prefix rows [N', D] (or None) of a prefix of `length` positions, at `row_positions`
    (ascending; None: 0..N'-1), the sink of their gradient, the softmax scale, the values' width `vdim` (the keys'
    first features), and the group the prefix is sharded over."""

    prefix: Tensor | None
    prefix_grad: Tensor | None
    length: int
    row_positions: Tensor | None
    scale: float
    vdim: int
    parallel: SequenceGroup


class _SparseLatentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, own, pos, valid, read: SparseRead):
        prefix, scale, vdim, n, row_positions = read.prefix, read.scale, read.vdim, read.length, read.row_positions
        parts = {"pre": [], "own": []}
        for t0 in range(0, q.shape[1], QUERY_BLOCK):
            sl = slice(t0, t0 + QUERY_BLOCK)
            keys, in_prefix, mine, _ = _where_rows(prefix, own, pos[:, sl], n, row_positions)
            keys = keys.to(operand_dtype(keys))  # bf16 products into fp32 on CUDA, else upcast once here
            s = matmul_fp32(q[:, sl], keys.transpose(-1, -2)) * scale
            vb = valid[:, sl, None, :]
            parts["pre"].append(_partial(s, vb & mine[:, :, None], keys[..., :vdim]))
            parts["own"].append(_partial(s, vb & ~in_prefix[:, :, None], keys[..., :vdim]))
        o_p, l_p = merge_over(read.parallel, *(torch.cat(x, dim=1) for x in zip(*parts["pre"])))
        out, lse = merge_parts(o_p, l_p, *(torch.cat(x, dim=1) for x in zip(*parts["own"])))
        ctx.save_for_backward(q, own, pos, valid, out, lse)
        ctx.prefix, ctx.prefix_grad, ctx.scale, ctx.vdim = prefix, read.prefix_grad, scale, vdim
        ctx.n, ctx.row_positions, ctx.parallel = n, row_positions, read.parallel
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, own, pos, valid, out, lse = ctx.saved_tensors
        prefix, sink, scale, vdim, n = ctx.prefix, ctx.prefix_grad, ctx.scale, ctx.vdim, ctx.n
        acc = lse.dtype
        dq_own = torch.zeros_like(q, dtype=acc)
        dq_pre = torch.zeros_like(q, dtype=acc)
        down = torch.zeros_like(own, dtype=acc)
        bidx = torch.arange(q.shape[0], device=q.device)[:, None, None]
        rows = 0 if prefix is None else prefix.shape[0]
        for t0 in range(0, q.shape[1], QUERY_BLOCK):
            sl = slice(t0, t0 + QUERY_BLOCK)
            pb = pos[:, sl]
            keys, in_prefix, mine, local = _where_rows(prefix, own, pb, n, ctx.row_positions)
            keys = keys.to(operand_dtype(keys))
            qb, do = q[:, sl].to(operand_dtype(q)), dout[:, sl].to(operand_dtype(dout))
            s = matmul_fp32(qb, keys.transpose(-1, -2)) * scale
            keep = valid[:, sl, None, :] & (mine | ~in_prefix)[:, :, None]
            # the softmax of the merged output (all ranks' rows and the own ones): this rank's entries of it
            p = torch.exp(s.masked_fill(~keep, NEG) - lse[:, sl, :, None])
            dp = matmul_fp32(do, keys[..., :vdim].transpose(-1, -2))
            delta = (do.to(acc) * out[:, sl].to(acc)).sum(-1, keepdim=True)
            ds = p * (dp - delta) * scale
            dsk = ds.to(keys.dtype)
            dq_pre[:, sl] = matmul_fp32(dsk * mine[:, :, None], keys)
            dq_own[:, sl] = matmul_fp32(dsk * ~in_prefix[:, :, None], keys)
            dkeys = matmul_fp32(ds.transpose(-1, -2).to(qb.dtype), qb)
            dkeys[..., :vdim] += matmul_fp32(p.transpose(-1, -2).to(do.dtype), do)
            own_rows = torch.where(in_prefix, 0, pb - n)
            down.index_put_((bidx.expand_as(pb), own_rows), torch.where(in_prefix[..., None], 0, dkeys), accumulate=True)
            if sink is not None and rows:
                sink.index_put_((local,),
                                torch.where(mine[..., None], dkeys, 0).to(sink.dtype), accumulate=True)
        dq_pre = ctx.parallel.sum_(dq_pre)  # all ranks' rows' shares: q's gradient is the same on every rank
        return (dq_own + dq_pre).to(q.dtype), down.to(own.dtype), None, None, None


def sparse_latent_attention(
    q: Tensor,
    own: Tensor,
    prefix: Tensor | None,
    pos: Tensor,
    valid: Tensor,
    scale: float,
    vdim: int,
    prefix_grad: Tensor | None = None,
    *,
    length: int | None = None,
    row_positions: Tensor | None = None,
    parallel: SequenceGroup = ONE_RANK,
) -> Tensor:
    """Softmax attention of q [B, T, H, D] over the selected rows (`pos`, `valid` [B, T, k]) of prefix [N, D] ++
    own [B, T, D], one shared key/value row set for all heads (absorbed MLA: values are the first `vdim` features
    of the keys). Returns [B, T, H, vdim]; with `prefix_grad` [N, D], backward adds dLoss/dprefix into it.

    Sharded over a `parallel` group of several ranks: `prefix` holds the rows at `row_positions` (ascending) of
    a prefix of `length` positions."""
    n = (0 if prefix is None else prefix.shape[0]) if length is None else length
    return _SparseLatentAttention.apply(q, own, pos, valid,
                                        SparseRead(prefix, prefix_grad, n, row_positions, scale, vdim, parallel))
