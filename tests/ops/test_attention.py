"""segment_attention (prefix + causal segment, merged by log-sum-exp) against a plain float64 softmax attention.

The reference is written here independently of the library: prefix keys (shared by every batch row) are
concatenated in front of the segment keys, the prefix is fully visible, the segment part is causal, and GQA
is a repeat_interleave of the kv heads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longstraw.ops import attention
from longstraw.ops.attention import SegmentContext, part_backward, part_forward, segment_attention

KERNELS = ("flash", "torch")
HEADS = ((4, 2), (2, 2))  # (H, Hkv): GQA and plain MHA


def reference_attention(q, k, v, scale, pk=None, pv=None):
    """Plain softmax attention. q [B,H,T,d]; k, v [B,Hkv,T,d]; pk, pv [Hkv,N,d] (or None) shared by all B rows."""
    b, h, t, _ = q.shape
    hkv = k.shape[1]
    if pk is not None:
        keys = torch.cat([pk.unsqueeze(0).expand(b, -1, -1, -1), k], dim=2)
        vals = torch.cat([pv.unsqueeze(0).expand(b, -1, -1, -1), v], dim=2)
        n = pk.shape[1]
    else:
        keys, vals, n = k, v, 0
    keys = keys.repeat_interleave(h // hkv, dim=1)
    vals = vals.repeat_interleave(h // hkv, dim=1)
    s = torch.matmul(q, keys.transpose(-1, -2)) * scale
    qi = torch.arange(t)[:, None]
    kj = torch.arange(n + t)[None, :] - n  # segment key positions; prefix keys are < 0, always visible
    s = s.masked_fill(kj > qi, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vals)


def make_inputs(b, h, hkv, t, n, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64)
    pk = torch.randn(hkv, n, d, generator=g, dtype=torch.float64)
    pv = torch.randn(hkv, n, d, generator=g, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, pk, pv)]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def reference_grads(q, k, v, pk, pv, scale, do):
    """Outputs and float64 autograd gradients w.r.t. q, k, v, pk, pv of <reference_attention, do>."""
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v, pk, pv)]
    out = reference_attention(leaves[0], leaves[1], leaves[2], scale, leaves[3], leaves[4])
    grads = torch.autograd.grad(out, leaves, do.double())
    return out.detach(), grads


GRID = [
    pytest.param(kernel, h, hkv, n, t, b, id=f"{kernel}-H{h}kv{hkv}-N{n}-T{t}-B{b}")
    for kernel in KERNELS
    for h, hkv in HEADS
    for n in (1, 5, 1500)
    for t in (1, 7)
    for b in (1, 3)
]


@pytest.mark.parametrize("kernel,h,hkv,n,t,b", GRID)
def test_prefix_forward_matches_reference(kernel, h, hkv, n, t, b):
    d = 16
    q, k, v, pk, pv = make_inputs(b, h, hkv, t, n, d)
    scale = d**-0.5
    out = segment_attention(q, k, v, scale, SegmentContext(prefix=(pk, pv), kernel=kernel))
    ref = reference_attention(*(x.double() for x in (q, k, v)), scale, pk.double(), pv.double())
    assert out.shape == (b, h, t, d)
    assert out.dtype == torch.float32
    assert max_err(out, ref) <= 1e-5


@pytest.mark.parametrize("kernel,h,hkv,n,t,b", GRID)
def test_prefix_backward_matches_reference(kernel, h, hkv, n, t, b):
    d = 16
    q, k, v, pk, pv = make_inputs(b, h, hkv, t, n, d, seed=1)
    scale = d**-0.5
    do = torch.randn(b, h, t, d)
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    gk, gv = torch.zeros_like(pk), torch.zeros_like(pv)
    out = segment_attention(qq, kk, vv, scale, SegmentContext(prefix=(pk, pv), prefix_grad=(gk, gv), kernel=kernel))
    out.backward(do)
    ref_out, (rq, rk, rv, rpk, rpv) = reference_grads(q, k, v, pk, pv, scale, do)
    assert max_err(out, ref_out) <= 1e-5
    for name, got, want in (("q", qq.grad, rq), ("k", kk.grad, rk), ("v", vv.grad, rv), ("pk", gk, rpk), ("pv", gv, rpv)):
        assert got.shape == want.shape, name
        assert max_err(got, want) <= 2e-5 * max(1.0, float(want.abs().max())), name


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [64, 1499])
def test_prefix_backward_in_row_blocks_matches_reference(kernel, rows, monkeypatch):
    """The prefix rows' gradient comes out `grad_rows` rows at a time (the last block partial): q's gradient
    summed over the blocks and each block's rows in the sink are the reference's."""
    monkeypatch.setattr(attention, "PREFIX_GRAD_ROWS_CPU", rows)
    test_prefix_backward_matches_reference(kernel, 4, 2, 1500, 7, 3)


@pytest.mark.parametrize("kernel", KERNELS)
def test_prefix_grad_optional(kernel):
    """Without prefix_grad, the prefix gradient is dropped but q/k/v gradients are still exact."""
    b, h, hkv, t, n, d = 2, 4, 2, 7, 5, 16
    q, k, v, pk, pv = make_inputs(b, h, hkv, t, n, d, seed=2)
    scale = d**-0.5
    do = torch.randn(b, h, t, d)
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    segment_attention(qq, kk, vv, scale, SegmentContext(prefix=(pk, pv), kernel=kernel)).backward(do)
    _, (rq, rk, rv, _, _) = reference_grads(q, k, v, pk, pv, scale, do)
    assert max_err(qq.grad, rq) <= 2e-5
    assert max_err(kk.grad, rk) <= 2e-5
    assert max_err(vv.grad, rv) <= 2e-5


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("h,hkv", HEADS)
def test_prefix_grad_accumulates_over_backwards(kernel, h, hkv):
    """Two forwards (different segments over the same prefix), two backwards: gk/gv hold the sum."""
    b, t, n, d = 3, 7, 1500, 16
    scale = d**-0.5
    q1, k1, v1, pk, pv = make_inputs(b, h, hkv, t, n, d, seed=3)
    q2, k2, v2, _, _ = make_inputs(2, h, hkv, 4, n, d, seed=4)
    do1, do2 = torch.randn(b, h, t, d), torch.randn(2, h, 4, d)
    gk, gv = torch.zeros_like(pk), torch.zeros_like(pv)
    qs = [x.clone().requires_grad_(True) for x in (q1, q2)]
    o1 = segment_attention(qs[0], k1, v1, scale, SegmentContext(prefix=(pk, pv), prefix_grad=(gk, gv), kernel=kernel))
    o2 = segment_attention(qs[1], k2, v2, scale, SegmentContext(prefix=(pk, pv), prefix_grad=(gk, gv), kernel=kernel))
    o1.backward(do1)
    after_first = gk.clone()
    o2.backward(do2)
    _, (_, _, _, rpk1, rpv1) = reference_grads(q1, k1, v1, pk, pv, scale, do1)
    _, (_, _, _, rpk2, rpv2) = reference_grads(q2, k2, v2, pk, pv, scale, do2)
    assert max_err(after_first, rpk1) <= 2e-5
    assert max_err(gk, rpk1 + rpk2) <= 2e-5
    assert max_err(gv, rpv1 + rpv2) <= 2e-5
    # the second backward really added something
    assert max_err(gk, after_first) > 1e-3


@pytest.mark.parametrize("h,hkv", HEADS)
@pytest.mark.parametrize("empty_prefix", [False, True], ids=["none", "len0"])
def test_no_prefix_is_causal_attention(h, hkv, empty_prefix):
    b, t, d = 3, 9, 16
    q, k, v, pk, pv = make_inputs(b, h, hkv, t, 0, d, seed=5)
    scale = d**-0.5
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    prefix = (pk, pv) if empty_prefix else None
    out = segment_attention(qq, kk, vv, scale, SegmentContext(prefix=prefix))
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    ref = reference_attention(*leaves, scale)
    assert max_err(out, ref) <= 1e-5
    do = torch.randn(b, h, t, d)
    out.backward(do)
    rq, rk, rv = torch.autograd.grad(ref, leaves, do.double())
    assert max_err(qq.grad, rq) <= 2e-5
    assert max_err(kk.grad, rk) <= 2e-5
    assert max_err(vv.grad, rv) <= 2e-5


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("h,hkv", HEADS)
def test_float64_is_exact(kernel, h, hkv):
    b, t, n, d = 2, 7, 1500, 16
    q, k, v, pk, pv = make_inputs(b, h, hkv, t, n, d, dtype=torch.float64, seed=6)
    scale = d**-0.5
    do = torch.randn(b, h, t, d, dtype=torch.float64)
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    gk, gv = torch.zeros_like(pk), torch.zeros_like(pv)
    out = segment_attention(qq, kk, vv, scale, SegmentContext(prefix=(pk, pv), prefix_grad=(gk, gv), kernel=kernel))
    assert out.dtype == torch.float64
    out.backward(do)
    ref_out, (rq, rk, rv, rpk, rpv) = reference_grads(q, k, v, pk, pv, scale, do)
    assert max_err(out, ref_out) <= 1e-12
    for got, want in ((qq.grad, rq), (kk.grad, rk), (vv.grad, rv), (gk, rpk), (gv, rpv)):
        assert max_err(got, want) <= 1e-12


@pytest.mark.parametrize("kernel", KERNELS)
def test_bfloat16_runs_and_is_close(kernel):
    b, h, hkv, t, n, d = 2, 4, 2, 7, 1500, 16
    q, k, v, pk, pv = make_inputs(b, h, hkv, t, n, d, dtype=torch.bfloat16, seed=7)
    scale = d**-0.5
    do = torch.randn(b, h, t, d).to(torch.bfloat16)
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    gk, gv = torch.zeros_like(pk), torch.zeros_like(pv)
    out = segment_attention(qq, kk, vv, scale, SegmentContext(prefix=(pk, pv), prefix_grad=(gk, gv), kernel=kernel))
    assert out.dtype == torch.bfloat16
    out.backward(do)
    ref_out, (rq, rk, rv, rpk, rpv) = reference_grads(q, k, v, pk, pv, scale, do)
    assert torch.isfinite(out).all()
    assert max_err(out, ref_out) <= 3e-2
    for got, want in ((qq.grad, rq), (kk.grad, rk), (vv.grad, rv), (gk, rpk), (gv, rpv)):
        assert got.dtype == torch.bfloat16
        assert torch.isfinite(got).all()
        assert float((got.double() - want).norm() / want.norm()) <= 3e-2


PART_CASES = [
    # (h, hkv, tq, tk, b); causal parts always have as many keys as queries; 1030 keys cross the 1024 block
    pytest.param(causal, h, hkv, tq, tk, b, id=f"{'causal' if causal else 'full'}-H{h}kv{hkv}-q{tq}-k{tk}-B{b}")
    for causal in (True, False)
    for h, hkv, tq, tk, b in [(4, 2, 7, 7, 2), (2, 1, 1030, 1030, 1), (2, 2, 33, 33, 2), (6, 2, 5, 1300, 2)]
    if not (causal and tq != tk)
]


@pytest.mark.parametrize("causal,h,hkv,tq,tk,b", PART_CASES)
def test_part_torch_matches_flash(causal, h, hkv, tq, tk, b):
    d = 16
    g = torch.Generator().manual_seed(8)
    q = torch.randn(b, h, tq, d, generator=g)
    k = torch.randn(b, hkv, tk, d, generator=g)
    v = torch.randn(b, hkv, tk, d, generator=g)
    do = torch.randn(b, h, tq, d, generator=g)
    scale = d**-0.5
    o_f, l_f = part_forward(q, k, v, causal, scale, kernel="flash")
    o_t, l_t = part_forward(q, k, v, causal, scale, kernel="torch")
    assert o_t.shape == o_f.shape == (b, h, tq, d)
    assert l_t.shape == l_f.shape == (b, h, tq)
    assert max_err(o_t, o_f) <= 1e-5
    assert max_err(l_t, l_f) <= 1e-5
    # and both against the float64 reference (lse included)
    qd, kd, vd = q.double(), k.double(), v.double()
    kr, vr = kd.repeat_interleave(h // hkv, 1), vd.repeat_interleave(h // hkv, 1)
    s = qd @ kr.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(tq, tk, dtype=torch.bool).triu(1), float("-inf"))
    assert max_err(o_t, torch.softmax(s, -1) @ vr) <= 1e-5
    assert max_err(l_t, torch.logsumexp(s, -1)) <= 1e-5
    g_f = part_backward(do, q, k, v, o_f, l_f, causal, scale, kernel="flash")
    g_t = part_backward(do, q, k, v, o_f, l_f, causal, scale, kernel="torch")
    for name, a, bb in zip("qkv", g_t, g_f):
        assert a.shape == bb.shape, name
        assert a.dtype == bb.dtype, name
        assert max_err(a, bb) <= 2e-5 * max(1.0, float(bb.abs().max())), name
    # the gradients are the true ones (checked against float64 autograd of the reference)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    kr = leaves[1].repeat_interleave(h // hkv, 1)
    vr = leaves[2].repeat_interleave(h // hkv, 1)
    s = leaves[0] @ kr.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(tq, tk, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.autograd.grad(torch.softmax(s, -1) @ vr, leaves, do.double())
    for name, a, want in zip("qkv", g_t, ref):
        assert max_err(a, want) <= 2e-5 * max(1.0, float(want.abs().max())), name


def test_auto_kernel_on_cpu_matches_reference():
    b, h, hkv, t, n, d = 2, 4, 2, 7, 5, 16
    q, k, v, pk, pv = make_inputs(b, h, hkv, t, n, d, seed=9)
    out = segment_attention(q, k, v, d**-0.5, SegmentContext(prefix=(pk, pv)))
    ref = reference_attention(*(x.double() for x in (q, k, v)), d**-0.5, pk.double(), pv.double())
    assert max_err(out, ref) <= 1e-5
    # sanity: the prefix matters (the test would catch a dropped prefix)
    no_prefix = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5, enable_gqa=True)
    assert max_err(out, no_prefix) > 1e-2


@pytest.mark.parametrize("kernel", KERNELS)
def test_strided_inputs_and_prefix_views(kernel):
    """As the model calls it: q/k/v in [B,T,H,d] memory layout (transposed views), and prefix / prefix_grad that
    are the first N positions of larger state buffers (non-contiguous views). Gradients land only in [:N]."""
    b, h, hkv, t, n, n_max, d = 3, 4, 2, 7, 1100, 1500, 16
    scale = d**-0.5
    g = torch.Generator().manual_seed(10)
    q = torch.randn(b, t, h, d, generator=g).transpose(1, 2)
    k = torch.randn(b, t, hkv, d, generator=g).transpose(1, 2)
    v = torch.randn(b, t, hkv, d, generator=g).transpose(1, 2)
    assert not q.is_contiguous()
    kbuf = torch.randn(hkv, n_max, d, generator=g)
    vbuf = torch.randn(hkv, n_max, d, generator=g)
    gkbuf, gvbuf = torch.zeros_like(kbuf), torch.zeros_like(vbuf)
    pk, pv = kbuf[:, :n], vbuf[:, :n]
    assert not pk.is_contiguous()
    do = torch.randn(b, t, h, d, generator=g).transpose(1, 2)
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    out = segment_attention(*leaves, scale,
                            SegmentContext(prefix=(pk, pv), prefix_grad=(gkbuf[:, :n], gvbuf[:, :n]), kernel=kernel))
    out.backward(do)
    ref_out, (rq, rk, rv, rpk, rpv) = reference_grads(q, k, v, pk, pv, scale, do)
    assert max_err(out, ref_out) <= 1e-5
    for got, want in zip([x.grad for x in leaves] + [gkbuf[:, :n], gvbuf[:, :n]], (rq, rk, rv, rpk, rpv)):
        assert max_err(got, want) <= 2e-5
    assert gkbuf[:, n:].abs().max() == 0 and gvbuf[:, n:].abs().max() == 0


@pytest.mark.parametrize("device,dtype,qk,v,want", [
    ("cpu", torch.bfloat16, 128, 128, "cpu_flash"),
    ("cuda", torch.bfloat16, 256, 256, "cuda_flash"),  # Qwen3.5's gated attention
    ("cuda", torch.float16, 128, 128, "cuda_flash"),
    ("cuda", torch.float32, 128, 128, "cuda_efficient"),
    ("cuda", torch.bfloat16, 576, 512, "torch"),  # absorbed MLA: key and value widths differ
    ("cuda", torch.bfloat16, 320, 320, "torch"),  # beyond FlashAttention-2's 256
    ("cuda", torch.float64, 64, 64, "torch"),
    ("mps", torch.float32, 64, 64, "torch"),
])
def test_kernel_choice(device, dtype, qk, v, want):
    from longstraw.ops.attention import choose_kernel

    assert choose_kernel(device, dtype, qk, v) == want


@pytest.mark.parametrize("kernel,dtype", [("cuda_flash", torch.bfloat16), ("cuda_efficient", torch.float32)])
def test_cuda_kernels_plumbing_on_meta_tensors(kernel, dtype, monkeypatch):
    """The CUDA kernels' calls (arguments, the padded log-sum-exp of the efficient kernel, grouped heads, the prefix
    backward in blocks of rows) checked with meta tensors, which run the ops' shape functions: forward and backward
    give the shapes and dtypes of the reference. Their numerics on CPU, through a stand-in of the kernels:
    tests/ops/test_cuda_branches.py; on a GPU: the test below."""
    monkeypatch.setattr(attention, "PREFIX_GRAD_ROWS", 16)
    meta = dict(device="meta", dtype=dtype)
    q = torch.empty(2, 4, 5, 16, **meta, requires_grad=True)
    k = torch.empty(2, 2, 5, 16, **meta, requires_grad=True)
    v = torch.empty(2, 2, 5, 16, **meta, requires_grad=True)
    pk, pv = torch.empty(2, 37, 16, **meta), torch.empty(2, 37, 16, **meta)
    gk, gv = torch.zeros_like(pk), torch.zeros_like(pv)
    out = segment_attention(q, k, v, 0.25, SegmentContext(prefix=(pk, pv), prefix_grad=(gk, gv), kernel=kernel))
    out.backward(torch.empty_like(out))
    assert out.shape == q.shape and out.dtype == dtype
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert k.grad.dtype == dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run bench/gpu/run.sh on one)")
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_cuda_kernels_equal_the_reference(dtype, tol):
    torch.manual_seed(0)
    args = [torch.randn(2, 4, 33, 64), torch.randn(2, 2, 33, 64), torch.randn(2, 2, 33, 64)]
    prefix = [torch.randn(2, 300, 64), torch.randn(2, 300, 64)]
    do = torch.randn(2, 4, 33, 64)

    def run(device, kernel, dt):
        q, k, v = (x.to(device, dt).requires_grad_() for x in args)
        pk, pv = (x.to(device, dt) for x in prefix)
        gk, gv = torch.zeros_like(pk), torch.zeros_like(pv)
        out = segment_attention(q, k, v, 0.125, SegmentContext(prefix=(pk, pv), prefix_grad=(gk, gv), kernel=kernel))
        out.backward(do.to(device, dt))
        return [t.float().cpu() for t in (out, q.grad, k.grad, v.grad, gk, gv)]

    for a, b in zip(run("cuda", "auto", dtype), run("cpu", "torch", torch.float32)):
        assert float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))
