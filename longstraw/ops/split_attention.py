"""Causal attention of one rank's block of a prompt chunk that the ranks of a group compute together (the split
schedule, parallel/sequence.py): each rank holds the queries and K/V of its own block only.

Three parts, merged by log-sum-exp into one output:
- own: the block's causal attention over itself;
- earlier blocks: the blocks of this chunk at lower positions, whose K/V come by all-gather (unmasked);
- prefix: the rows of earlier chunks, sharded over the ranks. They stay where they live: every rank's queries
  are all-gathered, each rank attends all of them over its own rows, and the partial results go back to the
  queries' owners (all-to-all) to be merged.

The backward uses the merged output and log-sum-exp for every part (the identity of ring attention), so each
part's gradient comes from its own kernel: dK/dV of the earlier blocks go back to their owners, the prefix rows'
gradient stays with them (added into the dState sink in exact mode), and each rank's share of the other ranks'
dq goes back to them. Every rank makes the same collectives in the same order, forward and backward.

The same serves independent sequences of one length on each rank (the branches the ranks of a group replay
apart): no earlier blocks, any batch. And a query tile of a recomputed layer (models/common/recompute.py): the
block's keys before the tile come as `lead`; the earlier blocks' keys do not move, the later blocks' tile queries
visit this rank's whole block as they visit its prefix rows (`block`).

Shapes: q [B, H, t, d]; k, v [B, Hkv, t, d]; prefix k, v [Hkv, N, d] (this rank's rows; N may be 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel.sequence import SequenceGroup, pad_to
from .attention import (_acc, _fold, _forward, _unfold, merge_parts, merge_ranks, part_backward,
                        prefix_part_backward, unmasked_part_backward)

Tensor = torch.Tensor


@dataclass(frozen=True)
class KeyValues:
    """Keys and values that some queries see and that are constant to autograd (the prefix rows, a query tile's
    keys before it, this rank's block of a split chunk): the backward adds their gradient into `grad` (sinks of
    their shape, for k and v), if given. Shared keys and values (absorbed MLA) are one tensor for both."""

    k: Tensor
    v: Tensor
    grad: tuple[Tensor, Tensor] | None = None


@dataclass(frozen=True)
class SplitQueries:
    """Whose queries meet on this rank: every rank's query count (`sizes`, by rank of `group`).

    `earlier`: for the blocks of one prompt chunk (batch 1), the ranks whose blocks precede this one (in position
    order), whose keys the queries see too; None for independent sequences, such as the branches each rank
    replays (any batch, the same on every rank), or for a query tile (its earlier blocks' keys stay on their
    ranks). `later`: the ranks whose queries see this rank's whole block (a query tile's `block`)."""

    sizes: list[int]
    group: SequenceGroup
    earlier: list[int] | None = None
    later: tuple[int, ...] = ()


class _SplitChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, prefix: KeyValues, queries: SplitQueries, kernel: str, lead: KeyValues | None,
                block: KeyValues | None):
        sizes, earlier, group = queries.sizes, queries.earlier, queries.group
        longest, t = max(sizes), q.shape[2]
        hkv = k.shape[1]
        shared = k is v  # absorbed MLA: one latent tensor is both keys and values
        o, lse, aux_own = _forward(q, k, v, True, scale, kernel)
        ke = ve = aux_early = None
        if earlier is not None:  # blocks of one chunk: every rank gathers the chunk's K/V
            ks = group.gather_blocks(k, sizes, dim=2)
            vs = ks if shared else group.gather_blocks(v, sizes, dim=2)
        if earlier:
            ke = torch.cat([ks[r] for r in earlier], dim=2)
            ve = ke if shared else torch.cat([vs[r] for r in earlier], dim=2)
            o_e, l_e, aux_early = _forward(q, ke, ve, False, scale, kernel)
            o, lse = merge_parts(o_e, l_e, o, lse)
        aux_lead = None
        if lead is not None:  # a query tile's keys before it (models/common/recompute.py)
            o_l, l_l, aux_lead = _forward(q, lead.k, lead.v, False, scale, kernel)
            o, lse = merge_parts(o_l, l_l, o, lse)
        # the prefix rows of earlier chunks: every block's queries over this rank's rows, results to their owners
        q_all = group.gather_padded(q, longest, dim=2)
        aux_pre = None
        if prefix.k.shape[1]:
            o_p, l_p, aux_pre = _forward(_fold(q_all, hkv), prefix.k[None], prefix.v[None], False, scale, kernel)
            o_p, l_p = _unfold(o_p, q_all.shape[0], q.shape[1]), _unfold(l_p, q_all.shape[0], q.shape[1])
        else:
            o_p = q_all.new_zeros(*q_all.shape[:-1], prefix.v.shape[-1])
            l_p = torch.full(q_all.shape[:-1], float("-inf"), dtype=_acc(q), device=q.device)
        aux_block = None
        if block is not None and queries.later:  # the later blocks' queries over this rank's whole block
            later = torch.tensor(queries.later, device=q.device)
            o_b, l_b, aux_block = _forward(_fold(q_all[later], hkv), block.k, block.v, False, scale, kernel)
            o_b, l_b = merge_parts(o_p[later], l_p[later], _unfold(o_b, len(later), q.shape[1]),
                                   _unfold(l_b, len(later), q.shape[1]))
            o_p, l_p = o_p.index_copy(0, later, o_b), l_p.index_copy(0, later, l_b)
        o_p, l_p = merge_ranks(group.exchange_split(o_p), group.exchange_split(l_p))
        o, lse = merge_parts(o_p[:, :, :t], l_p[:, :, :t], o, lse)
        # the earlier blocks' K/V, gathered here, are saved too: per-layer checkpointing then drops them until the
        # backward, as it drops the rest (an attribute of ctx would stay alive with every layer's graph)
        ctx.save_for_backward(q, k, v, o, lse, q_all, ke, ve)
        # constants to autograd; the prefix rows are views of a growing buffer (see attention.py)
        ctx.prefix, ctx.lead, ctx.block = prefix, lead, block
        ctx.aux = (aux_own, aux_early, aux_pre, aux_lead, aux_block)
        ctx.scale, ctx.queries, ctx.kernel, ctx.shared = scale, queries, kernel, shared
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, q_all, ke, ve = ctx.saved_tensors
        prefix, queries = ctx.prefix, ctx.queries
        aux_own, aux_early, aux_pre, aux_lead, aux_block = ctx.aux
        group, sizes, earlier, scale, kernel = queries.group, queries.sizes, queries.earlier, ctx.scale, ctx.kernel
        c, longest, t, h, hkv = len(sizes), max(sizes), q.shape[2], q.shape[1], k.shape[1]
        do = do.contiguous()
        dq, dk, dv = part_backward(do, q, k, v, o, lse, True, scale, kernel, aux_own)
        if ctx.lead is not None:
            lead = ctx.lead
            dq = dq.add_(unmasked_part_backward(do, q, lead.k, lead.v, o, lse, scale, kernel, aux_lead, lead.grad))
        if earlier is not None:
            # earlier blocks: their dK/dV go back to their owners (zeros to everyone else, to keep shapes equal)
            zeros = k.new_zeros(1, hkv, longest, k.shape[-1] + (0 if ctx.shared else v.shape[-1]))
            back = [zeros] * c
            if earlier:
                dq_e, dke, dve = part_backward(do, q, ke, ve, o, lse, False, scale, kernel, aux_early)
                dq = dq + dq_e
                d_early = dke + dve if ctx.shared else torch.cat([dke, dve], dim=-1)
                for r, part in zip(earlier, d_early.split([sizes[r] for r in earlier], dim=2)):
                    back[r] = pad_to(part, longest, dim=2)
            mine = sum(group.exchange(back)).narrow(2, 0, t)
            if ctx.shared:
                dk = dk + dv + mine
                dv = torch.zeros_like(dk)  # k is v: autograd adds the two; the sum is in dk
            else:
                dk, dv = dk + mine[..., : k.shape[-1]], dv + mine[..., k.shape[-1] :]
        # prefix rows: every block's (do, o, lse) meets this rank's rows; dq shares go back to the blocks' owners
        do_all = group.gather_padded(do, longest, dim=2)
        o_all = group.gather_padded(o, longest, dim=2)
        lse_all = group.gather_padded(lse, longest, dim=2)
        f = lambda x: _fold(x, hkv)  # noqa: E731
        if prefix.k.shape[1]:
            # shared keys and values have one sink: both add into it
            dq_p = prefix_part_backward(f(do_all), f(q_all), prefix.k, prefix.v, f(o_all), f(lse_all), scale, kernel,
                                        aux_pre, prefix.grad)
            dq_p = _unfold(dq_p, q_all.shape[0], h)
        else:
            dq_p = torch.zeros_like(q_all)
        if ctx.block is not None and queries.later:
            block = ctx.block
            later = torch.tensor(queries.later, device=q.device)
            dq_b = unmasked_part_backward(f(do_all[later]), f(q_all[later]), block.k, block.v, f(o_all[later]),
                                          f(lse_all[later]), scale, kernel, aux_block, block.grad)
            dq_p.index_add_(0, later, _unfold(dq_b, len(queries.later), h))
        dq = dq + sum(group.exchange_split(dq_p)).narrow(2, 0, t)
        return dq, dk, dv, None, None, None, None, None, None


def split_chunk_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, prefix: KeyValues, queries: SplitQueries,
                          kernel: str = "auto", lead: KeyValues | None = None, block: KeyValues | None = None
                          ) -> Tensor:
    """Attention of this rank's queries over the sharded prefix and their own keys, every rank's queries visiting
    every rank's rows (`queries`: whose they are, and which earlier blocks they see): `prefix` are this rank's rows
    ([Hkv, N, d]); with their `grad` (exact mode) the backward adds their gradient into it. Shared keys and values
    (absorbed MLA) are passed as the same tensor for k and v.

    `lead`: keys and values [B, Hkv, L, d] on this rank that every query of it sees (a query tile's block's tokens
    before it).

    `block`: keys and values [1, Hkv, T, d] of this rank's whole block of a split chunk, which the queries of the
    ranks `queries.later` (the blocks after it) see. A query tile passes it instead of `queries.earlier`: the later
    blocks' queries come here, like the prefix's, and the block's keys stay."""
    if lead is not None and k is v:
        raise ValueError("lead keys are for separate keys and values (not absorbed MLA's shared latent)")
    if queries.earlier is not None and q.shape[0] != 1:
        raise ValueError("the blocks of a prompt chunk run with batch 1")
    return _SplitChunkAttention.apply(q, k, v, scale, prefix, queries, kernel, lead, block)
