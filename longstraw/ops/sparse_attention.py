"""DSA (DeepSeek sparse attention) pieces: deterministic top-k selection and attention over gathered positions.

Positions 0..N-1 are the prefix state (constant to autograd; the backward adds into a gradient sink), positions
N..N+T-1 the segment's own tokens (ordinary autograd inputs). Memory stays bounded: selection streams over the
prefix in blocks, attention processes queries in blocks and recomputes the gathers in backward.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
KEY_BLOCK = 4096
QUERY_BLOCK = 64


def select_topk(score_blocks, k: int) -> tuple[Tensor, Tensor]:
    """Top-k positions per query from an iterator of (first_position, scores [B, T, L]) in increasing position
    order; -inf marks positions a query may not see. Equal scores: the lower position wins (deterministic).

    Returns (positions [B, T, k'] ascending, valid [B, T, k']) with k' = min(k, positions seen).
    """
    run_v = run_p = None
    for p0, s in score_blocks:
        pos = torch.arange(p0, p0 + s.shape[-1], device=s.device).expand_as(s)
        cand_v = s if run_v is None else torch.cat([run_v, s], dim=-1)
        cand_p = pos if run_p is None else torch.cat([run_p, pos], dim=-1)
        if cand_v.shape[-1] > k:
            # candidates are in position order, so a stable sort keeps lower positions first among equal scores;
            # sorting the chosen indices restores position order for the next merge
            keep = torch.sort(cand_v, dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values
            cand_v, cand_p = cand_v.gather(-1, keep), cand_p.gather(-1, keep)
        run_v, run_p = cand_v, cand_p
    return run_p, run_v > float("-inf")


def _gather_keys(prefix: Tensor | None, own: Tensor, pos: Tensor, n: int) -> Tensor:
    """Rows at `pos` ([B, t, k]) of the virtual sequence prefix [N, D] ++ own [B, T, D] -> [B, t, k, D]."""
    b = own.shape[0]
    from_prefix = pos < n
    own_idx = (pos - n).clamp(min=0)
    rows = own[torch.arange(b, device=own.device)[:, None, None], own_idx]
    if prefix is None or n == 0:
        return rows
    return torch.where(from_prefix[..., None], prefix[pos.clamp(max=n - 1)], rows)


class _SparseLatentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, own, prefix, pos, valid, scale, vdim, prefix_grad):
        n = 0 if prefix is None else prefix.shape[0]
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_empty(*q.shape[:-1], vdim)
        lse = torch.empty(q.shape[:-1], dtype=acc, device=q.device)
        for t0 in range(0, q.shape[1], QUERY_BLOCK):
            sl = slice(t0, t0 + QUERY_BLOCK)
            keys = _gather_keys(prefix, own, pos[:, sl], n).to(acc)
            s = torch.einsum("bthd,btkd->bthk", q[:, sl].to(acc), keys) * scale
            s = s.masked_fill(~valid[:, sl, None, :], float("-inf"))
            lse[:, sl] = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse[:, sl, :, None])
            out[:, sl] = torch.einsum("bthk,btkd->bthd", p, keys[..., :vdim]).to(q.dtype)
        ctx.save_for_backward(q, own, pos, valid, lse)
        ctx.prefix, ctx.prefix_grad, ctx.scale, ctx.vdim, ctx.n = prefix, prefix_grad, scale, vdim, n
        return out

    @staticmethod
    def backward(ctx, dout):
        q, own, pos, valid, lse = ctx.saved_tensors
        prefix, sink, scale, vdim, n = ctx.prefix, ctx.prefix_grad, ctx.scale, ctx.vdim, ctx.n
        acc = lse.dtype
        dq = torch.zeros_like(q, dtype=acc)
        down = torch.zeros_like(own, dtype=acc)
        bidx = torch.arange(q.shape[0], device=q.device)[:, None, None]
        for t0 in range(0, q.shape[1], QUERY_BLOCK):
            sl = slice(t0, t0 + QUERY_BLOCK)
            pb = pos[:, sl]
            keys = _gather_keys(prefix, own, pb, n).to(acc)
            qb, do = q[:, sl].to(acc), dout[:, sl].to(acc)
            s = torch.einsum("bthd,btkd->bthk", qb, keys) * scale
            p = torch.exp(s.masked_fill(~valid[:, sl, None, :], float("-inf")) - lse[:, sl, :, None])
            dp = torch.einsum("bthd,btkd->bthk", do, keys[..., :vdim])
            ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale
            dq[:, sl] = torch.einsum("bthk,btkd->bthd", ds, keys)
            dkeys = torch.einsum("bthk,bthd->btkd", ds, qb)
            dkeys[..., :vdim] += torch.einsum("bthk,bthd->btkd", p, do)
            from_prefix = pb < n
            own_rows = torch.where(from_prefix, 0, pb - n)
            down.index_put_((bidx.expand_as(pb), own_rows), torch.where(from_prefix[..., None], 0, dkeys), accumulate=True)
            if sink is not None and n:
                sink.index_put_((pb.clamp(max=n - 1),), torch.where(from_prefix[..., None], dkeys, 0).to(sink.dtype),
                                accumulate=True)
        return dq.to(q.dtype), down.to(own.dtype), None, None, None, None, None, None


def sparse_latent_attention(
    q: Tensor,
    own: Tensor,
    prefix: Tensor | None,
    pos: Tensor,
    valid: Tensor,
    scale: float,
    vdim: int,
    prefix_grad: Tensor | None = None,
) -> Tensor:
    """Softmax attention of q [B, T, H, D] over the selected rows (`pos`, `valid` [B, T, k]) of prefix [N, D] ++
    own [B, T, D], one shared key/value row set for all heads (absorbed MLA: values are the first `vdim` features
    of the keys). Returns [B, T, H, vdim]; with `prefix_grad` [N, D], backward adds dLoss/dprefix into it."""
    return _SparseLatentAttention.apply(q, own, prefix, pos, valid, scale, vdim, prefix_grad)
