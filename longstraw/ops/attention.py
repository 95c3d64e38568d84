"""Attention of a segment (a prompt chunk or a batch of branches) over a shared prefix plus its own tokens.

The prefix part (no mask) and the segment's causal part are computed separately, each returning its
log-sum-exp, and merged exactly. No mask over the prefix is ever materialised, the prefix is never copied per
branch, and the backward re-uses the merged output and log-sum-exp, so each part's gradient comes from the
same flash-style kernel (the identity used by ring attention).

Shapes: q [B, H, T, d]; k, v [B, Hkv, T, d]; prefix k, v [Hkv, N, d] shared by all B rows.

Over a `parallel` group of C ranks (longstraw.parallel.SequenceGroup; ONE_RANK, the default, is one process)
the prefix is this rank's rows only: the prefix part is merged across the group's ranks first. In backward, this
rank's prefix part adds its rows' gradient to the sink, and the ranks' shares of dq are summed, so that q's
gradient is the same on every rank (parallel/sequence.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..parallel.sequence import ONE_RANK, SequenceGroup
from .fp32_matmul import matmul_fp32

Tensor = torch.Tensor
_BLOCK = 1024
# key rows per call of an unmasked part's backward (the prefix's, a query tile's earlier keys): the gradient of
# that many rows exists at a time, not of the rank's whole prefix (at 2.1M tokens over 8 ranks, 262K rows: a GB
# per layer). On CUDA 4096 keys give FlashAttention's backward one wave of key tiles per head; the CPU kernel
# splits its work over queries and heads, so more rows buy it nothing
PREFIX_GRAD_ROWS = 4096
PREFIX_GRAD_ROWS_CPU = 1024


def grad_rows(device_type: str) -> int:
    """Key rows per call of an unmasked part's backward on this device."""
    return PREFIX_GRAD_ROWS_CPU if device_type == "cpu" else PREFIX_GRAD_ROWS


KERNELS = ("cpu_flash", "cuda_flash", "cuda_efficient", "torch")


def choose_kernel(device_type: str, dtype: torch.dtype, qk_dim: int, v_dim: int) -> str:
    """The kernel for one attention part. All return the log-sum-exp the merge needs, and take the merged output
    and log-sum-exp in their backward.

    cpu_flash       PyTorch's CPU flash kernel (any dtype and head size)
    cuda_flash      FlashAttention-2 in PyTorch: fp16/bf16, head dim <= 256 (Qwen3.5's 256 included), q/k and v
                    of one size
    cuda_efficient  the memory-efficient kernel: fp32, head dims that are multiples of 8, q/k and v of one size
    torch           the portable reference, blocked over keys (fp32 score blocks, fp32 accumulation): the test
                    oracle, and the path of absorbed MLA (576-wide keys, 512-wide values, which FlashAttention-2
                    does not take) and of fp64
    """
    if device_type == "cpu":
        return "cpu_flash"
    if device_type == "cuda" and qk_dim == v_dim and qk_dim % 8 == 0:
        if dtype in (torch.float16, torch.bfloat16) and qk_dim <= 256:
            return "cuda_flash"
        if dtype == torch.float32:
            return "cuda_efficient"
    return "torch"


def _kernel(kernel: str, q: Tensor, v: Tensor) -> str:
    if kernel == "auto":
        return choose_kernel(q.device.type, q.dtype, q.shape[-1], v.shape[-1])
    kind = "cpu_flash" if kernel == "flash" else kernel
    if kind not in KERNELS:
        raise ValueError(f"attention kernel {kernel!r} unknown; choose auto, flash (= cpu_flash) or one of {KERNELS}")
    return kind


# ----------------------------------------------------------------------------------------------------------
# One part: softmax attention returning (out, lse) and what its kernel's backward needs (`aux`).
# ----------------------------------------------------------------------------------------------------------


def part_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, kernel: str = "auto"):
    """(out, lse [B, H, T] fp32) of q [B, H, T, d] over k, v [B, Hkv, S, d] (H a multiple of Hkv). A row that sees no
    key has out 0 and lse -inf, whichever the kernel; a causal part has as many keys as queries."""
    o, lse, _ = _forward(q, k, v, causal, scale, kernel)
    return o, lse


def part_backward(do, q, k, v, o, lse, causal: bool, scale: float, kernel: str = "auto", aux=None):
    """(dq, dk, dv) of one part, given the merged output and log-sum-exp (the same identity as a ring's)."""
    kind = _kernel(kernel, q, v)
    _check_part(q, k, causal)
    if k.shape[2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if kind == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse, 0.0, causal, scale=scale)
    if kind == "torch":
        return _torch_backward(do, q, k, v, o, lse, causal, scale)
    if kind == "cuda_flash":  # grouped heads as they are: the kernel sums each group's dK/dV itself
        cq, ck, mq, mk, rng, unused = aux
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse, cq, ck, mq, mk, 0.0, causal, rng, unused, scale=scale)
    return _efficient_backward(do, q, k, v, o, lse, causal, scale, aux)


def prefix_part_backward(do: Tensor, q: Tensor, pk: Tensor, pv: Tensor, o: Tensor, lse: Tensor, scale: float,
                         kernel: str, aux, sink: tuple[Tensor, Tensor] | None) -> Tensor:
    """dq of the (non-causal) prefix part, for queries folded to the prefix's heads (q [1, Hkv, R, d], prefix
    k, v [Hkv, N, d]), adding the prefix rows' gradient into `sink` (dk, dv sinks; one tensor twice for shared
    keys and values), `grad_rows` rows at a time."""
    return unmasked_part_backward(do, q, pk[None], pv[None], o, lse, scale, kernel, aux,
                                  None if sink is None else (sink[0][None], sink[1][None]))


def unmasked_part_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float,
                           kernel: str, aux, sink: tuple[Tensor, Tensor] | None) -> Tensor:
    """dq of an unmasked part over keys k, v [B, Hkv, N, d], adding their gradient into `sink` (tensors of their
    shape, any dtype) `grad_rows` rows at a time (None: dropped)."""
    dq, rows = None, grad_rows(q.device.type)
    for s in range(0, k.shape[2], rows):
        e = min(k.shape[2], s + rows)
        dq_b, dk, dv = part_backward(do, q, k[:, :, s:e], v[:, :, s:e], o, lse, False, scale, kernel,
                                     _block_aux(aux, e - s))
        if sink is not None:
            sink[0][:, :, s:e].add_(dk)
            sink[1][:, :, s:e].add_(dv)
        dq = dq_b.to(_acc(q)) if dq is None else dq.add_(dq_b)
        del dq_b, dk, dv  # before the next block's come
    return dq.to(q.dtype)


def _block_aux(aux, keys: int):
    """The forward's kernel state for a backward over `keys` of its keys: FlashAttention's carries the key
    count; the others' hold nothing that depends on the keys."""
    if aux is None or len(aux) != 6:
        return aux
    cq, ck, mq, _, rng, unused = aux
    return cq, ck, mq, keys, rng, unused


def _forward(q, k, v, causal, scale, kernel):
    kind = _kernel(kernel, q, v)
    _check_part(q, k, causal)
    if k.shape[2] == 0:  # no key to see: FlashAttention-2 would give lse +inf, the blocked path 0/0
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_acc(q), device=q.device)
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), lse, None
    if kind == "cpu_flash":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return o, lse, None
    if kind == "torch":
        return (*_torch_forward(q, k, v, causal, scale), None)
    if kind == "cuda_flash":  # takes grouped heads (H a multiple of Hkv) as they are
        o, lse, cq, ck, mq, mk, rng, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return o, lse, (cq, ck, mq, mk, rng, unused)
    return _efficient_forward(q, k, v, causal, scale)


def _check_part(q: Tensor, k: Tensor, causal: bool) -> None:
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"a causal attention part takes as many keys as queries (got {q.shape[2]} queries, "
                         f"{k.shape[2]} keys): the kernels align such a mask differently (FlashAttention-2 to the "
                         "last key, the others to the first); pass the keys before the queries as an unmasked part")


# The memory-efficient kernel takes as many key heads as query heads. Where no mask tells a group's query rows
# apart (every part but a segment's own causal one) the queries fold to their key head instead (`_group`: g x T rows
# per key head), so the keys are never repeated; a causal part (the segment's own tokens, short) repeats them.


def _efficient_forward(q, k, v, causal, scale):
    b, h, t, _ = q.shape
    g = h // k.shape[1]
    if g > 1 and causal:
        k, v = _expand(k, g), _expand(v, g)
    qf = _group(q, k.shape[1])[0]
    o, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        qf, k, v, None, True, 0.0, causal, scale=scale)
    # its log-sum-exp is padded to a multiple of 32 rows, which the backward reads
    rows = lse.shape[-1]
    return o.reshape(b, h, t, -1), lse[..., : qf.shape[2]].reshape(b, h, t), (seed, offset, rows)


def _efficient_backward(do, q, k, v, o, lse, causal, scale, aux):
    seed, offset, rows = aux
    b, h, t, _ = q.shape
    g = h // k.shape[1]
    ke, ve = (_expand(k, g), _expand(v, g)) if g > 1 and causal else (k, v)
    hq = ke.shape[1]
    qf, dof = q.reshape(b, hq, -1, q.shape[-1]), do.reshape(b, hq, -1, do.shape[-1])
    of = o.reshape(b, hq, -1, o.shape[-1])
    if of.dtype != torch.float32:
        # the half kernels read the output's rows at the forward's stride (heads x width): its [B, T, H, d] layout
        of = of.transpose(1, 2).contiguous().transpose(1, 2)
    # the padding rows +inf as the forward writes them: the kernel reads whole blocks of 32 rows without bounds
    padded = F.pad(lse.reshape(b, hq, -1), (0, rows - qf.shape[2]), value=float("inf"))
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dof, qf, ke, ve, None, of, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    if hq != k.shape[1]:
        dk, dv = _fold_heads(dk, g), _fold_heads(dv, g)
    return dq.reshape(q.shape), dk, dv


def _expand(x: Tensor, g: int) -> Tensor:
    """[B, Hkv, S, d] -> [B, Hkv * g, S, d]: a key head for every query head (the memory-efficient kernel's causal
    parts)."""
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _fold_heads(dx: Tensor, g: int) -> Tensor:
    return dx if g == 1 else dx.unflatten(1, (-1, g)).sum(2)


def _acc(t: Tensor) -> torch.dtype:
    """Accumulation dtype: fp32 for half types, fp64 for fp64."""
    return torch.promote_types(t.dtype, torch.float32)


def _group(q: Tensor, hkv: int) -> tuple[Tensor, Tensor]:
    """[B, H, T, d] -> [B, Hkv, g*T, d] (queries sharing a kv head side by side) and each row's position."""
    b, h, t, d = q.shape
    g = h // hkv
    return q.reshape(b, hkv, g * t, d), torch.arange(t, device=q.device).repeat(g)


def _products(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with broadcast leading dims, in the accumulation dtype: half operands' products summed in fp32 and
    kept fp32 (a bf16 result would round every score to 8 bits before the softmax, and decode's log-probs would
    drift from replay's)."""
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return matmul_fp32(a.expand(*lead, *a.shape[-2:]), b.expand(*lead, *b.shape[-2:])).to(_acc(a))


def _scores(qg, kb, qpos, start, causal, scale):
    s = _products(qg, kb.transpose(-1, -2)) * scale
    if causal:
        kpos = torch.arange(start, start + kb.shape[-2], device=kb.device)
        s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    return s


def _torch_forward(q, k, v, causal, scale):
    b, h, t, d = q.shape
    qg, qpos = _group(q, k.shape[1])
    m = torch.full(qg.shape[:-1], float("-inf"), device=q.device, dtype=_acc(q))
    den = torch.zeros_like(m)
    acc = torch.zeros(*qg.shape[:-1], v.shape[-1], device=q.device, dtype=_acc(q))
    for s0 in range(0, k.shape[-2], _BLOCK):
        kb, vb = k[:, :, s0 : s0 + _BLOCK], v[:, :, s0 : s0 + _BLOCK]
        s = _scores(qg, kb, qpos, s0, causal, scale)
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])
        corr = torch.exp(m - m_safe)
        den = den * corr + p.sum(-1)
        acc = acc * corr[..., None] + torch.matmul(p.to(acc.dtype), vb.to(acc.dtype))
        m = m_new
    o = (acc / den[..., None]).to(q.dtype).reshape(b, h, t, -1)
    lse = (m + den.log()).reshape(b, h, t)
    return o, lse


def _torch_backward(do, q, k, v, o, lse, causal, scale):
    b, h, t, d = q.shape
    hkv = k.shape[1]
    qg, qpos = _group(q, hkv)
    acc = _acc(q)
    dog = do.reshape(b, hkv, -1, do.shape[-1]).to(acc)
    lg = lse.reshape(b, hkv, -1)
    delta = (do.to(acc) * o.to(acc)).sum(-1).reshape(b, hkv, -1)
    dq = torch.zeros_like(qg, dtype=acc)
    dk = torch.zeros_like(k, dtype=acc)
    dv = torch.zeros_like(v, dtype=acc)
    for s0 in range(0, k.shape[-2], _BLOCK):
        kb, vb = k[:, :, s0 : s0 + _BLOCK], v[:, :, s0 : s0 + _BLOCK]
        p = torch.exp(_scores(qg, kb, qpos, s0, causal, scale) - lg[..., None])
        dv[:, :, s0 : s0 + _BLOCK] = torch.matmul(p.transpose(-1, -2), dog)
        ds = p * (torch.matmul(dog, vb.to(acc).transpose(-1, -2)) - delta[..., None]) * scale
        dq += torch.matmul(ds, kb.to(acc))
        dk[:, :, s0 : s0 + _BLOCK] = torch.matmul(ds.transpose(-1, -2), qg.to(acc))
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------------------------------------
# Prefix + segment, merged by log-sum-exp.
# ----------------------------------------------------------------------------------------------------------


def _fold(x: Tensor, hkv: int) -> Tensor:
    """[B, H, T, ...] -> [1, Hkv, B*g*T, ...]: all rows of all branches query the one shared prefix."""
    b, h = x.shape[:2]
    x = x.reshape(b, hkv, h // hkv, *x.shape[2:]).transpose(0, 1)
    return x.reshape(1, hkv, -1, *x.shape[4:])


def _unfold(x: Tensor, b: int, h: int) -> Tensor:
    hkv = x.shape[1]
    x = x.reshape(hkv, b, h // hkv, -1, *x.shape[3:]).transpose(0, 1)
    return x.reshape(b, h, *x.shape[3:])


def merge_lse(outs: Sequence[Tensor], lses: Sequence[Tensor], total: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Partial attention results (out [..., d], lse [...]) over disjoint key sets merged by log-sum-exp: (out in
    the accumulation dtype, total lse); where no part saw a key (lse -inf), the output is 0. `total`: the merged
    lse when the caller has it, else the log-sum-exp over the parts. The one place this merge is written."""
    if total is None:
        total = torch.logsumexp(torch.stack(list(lses)), dim=0)
    safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    acc = _acc(outs[0])
    weighted = [o.to(acc) * torch.exp(lse - safe)[..., None].to(acc) for o, lse in zip(outs, lses)]
    return sum(weighted[1:], weighted[0]), total


def merge_parts(o1: Tensor, l1: Tensor, o2: Tensor, l2: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial attention results merged (`merge_lse`), in o1's dtype."""
    o, lse = merge_lse((o1, o2), (l1, l2), torch.logaddexp(l1, l2))
    return o.to(o1.dtype), lse


def merge_ranks(o: Sequence[Tensor], lse: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """The partial results of the ranks (over disjoint key sets, in rank order) merged (`merge_lse`), in o[0]'s
    dtype."""
    out, total = merge_lse(o, lse)
    return out.to(o[0].dtype), total


def merge_over(group: SequenceGroup, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """The partial results (o [..., d], lse [...]) of every rank of `group` merged (`merge_lse`; a rank with no
    rows passes lse = -inf): the same (o, lse) on every rank. The weighted parts are summed over the group in
    the accumulation dtype."""
    if group.size == 1:
        return o, lse
    weighted, total = merge_lse((o,), (lse,), torch.logsumexp(torch.stack(group.gather(lse)), dim=0))
    group.sum_(weighted)
    return weighted.to(o.dtype), total


def _prefix_part(q: Tensor, pk: Tensor, pv: Tensor, scale: float, kernel: str, parallel: SequenceGroup):
    """(out, lse, aux) of q [B, H, T, d] over the prefix rows (this rank's, merged over the group `parallel`;
    aux: what the kernel's backward needs)."""
    b, h = q.shape[:2]
    aux = None
    if pk.shape[1]:
        o, lse, aux = _forward(_fold(q, pk.shape[0]), pk[None], pv[None], False, scale, kernel)
        o, lse = _unfold(o, b, h), _unfold(lse, b, h)
    else:  # a rank that holds none of the visible rows
        o = q.new_zeros(*q.shape[:-1], pv.shape[-1])
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_acc(q), device=q.device)
    return (*merge_over(parallel, o, lse), aux)


@dataclass(frozen=True)
class SegmentContext:
    """What a segment's queries attend to besides their own keys, and how (`segment_attention`): the `prefix` keys
    and values [Hkv, N, d] (constant to autograd) and the sinks `prefix_grad` the backward adds their gradient into;
    the keys and values `lead` [B, Hkv, L, d] of the segment's tokens before these queries and their sinks
    `lead_grad`; the attention `kernel`; the sequence-parallel group the prefix is sharded over."""

    prefix: tuple[Tensor, Tensor] | None = None
    prefix_grad: tuple[Tensor, Tensor] | None = None
    lead: tuple[Tensor, Tensor] | None = None
    lead_grad: tuple[Tensor, Tensor] | None = None
    kernel: str = "auto"
    parallel: SequenceGroup = ONE_RANK


class _PrefixSegmentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, around: SegmentContext):
        (prefix_k, prefix_v), kernel, parallel, lead = around.prefix, around.kernel, around.parallel, around.lead
        grad_k, grad_v = around.prefix_grad if around.prefix_grad is not None else (None, None)
        o_p, l_p, aux_p = _prefix_part(q, prefix_k, prefix_v, scale, kernel, parallel)
        o_s, l_s, aux_s = _forward(q, k, v, True, scale, kernel)
        o, lse = merge_parts(o_p, l_p, o_s, l_s)
        aux_l = None
        if lead is not None:
            o_l, l_l, aux_l = _forward(q, *lead, False, scale, kernel)
            o, lse = merge_parts(o_l, l_l, o, lse)
        ctx.aux = (aux_p, aux_s, aux_l)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.lead, ctx.lead_grad = lead, around.lead_grad  # constants to autograd, as the prefix
        # The prefix is a view of a state buffer that capture keeps appending to, so it is held as a plain
        # attribute (autograd's version check would otherwise reject the later appends beyond it).
        ctx.prefix = (prefix_k, prefix_v)
        ctx.grads = (grad_k, grad_v)
        ctx.scale, ctx.kernel, ctx.parallel = scale, kernel, parallel
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        (pk, pv), (gk, gv) = ctx.prefix, ctx.grads
        b, h = q.shape[:2]
        hkv = k.shape[1]
        do = do.contiguous()
        aux_p, aux_s, aux_l = ctx.aux
        dq, dk, dv = part_backward(do, q, k, v, o, lse, True, ctx.scale, ctx.kernel, aux_s)
        if ctx.lead is not None:
            dq = dq.add_(unmasked_part_backward(do, q, *ctx.lead, o, lse, ctx.scale, ctx.kernel, aux_l,
                                                ctx.lead_grad))
        dqp = None
        if pk.shape[1]:
            f = lambda x: _fold(x, hkv)  # noqa: E731
            dqp = prefix_part_backward(f(do), f(q), pk, pv, f(o), f(lse), ctx.scale, ctx.kernel, aux_p,
                                       None if gk is None else (gk, gv))
            dqp = _unfold(dqp, b, h)
        if ctx.parallel.size > 1:  # all ranks' rows' shares: q's gradient is the same on every rank
            dqp = ctx.parallel.sum_(torch.zeros_like(dq) if dqp is None else dqp)  # a rank may hold none of them
        return dq if dqp is None else dq.add_(dqp), dk, dv, None, None


def segment_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, around: SegmentContext = SegmentContext()
                      ) -> Tensor:
    """Causal attention of a segment over `around.prefix` (constant to autograd) and its own keys.

    If `around.prefix_grad` is given, the backward adds dLoss/dprefix into it in place: that is how the exact
    mode collects the gradient of the prefix state across branches and prompt chunks. Over a `parallel` group of
    several ranks, `prefix` is this rank's rows (possibly none) of a prefix sharded over the group.

    `around.lead`: keys and values [B, Hkv, L, d] of the segment's tokens before these queries (a query tile of a
    recomputed layer, models/common/recompute.py), all visible to every query, constant to autograd like the
    prefix: the backward adds their gradient into `lead_grad` (sinks of their shape), if given.
    """
    prefix = around.prefix
    if around.lead is None and (prefix is None or (around.parallel.size == 1 and prefix[0].shape[1] == 0)):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    if prefix is None:
        around = replace(around, prefix=(k.new_zeros(k.shape[1], 0, k.shape[-1]),
                                         v.new_zeros(v.shape[1], 0, v.shape[-1])))
    return _PrefixSegmentAttention.apply(q, k, v, scale, around)


def _masked_part(q: Tensor, k: Tensor, v: Tensor, scale: float, visible: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) of q [B, H, 1, d] over the first `visible` rows (a 0-dim device tensor) of k/v [B, Hkv, L, d]:
    the static decode's own tokens, a fixed-size buffer whose later rows are masked out. Short (L <= the new
    tokens), so not blocked; fp32 scores, as the blocked path's."""
    qg, _ = _group(q, k.shape[1])
    s = _products(qg, k.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.arange(k.shape[2], device=k.device) >= visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.exp(s - lse[..., None]), v.to(s.dtype))
    return o.to(q.dtype).reshape(*q.shape[:3], -1), lse.reshape(q.shape[:3])


@torch.no_grad()
def decode_attention(
    q: Tensor, own_k: Tensor, own_v: Tensor, scale: float, prefix: tuple[Tensor, Tensor] | None = None,
    parallel: SequenceGroup = ONE_RANK, own_visible: Tensor | None = None,
) -> Tensor:
    """One new token per row (q [B, H, 1, d]) over the shared prefix and the row's own tokens so far, itself
    included (own_k/own_v [B, Hkv, L+1, d]; with `own_visible`, the static decode's whole buffer of which that
    many rows count); merged by log-sum-exp like `segment_attention`."""
    if q.shape[2] != 1:
        raise ValueError("decode_attention takes one query token per row")
    if own_visible is None:
        o, lse = part_forward(q, own_k, own_v, False, scale)
    else:
        o, lse = _masked_part(q, own_k, own_v, scale, own_visible)
    if prefix is not None and (parallel.size > 1 or prefix[0].shape[1]):
        o, lse = merge_parts(*_prefix_part(q, prefix[0], prefix[1], scale, "auto", parallel)[:2], o, lse)
    return o
