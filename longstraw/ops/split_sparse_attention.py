"""DSA (top-k selection and sparse latent attention) for the blocks of a prompt chunk that the ranks of a group
compute together, or for the branches each rank replays apart (the split schedule, parallel/sequence.py).

Every rank holds some rows: its prefix rows and its own block's (or branches') rows. Each query may select rows
of any rank, so the work goes where the rows live:
- selection: every rank's indexer queries are all-gathered; each rank scores all of them over its own rows and
  keeps its local top-k candidates. The candidates go to the queries' owners (all-to-all), which merge them
  into the k-th best (score, position): the threshold. The thresholds are all-gathered, and each rank keeps the
  candidates that beat it. A rank thus knows which of its own rows every query selected, and no position list
  travels twice. Ties break as in one process: the lower position wins.
- attention: every rank's queries are all-gathered; each rank attends all of them over the selected rows it
  holds and returns the partial results (output, log-sum-exp) to their owners, who merge them.
- backward: the owners' (dOut, log-sum-exp, delta) are all-gathered; each rank computes the gradient of its own
  rows (the prefix rows' into the dState sink, its block's into autograd) and its share of every query's dq,
  which goes back to the owner.

Own rows: with the blocks of one chunk (`spread` False) a query sees every rank's block rows at positions up to
its own; with spread branches (independent sequences, one length on every rank) it sees its own rank's only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel.sequence import SequenceGroup
from .attention import merge_ranks
from .fp32_matmul import matmul_fp32, operand_dtype
from .sparse_attention import NEG, QUERY_BLOCK, _local_rows, _partial, topk_candidates

Tensor = torch.Tensor


@dataclass(frozen=True)
class SplitLayout:
    """Who holds what in a split segment: the ranks' query counts (`sizes`) and first positions (`starts`), this
    rank's own rows from position `own_start`, a prefix of `length` positions of which this rank holds the rows
    at `row_positions` (ascending), and whether the ranks' sequences are independent (`spread`)."""

    sizes: list[int]
    starts: list[int]
    own_start: int
    length: int
    row_positions: Tensor
    spread: bool
    group: SequenceGroup

    @property
    def longest(self) -> int:
        return max(self.sizes)


@dataclass(frozen=True)
class SplitSelection:
    """Every rank's queries' top-k, as this rank sees it: candidate positions [C * B, L, k] (queries of rank r in
    rows r * B.., padded to the longest block L), `keep`: selected, and held here, and `held` (on the host): per
    query position (of L), the most entries any rank's query there keeps. The attention sizes its blocks by `held`,
    read from the device once per selection: a read per block of queries would stall the GPU's stream each time."""

    pos: Tensor
    keep: Tensor
    held: tuple[int, ...]


def _gather_queries(t: Tensor, lay: SplitLayout) -> Tensor:
    """Every rank's [B, T_r, ...] (tokens on dim 1), padded to the longest: [C * B, L, ...] in rank order."""
    return lay.group.gather_padded(t, lay.longest, dim=1)


def _query_positions(lay: SplitLayout, batch: int, device: torch.device) -> Tensor:
    """The positions of every rank's queries [C * B, L] (padding: past the end, seeing everything it may)."""
    steps = torch.arange(lay.longest, device=device)
    return torch.cat([(s + steps).expand(batch, -1) for s in lay.starts], dim=0)


def split_select_topk(queries: tuple[Tensor, ...], score, prefix_keys: Tensor | None, own_keys: Tensor, k: int,
                      lay: SplitLayout, key_block: int) -> SplitSelection:
    """DSA's top-k over every rank's rows for every rank's queries (see the module docstring). `queries` are this
    rank's indexer queries ([B, T, ...] each), `score(queries, keys)` scores them ([B', T, L] for keys [L, D] or
    [B', L, D]); `prefix_keys` [N, D] are this rank's visible prefix rows, `own_keys` [B, T, D] its own."""
    group, c = lay.group, lay.group.size
    b, t = own_keys.shape[:2]
    q_all = tuple(_gather_queries(x, lay) for x in queries)
    device = own_keys.device
    rows = 0 if prefix_keys is None else prefix_keys.shape[0]

    def blocks():  # in position order, one block's scores alive at a time
        for a in range(0, rows, key_block):
            yield lay.row_positions[a: a + key_block], score(q_all, prefix_keys[a: a + key_block])
        own_pos = torch.arange(lay.own_start, lay.own_start + t, device=device)
        seen = own_pos <= _query_positions(lay, b, device)[..., None]
        if lay.spread:  # another rank's branches are other sequences
            seen = seen & (torch.arange(c * b, device=device) // b == group.rank)[:, None, None]
        yield own_pos, score(q_all, own_keys.repeat(c, 1, 1)).masked_fill(~seen, NEG)  # [C * B, L, T]

    vals, pos = topk_candidates(blocks(), k)
    if vals.shape[-1] < k:  # pad to k: every rank sends the same shape; -inf is never selected
        fill = k - vals.shape[-1]
        vals = torch.cat([vals, vals.new_full((*vals.shape[:-1], fill), NEG)], -1)
        pos = torch.cat([pos, pos.new_zeros((*pos.shape[:-1], fill))], -1)
    # the owners merge the candidates for their queries into the k-th best (score, position)
    got_v = torch.cat(group.exchange_split(vals), -1)
    got_p = torch.cat(group.exchange_split(pos), -1)
    by_pos = got_p.argsort(dim=-1, stable=True)
    got_v, got_p = got_v.gather(-1, by_pos), got_p.gather(-1, by_pos)
    kth = torch.sort(got_v, dim=-1, descending=True, stable=True).indices[..., k - 1: k]
    thr_v = torch.cat(group.gather(got_v.gather(-1, kth)), 0)  # [C * B, L, 1]
    thr_p = torch.cat(group.gather(got_p.gather(-1, kth)), 0)
    keep = (vals > NEG) & ((vals > thr_v) | ((vals == thr_v) & (pos <= thr_p)))
    return SplitSelection(pos, keep, tuple(keep.sum(-1).amax(0).tolist()))  # the selection's one host read


def _held_keys(prefix: Tensor | None, own: Tensor, pos: Tensor, lay: SplitLayout):
    """The rows at positions `pos` [C * B, t, k] among this rank's prefix rows and own rows [B, T, D] (entries
    this rank does not hold get some row; `keep` masks them): (keys [C * B, t, k, D], in_prefix, batch row,
    own row, prefix row)."""
    b, t = own.shape[:2]
    bidx = (torch.arange(pos.shape[0], device=pos.device) % b)[:, None, None].expand_as(pos)
    own_row = (pos - lay.own_start).clamp(0, t - 1)
    keys = own[bidx, own_row]
    in_prefix = pos < lay.length
    rows = 0 if prefix is None else prefix.shape[0]
    local = None
    if rows:
        local, _ = _local_rows(pos, rows, lay.row_positions)
        keys = torch.where(in_prefix[..., None], prefix[local], keys)
    return keys, in_prefix, bidx, own_row, local


def _compact(sel: SplitSelection, sl: slice) -> tuple[Tensor, Tensor] | None:
    """The entries this rank holds of a block of queries' selections, moved to the front and cut to the most any
    query of the block has (positions, keep [C * B, t, k']), so that a rank's work is its share of the top-k, not
    all of it; None if it holds none. The width comes from the host (`sel.held`): no device read here."""
    most = max(sel.held[sl], default=0)
    if most == 0:
        return None
    keep = sel.keep[:, sl]
    front = keep.to(torch.uint8).argsort(dim=-1, descending=True, stable=True)[..., :most]
    return sel.pos[:, sl].gather(-1, front), keep.gather(-1, front)


class _SplitSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, own, prefix, sel, scale, vdim, sink, lay):
        t = q.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)
        q_all = _gather_queries(q, lay)
        o_p = q_all.new_zeros(*q_all.shape[:-1], vdim, dtype=acc)
        l_p = q_all.new_full(q_all.shape[:-1], NEG, dtype=acc)
        for t0 in range(0, lay.longest, QUERY_BLOCK):
            sl = slice(t0, t0 + QUERY_BLOCK)
            if (held := _compact(sel, sl)) is None:
                continue
            pos, keep = held
            keys = _held_keys(prefix, own, pos, lay)[0]
            keys = keys.to(operand_dtype(keys))  # bf16 products into fp32 on CUDA, else upcast once here
            s = matmul_fp32(q_all[:, sl], keys.transpose(-1, -2)) * scale
            o_p[:, sl], l_p[:, sl] = _partial(s, keep[:, :, None, :], keys[..., :vdim])
        # the partial outputs travel in the model's dtype, their log-sum-exps in fp32 (as split_attention.py's)
        out, lse = merge_ranks(lay.group.exchange_split(o_p.to(q.dtype)), lay.group.exchange_split(l_p))
        out, lse = out[:, :t], lse[:, :t]
        # the selection is saved, not kept as an attribute: per-layer checkpointing then drops it with the layer's
        # other tensors and recomputes it (as an attribute, every layer's [C * B, L, k] stayed for the backward)
        ctx.save_for_backward(q, own, q_all, out, lse, sel.pos, sel.keep)
        ctx.prefix, ctx.sink, ctx.scale, ctx.vdim, ctx.lay, ctx.held = prefix, sink, scale, vdim, lay, sel.held
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, own, q_all, out, lse, pos, keep = ctx.saved_tensors
        sel = SplitSelection(pos, keep, ctx.held)
        prefix, sink, scale, vdim, lay = ctx.prefix, ctx.sink, ctx.scale, ctx.vdim, ctx.lay
        t = q.shape[1]
        acc = lse.dtype
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        do_all = _gather_queries(dout, lay)  # in its own dtype: each block is cast on use
        lse_all = _gather_queries(torch.where(torch.isinf(lse), torch.zeros_like(lse), lse), lay)
        delta_all = _gather_queries(delta, lay)
        dq = torch.zeros_like(q, dtype=acc)
        down = torch.zeros_like(own, dtype=acc)
        # every rank's queries' dq shares go to their owners a slice of positions at a time, the slices sized so
        # that a slice of all ranks' queries is about one block: never the dq of every rank's queries at once
        step = max(1, -(-lay.longest // lay.group.size))
        for e0 in range(0, lay.longest, step):
            e1 = min(e0 + step, lay.longest)
            shares = q_all.new_zeros((q_all.shape[0], e1 - e0, *q_all.shape[2:]), dtype=acc)
            for t0 in range(e0, e1, QUERY_BLOCK):
                sl = slice(t0, min(t0 + QUERY_BLOCK, e1))
                if (held := _compact(sel, sl)) is None:
                    continue
                pos, keep = held
                keys, in_prefix, bidx, own_row, local = _held_keys(prefix, own, pos, lay)
                keys = keys.to(operand_dtype(keys))
                qb, do = q_all[:, sl].to(operand_dtype(q_all)), do_all[:, sl].to(operand_dtype(do_all))
                s = matmul_fp32(qb, keys.transpose(-1, -2)) * scale
                p = torch.exp(s.masked_fill(~keep[:, :, None, :], NEG) - lse_all[:, sl, :, None])
                dp = matmul_fp32(do, keys[..., :vdim].transpose(-1, -2))
                ds = p * (dp - delta_all[:, sl, :, None]) * scale
                shares[:, sl.start - e0 : sl.stop - e0] = matmul_fp32(ds.to(keys.dtype), keys)
                dkeys = matmul_fp32(ds.transpose(-1, -2).to(qb.dtype), qb)
                dkeys[..., :vdim] += matmul_fp32(p.transpose(-1, -2).to(do.dtype), do)
                own_hit = (keep & ~in_prefix)[..., None]
                down.index_put_((bidx, own_row), torch.where(own_hit, dkeys, 0), accumulate=True)
                if sink is not None and local is not None:
                    pre_hit = (keep & in_prefix)[..., None]
                    sink.index_put_((local,), torch.where(pre_hit, dkeys, 0).to(sink.dtype), accumulate=True)
            mine = sum(lay.group.exchange_split(shares))
            if e0 < t:
                dq[:, e0 : min(e1, t)] = mine[:, : min(e1, t) - e0]
            del shares, mine
        return dq.to(q.dtype), down.to(own.dtype), None, None, None, None, None, None


def split_sparse_attention(q: Tensor, own: Tensor, prefix: Tensor | None, sel: SplitSelection, scale: float,
                           vdim: int, sink: Tensor | None, lay: SplitLayout) -> Tensor:
    """Softmax attention of this rank's q [B, T, H, D] over the rows every query selected (`sel`, from
    `split_select_topk`): this rank's `prefix` rows [N, D] and `own` rows [B, T, D], and the other ranks'.
    Absorbed MLA: one shared key/value row set for all heads, values are the first `vdim` features. Returns
    [B, T, H, vdim]; with `sink` [N, D] (exact mode) the backward adds the prefix rows' gradient into it."""
    return _SplitSparseAttention.apply(q, own, prefix, sel, scale, vdim, sink, lay)
