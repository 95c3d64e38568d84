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

import torch

from ..parallel.sequence import SequenceGroup, pad_to
from .attention import (_acc, _fold, _forward, _unfold, merge_parts, part_backward, prefix_part_backward,
                        unmasked_part_backward)

Tensor = torch.Tensor


def merge_ranks(o: list[Tensor], lse: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Partial results of the ranks (over disjoint key sets) merged; -inf where no rank saw a key."""
    total = torch.logsumexp(torch.stack(lse), dim=0)
    safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    acc = _acc(o[0])
    out = sum(oi.to(acc) * torch.exp(li - safe)[..., None] for oi, li in zip(o, lse))
    return out.to(o[0].dtype), total


class _SplitChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, prefix_k, prefix_v, scale, grad_k, grad_v, sizes, earlier, group, kernel, lead,
                lead_grad, block):
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
            o_l, l_l, aux_lead = _forward(q, *lead, False, scale, kernel)
            o, lse = merge_parts(o_l, l_l, o, lse)
        # the prefix rows of earlier chunks: every block's queries over this rank's rows, results to their owners
        q_all = group.gather_padded(q, longest, dim=2)
        aux_pre = None
        if prefix_k.shape[1]:
            o_p, l_p, aux_pre = _forward(_fold(q_all, hkv), prefix_k[None], prefix_v[None], False, scale, kernel)
            o_p, l_p = _unfold(o_p, q_all.shape[0], q.shape[1]), _unfold(l_p, q_all.shape[0], q.shape[1])
        else:
            o_p = q_all.new_zeros(*q_all.shape[:-1], prefix_v.shape[-1])
            l_p = torch.full(q_all.shape[:-1], float("-inf"), dtype=_acc(q), device=q.device)
        aux_block = None
        if block is not None and block[3]:  # the later blocks' queries over this rank's whole block
            later = torch.tensor(block[3], device=q.device)
            o_b, l_b, aux_block = _forward(_fold(q_all[later], hkv), block[0], block[1], False, scale, kernel)
            o_b, l_b = merge_parts(o_p[later], l_p[later], _unfold(o_b, len(later), q.shape[1]),
                                   _unfold(l_b, len(later), q.shape[1]))
            o_p, l_p = o_p.index_copy(0, later, o_b), l_p.index_copy(0, later, l_b)
        o_p, l_p = merge_ranks(group.exchange_split(o_p), group.exchange_split(l_p))
        o, lse = merge_parts(o_p[:, :, :t], l_p[:, :, :t], o, lse)
        # the earlier blocks' K/V, gathered here, are saved too: per-layer checkpointing then drops them until the
        # backward, as it drops the rest (an attribute of ctx would stay alive with every layer's graph)
        ctx.save_for_backward(q, k, v, o, lse, q_all, ke, ve)
        ctx.lead, ctx.lead_grad, ctx.block = lead, lead_grad, block  # constants to autograd, as the prefix
        ctx.prefix, ctx.grads = (prefix_k, prefix_v), (grad_k, grad_v)  # views of a growing buffer (see attention.py)
        ctx.aux = (aux_own, aux_early, aux_pre, aux_lead, aux_block)
        ctx.scale, ctx.sizes, ctx.earlier, ctx.group, ctx.kernel, ctx.shared = (scale, sizes, earlier, group,
                                                                                 kernel, shared)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, q_all, ke, ve = ctx.saved_tensors
        (pk, pv), (gk, gv) = ctx.prefix, ctx.grads
        aux_own, aux_early, aux_pre, aux_lead, aux_block = ctx.aux
        group, sizes, scale, kernel = ctx.group, ctx.sizes, ctx.scale, ctx.kernel
        c, longest, t, h, hkv = len(sizes), max(sizes), q.shape[2], q.shape[1], k.shape[1]
        do = do.contiguous()
        dq, dk, dv = part_backward(do, q, k, v, o, lse, True, scale, kernel, aux_own)
        if ctx.lead is not None:
            dq = dq.add_(unmasked_part_backward(do, q, *ctx.lead, o, lse, scale, kernel, aux_lead, ctx.lead_grad))
        if ctx.earlier is not None:
            # earlier blocks: their dK/dV go back to their owners (zeros to everyone else, to keep shapes equal)
            zeros = k.new_zeros(1, hkv, longest, k.shape[-1] + (0 if ctx.shared else v.shape[-1]))
            back = [zeros] * c
            if ctx.earlier:
                dq_e, dke, dve = part_backward(do, q, ke, ve, o, lse, False, scale, kernel, aux_early)
                dq = dq + dq_e
                d_early = dke + dve if ctx.shared else torch.cat([dke, dve], dim=-1)
                for r, part in zip(ctx.earlier, d_early.split([sizes[r] for r in ctx.earlier], dim=2)):
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
        if pk.shape[1]:
            # shared keys and values have one sink: both add into it
            dq_p = prefix_part_backward(f(do_all), f(q_all), pk, pv, f(o_all), f(lse_all), scale, kernel, aux_pre,
                                        None if gk is None else (gk, gv))
            dq_p = _unfold(dq_p, q_all.shape[0], h)
        else:
            dq_p = torch.zeros_like(q_all)
        if ctx.block is not None and ctx.block[3]:
            bk, bv, sinks, ranks = ctx.block
            later = torch.tensor(ranks, device=q.device)
            dq_b = unmasked_part_backward(f(do_all[later]), f(q_all[later]), bk, bv, f(o_all[later]),
                                          f(lse_all[later]), scale, kernel, aux_block, sinks)
            dq_p.index_add_(0, later, _unfold(dq_b, len(ranks), h))
        dq = dq + sum(group.exchange_split(dq_p)).narrow(2, 0, t)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None


def split_chunk_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, prefix: tuple[Tensor, Tensor],
                          prefix_grad: tuple[Tensor, Tensor] | None, sizes: list[int], earlier: list[int] | None,
                          group: SequenceGroup, kernel: str = "auto", lead: tuple[Tensor, Tensor] | None = None,
                          lead_grad: tuple[Tensor, Tensor] | None = None, block: tuple | None = None) -> Tensor:
    """Attention of this rank's queries over the sharded prefix and their own keys, every rank's queries visiting
    every rank's rows: `sizes` are the ranks' query counts, `prefix` this rank's rows; with `prefix_grad` (exact
    mode) the backward adds their gradient into it. Shared keys and values (absorbed MLA) are passed as the same
    tensor for k and v.

    `earlier`: for the blocks of one prompt chunk (batch 1), the ranks whose blocks precede this one (in position
    order), whose keys the queries see too; None for independent sequences, such as the branches each rank
    replays (any batch, the same on every rank).

    `lead`: keys and values [B, Hkv, L, d] on this rank that every query of it sees (a query tile's block's tokens
    before it), constant to autograd like the prefix: the backward adds their gradient into `lead_grad`, if
    given.

    `block`: (keys, values [1, Hkv, T, d], their gradient's sinks or None, ranks): this rank's whole block of a
    split chunk, which the queries of those ranks (the blocks after it) see. A query tile passes it instead of
    `earlier`: the later blocks' queries come here, like the prefix's, and the block's keys stay."""
    if lead is not None and k is v:
        raise ValueError("lead keys are for separate keys and values (not absorbed MLA's shared latent)")
    if earlier is not None and q.shape[0] != 1:
        raise ValueError("the blocks of a prompt chunk run with batch 1")
    gk, gv = prefix_grad if prefix_grad is not None else (None, None)
    return _SplitChunkAttention.apply(q, k, v, prefix[0], prefix[1], scale, gk, gv, sizes, earlier, group, kernel,
                                      lead, lead_grad, block)
