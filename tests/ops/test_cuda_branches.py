"""ops/attention.py's CUDA branches (`cuda_flash`, `cuda_efficient`) run on CPU tensors through the test-only stand-in
of the two kernels (tests/sdpa_standin.py), which holds their contracts: every attention part (prefix, segment, a
query tile's lead keys, decode, the prefix gradient's row blocks) against a plain fp64 softmax formula written here,
and the exact GRPO gradient of each family's tiny model with the kernels `choose_kernel` takes on CUDA against the
same with the CPU kernels. Also the fixes the kernels' contracts called for, and the blocked torch path's fp32 scores.
The split parts over ranks: tests/parallel/test_split_cuda_branches.py."""

from __future__ import annotations

import math

import pytest
import torch

import longstraw as ls
from longstraw.ops import attention
from longstraw.ops.attention import (SegmentContext, decode_attention, merge_parts, part_backward, part_forward,
                                     segment_attention)
from tests import sdpa_standin
from tests.conftest import GLM, flat_grad, rel_err, tiny_model
from tests.sdpa_standin import ContractError

# kernel, dtype, relative tolerance against fp64 (fp16 keeps 10 bits: tight enough to see any plumbing error)
CASES = [("cuda_flash", torch.float16, 4e-3), ("cuda_flash", torch.bfloat16, 3e-2),
         ("cuda_efficient", torch.float32, 2e-6)]
CASE_IDS = ["flash-fp16", "flash-bf16", "efficient-fp32"]


@pytest.fixture
def standin():
    with sdpa_standin.installed() as recorder:
        yield recorder


@pytest.fixture
def small_row_blocks(monkeypatch):
    """The prefix gradient in blocks of 16 key rows (CPU tensors read the CPU count)."""
    monkeypatch.setattr(attention, "PREFIX_GRAD_ROWS", 16)
    monkeypatch.setattr(attention, "PREFIX_GRAD_ROWS_CPU", 16)


def inputs(b, h, hkv, t, n, lead, d=16, seed=0):
    """fp64 q, k, v [B, H|Hkv, T, d], prefix k, v [Hkv, N, d], lead k, v [B, Hkv, L, d]."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, h, t, d), (b, hkv, t, d), (b, hkv, t, d), (hkv, n, d), (hkv, n, d), (b, hkv, lead, d),
              (b, hkv, lead, d)]
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def reference(q, k, v, pk, pv, lk, lv, scale):
    """Softmax attention of q over [prefix (shared by the batch) | lead | own keys], all visible but the own keys'
    later ones; grouped heads by repetition."""
    b, h, t, _ = q.shape
    keys = torch.cat([pk[None].expand(b, -1, -1, -1), lk, k], dim=2).repeat_interleave(h // k.shape[1], 1)
    vals = torch.cat([pv[None].expand(b, -1, -1, -1), lv, v], dim=2).repeat_interleave(h // k.shape[1], 1)
    seen = pk.shape[1] + lk.shape[2]
    s = q @ keys.transpose(-1, -2) * scale
    own = torch.arange(keys.shape[2]) - seen
    s = s.masked_fill(own[None, :] > torch.arange(t)[:, None], float("-inf"))
    return torch.softmax(s, -1) @ vals


def reference_grads(leaves64, scale, do):
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves64]
    out = reference(*leaves, scale)
    return out.detach(), torch.autograd.grad(out, leaves, do.double())


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    """Relative error (2-norm) within `tol`."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30)) <= tol


@pytest.mark.parametrize("kernel,dtype,tol", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("h,hkv", [(4, 2), (2, 2)])
def test_prefix_lead_and_segment_parts(standin, small_row_blocks, kernel, dtype, tol, h, hkv):
    """A query tile of a recomputed layer: prefix rows (3 gradient row blocks), the tile's lead keys (2 row blocks)
    and its own causal keys; output, dq/dk/dv and the prefix's and lead's gradient sinks."""
    b, t, n, lead, d = 2, 7, 37, 20, 16
    full = inputs(b, h, hkv, t, n, lead, d)
    q, k, v, pk, pv, lk, lv = (x.to(dtype) for x in full)
    scale = d**-0.5
    do = torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(9)).to(dtype)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    sinks = [torch.zeros(x.shape, dtype=torch.float32) for x in (pk, pv, lk, lv)]
    out = segment_attention(*leaves, scale,
                            SegmentContext(prefix=(pk, pv), prefix_grad=(sinks[0], sinks[1]), kernel=kernel,
                                           lead=(lk, lv), lead_grad=(sinks[2], sinks[3])))
    out.backward(do)
    assert out.dtype == dtype and all(x.grad.dtype == dtype for x in leaves)
    want_out, want = reference_grads([x.double() for x in (q, k, v, pk, pv, lk, lv)], scale, do)
    assert close(out, want_out, tol)
    for name, got, w in zip(("q", "k", "v", "prefix k", "prefix v", "lead k", "lead v"),
                            [x.grad for x in leaves] + sinks, want):
        assert close(got, w, tol), name
    kinds = {c[0] for c in standin.calls}
    assert kinds == {kernel}


@pytest.mark.parametrize("kernel,dtype,tol", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("h,hkv", [(4, 2), (4, 1)])
def test_decode_through_auto(standin, monkeypatch, kernel, dtype, tol, h, hkv):
    """decode_attention picks its kernels itself ("auto"): as on CUDA, the row's own tokens and the prefix."""
    monkeypatch.setattr(attention, "choose_kernel", sdpa_standin.as_on_cuda(attention.choose_kernel))
    b, own, n, d = 3, 5, 40, 16
    q, k, v, pk, pv, _, _ = (x.to(dtype) for x in inputs(b, h, hkv, own, n, 0, d, seed=1))
    q = q[:, :, -1:]  # the newest token, which sees every own token
    got = decode_attention(q, k, v, d**-0.5, prefix=(pk, pv))
    assert got.dtype == dtype
    q, k, v, pk, pv = (x.double() for x in (q, k, v, pk, pv))
    # the newest own key as the reference's own part, the others as lead keys
    want = reference(q, k[:, :, -1:], v[:, :, -1:], pk, pv, k[:, :, :-1], v[:, :, :-1], d**-0.5)
    assert close(got, want, tol)
    assert {c[0] for c in standin.calls} == {kernel}


@pytest.mark.parametrize("kernel,dtype,tol", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_part_against_formula(standin, kernel, dtype, tol, causal):
    """One part, 40 queries (the memory-efficient kernel's log-sum-exp padded to 64 rows) over 40 or 70 keys."""
    b, h, hkv, t, d = 2, 6, 2, 40, 32
    s = t if causal else 70
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
               for shape in ((b, h, t, d), (b, hkv, s, d), (b, hkv, s, d)))
    scale = d**-0.5
    o, lse, aux = attention._forward(q, k, v, causal, scale, kernel)
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, h, t)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    sc = leaves[0] @ leaves[1].repeat_interleave(h // hkv, 1).transpose(-1, -2) * scale
    if causal:
        sc = sc.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(sc, -1) @ leaves[2].repeat_interleave(h // hkv, 1)
    assert float((lse.double() - torch.logsumexp(sc, -1).detach()).abs().max()) <= 1e-5
    assert close(o, ref, tol)
    do = torch.randn(b, h, t, d, generator=g, dtype=torch.float64).to(dtype)
    got = part_backward(do, q, k, v, o, lse, causal, scale, kernel=kernel, aux=aux)
    for name, a, w in zip("qkv", got, torch.autograd.grad(ref, leaves, do.double())):
        assert a.shape == w.shape and a.dtype == dtype, name
        assert close(a, w, tol), name


def test_flash_takes_grouped_heads_unrepeated(standin):
    """FlashAttention-2 gets the key heads as they are (it sums dK/dV over each group itself), in every part and
    every prefix-gradient row block; the memory-efficient kernel gets repeated keys only for the causal part."""
    b, h, hkv, t, n, lead, d = 2, 4, 2, 5, 30, 9, 16
    for kernel, dtype in (("cuda_flash", torch.bfloat16), ("cuda_efficient", torch.float32)):
        q, k, v, pk, pv, lk, lv = (x.to(dtype) for x in inputs(b, h, hkv, t, n, lead, d, seed=3))
        q.requires_grad_(True)
        standin.heads.clear()
        segment_attention(q, k, v, d**-0.5,
                          SegmentContext(prefix=(pk, pv), kernel=kernel, lead=(lk, lv))).sum().backward()
        seen = standin.heads
        if kernel == "cuda_flash":
            assert seen and all(kv == hkv for _, _, _, kv in seen), seen
            assert any(qh == h for _, _, qh, _ in seen)  # the segment's and lead's queries keep their heads
        else:
            assert seen and all(kv == (h if causal else hkv) for _, causal, _, kv in seen), seen


@pytest.mark.parametrize("kernel,dtype", [("cuda_flash", torch.bfloat16), ("cuda_efficient", torch.float32),
                                          ("torch", torch.float32), ("flash", torch.float32)])
def test_part_without_keys_merges_as_none(standin, kernel, dtype):
    """A part over no keys adds nothing: lse -inf and output 0 whichever the kernel (FlashAttention-2 itself gives
    lse +inf there, which merge_parts would turn into NaN), and no gradient."""
    b, h, hkv, t, d = 1, 4, 2, 3, 16
    q, k, v, *_ = (x.to(dtype) for x in inputs(b, h, hkv, t, 0, 0, d, seed=4))
    none = k[:, :, :0]
    o0, l0 = part_forward(q, none, none, False, 0.25, kernel=kernel)
    assert bool(torch.isneginf(l0).all()) and not o0.any()
    o1, l1 = part_forward(q, k, v, False, 0.25, kernel=kernel)
    o, lse = merge_parts(o0, l0, o1, l1)
    assert torch.equal(o, o1) and torch.equal(lse, l1)
    dq, dk, dv = part_backward(torch.ones_like(o), q, none, none, o, lse, False, 0.25, kernel=kernel)
    assert not dq.any() and dk.shape == none.shape and dv.shape == none.shape


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_efficient", "torch", "flash"])
def test_causal_part_needs_as_many_keys_as_queries(kernel):
    """FlashAttention-2 aligns a causal mask to the last key, the others to the first: such a part is refused."""
    q = torch.zeros(1, 2, 3, 16, dtype=torch.bfloat16 if kernel == "cuda_flash" else torch.float32)
    k = torch.zeros(1, 2, 5, 16, dtype=q.dtype)
    with pytest.raises(ValueError, match="as many keys as queries"):
        part_forward(q, k, k, True, 0.25, kernel=kernel)
    with pytest.raises(ValueError, match="as many keys as queries"):
        part_backward(q, q, k, k, q, q[..., 0].float(), True, 0.25, kernel=kernel)


def test_efficient_backward_keeps_the_forwards_lse_padding(standin):
    """The memory-efficient backward reads the log-sum-exp in whole 32-row blocks: its padding rows are +inf, as
    the forward writes them (33 queries: 31 padding rows)."""
    q, k, v, *_ = inputs(1, 2, 2, 33, 0, 0, 16, seed=5)
    q, k, v = (x.float() for x in (q, k, v))
    o, lse, aux = attention._forward(q, k, v, True, 0.25, "cuda_efficient")
    assert aux[2] == 64
    dq, _, _ = part_backward(torch.ones_like(o), q, k, v, o, lse, True, 0.25, "cuda_efficient", aux)
    assert torch.isfinite(dq).all()


def test_efficient_half_backward_gets_the_forwards_output_layout(standin):
    """In half precision the memory-efficient backward reads the output's rows at the forward's stride: a merged
    output in [B, H, T, d] order goes back to [B, T, H, d] order first."""
    b, h, hkv, t, n, d = 2, 4, 2, 6, 11, 16
    full = inputs(b, h, hkv, t, n, 0, d, seed=6)
    q, k, v, pk, pv = (x.to(torch.bfloat16) for x in full[:5])
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = segment_attention(*leaves, d**-0.5, SegmentContext(prefix=(pk, pv), kernel="cuda_efficient"))
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(do)
    empty = full[1][:, :, :0]
    _, want = reference_grads([x.double() for x in (q, k, v, pk, pv)] + [empty, empty], d**-0.5, do)
    for got, w in zip([x.grad for x in leaves], want):
        assert close(got, w, 3e-2)


@pytest.mark.parametrize("case", ["fp32-flash", "gqa-efficient", "strided-q", "lse-strided", "lse-zero-padded"])
def test_standin_refuses_a_broken_contract(standin, case):
    """The stand-in fails loudly on what the CUDA kernels would misread or refuse."""
    b, h, t, d = 1, 4, 5, 16
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, h, t, d, generator=g)
    ops = torch.ops.aten
    with pytest.raises(ContractError):
        if case == "fp32-flash":
            ops._scaled_dot_product_flash_attention(q, q, q, 0.0, False, False, scale=0.25)
        elif case == "gqa-efficient":
            ops._scaled_dot_product_efficient_attention(q, q[:, :2], q[:, :2], None, True, 0.0, False, scale=0.25)
        elif case == "strided-q":
            qs = torch.randn(b, h, d, t, generator=g).transpose(-1, -2).bfloat16()
            ops._scaled_dot_product_flash_attention(qs, qs.contiguous(), qs.contiguous(), 0.0, False, False)
        elif case == "lse-strided":
            qb = q.bfloat16()
            o, lse, cq, ck, mq, mk, rng, unused, _ = ops._scaled_dot_product_flash_attention(qb, qb, qb, 0.0, False,
                                                                                             False)
            strided = torch.cat([lse, lse], -1)[..., ::2]
            ops._scaled_dot_product_flash_attention_backward(o, qb, qb, qb, o, strided, cq, ck, mq, mk, 0.0, False,
                                                             rng, unused)
        else:
            o, lse, seed, offset = ops._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.0, False)
            lse = torch.nn.functional.pad(lse[..., :t], (0, lse.shape[-1] - t))
            ops._scaled_dot_product_efficient_attention_backward(o, q, q, q, None, o, lse, seed, offset, 0.0,
                                                                 [True, True, True, False], False)


def test_standin_aligns_causal_masks_as_the_kernels(standin):
    """FlashAttention-2 bottom-right, the memory-efficient kernel top-left, against math SDPA with explicit masks."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (3, 5, 5))
    bottom_right = torch.ones(3, 5, dtype=torch.bool).tril(2)
    top_left = torch.ones(3, 5, dtype=torch.bool).tril(0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    o_flash = torch.ops.aten._scaled_dot_product_flash_attention(q.half(), k.half(), v.half(), 0.0, True, False)[0]
    assert float((o_flash.float() - sdpa(q, k, v, attn_mask=bottom_right)).abs().max()) <= 2e-3
    o_eff = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[0]
    assert float((o_eff - sdpa(q, k, v, attn_mask=top_left)).abs().max()) <= 1e-6


def test_blocked_scores_of_half_inputs_stay_fp32():
    """The blocked torch path (absorbed MLA on CUDA, static decode) scores bf16 inputs in fp32: the log-sum-exp
    within fp32 rounding of the fp64 value of the same bf16 numbers (a bf16 QK^T would be off by ~1e-2)."""
    g = torch.Generator().manual_seed(10)
    b, h, hkv, t, s, d = 1, 4, 2, 3, 50, 64
    q = (3 * torch.randn(b, h, t, d, generator=g)).bfloat16()
    k = (3 * torch.randn(b, hkv, s, d, generator=g)).bfloat16()
    v = torch.randn(b, hkv, s, d, generator=g).bfloat16()
    scale = d**-0.5
    want = torch.logsumexp(q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * scale, -1)
    _, lse = part_forward(q, k, v, False, scale, kernel="torch")
    assert float((lse.double() - want).abs().max()) <= 1e-4 * float(want.abs().max())
    _, lse_masked = attention._masked_part(q[:, :, :1], k, v, scale, torch.tensor(s))
    assert float((lse_masked.double() - want[:, :, :1]).abs().max()) <= 1e-4 * float(want.abs().max())


def test_every_cuda_call_site_in_attention_runs(standin, small_row_blocks, monkeypatch):
    """Each of ops/attention.py's calls that hand a part to a kernel runs on both CUDA kernels: the segment's
    forward and backward (prefix, own, lead) and decode's (own, prefix)."""
    monkeypatch.setattr(attention, "choose_kernel", sdpa_standin.as_on_cuda(attention.choose_kernel))
    for dtype in (torch.bfloat16, torch.float32):  # as chosen on CUDA: flash, memory-efficient
        q, k, v, pk, pv, lk, lv = (x.to(dtype) for x in inputs(2, 4, 2, 5, 40, 20, 16, seed=11))
        q.requires_grad_(True)
        segment_attention(q, k, v, 0.25, SegmentContext(prefix=(pk, pv), lead=(lk, lv))).sum().backward()
        decode_attention(q.detach()[:, :, :1], k, v, 0.25, prefix=(pk, pv))
    sites = sdpa_standin.call_sites(attention)
    ran = standin.paths(sites)
    want = {(kernel, *site[:3]) for kernel in ("cuda_flash", "cuda_efficient") for site in sites}
    assert ran == want, sorted(want - ran)
    print(f"\ncuda_* code paths run in ops/attention.py: {len(ran)} ({len(sites)} call sites x 2 kernels)")


def _grad(model, prompt, responses, engine, mode="exact"):
    model.zero_grad(set_to_none=True)
    ls.grpo_backward(model, prompt, responses, [1.0, -0.4, -0.6], mode=mode, engine=engine)
    return flat_grad(model).double()


def _build(arch: str, dtype: torch.dtype):
    if arch == "glm_moe_dsa":
        torch.manual_seed(0)
        return ls.build_model(GLM, dtype=dtype)
    return tiny_model(arch, dtype=dtype)


@pytest.mark.parametrize("arch,checkpoint", [("qwen3", False), ("qwen3", True), ("qwen3_5_text", False),
                                             ("glm_moe_dsa", False)])
def test_exact_gradient_with_cuda_kernels(standin, monkeypatch, arch, checkpoint):
    """The exact GRPO gradient of each family's tiny model with the kernels chosen as on CUDA: fp32 (memory-efficient)
    equal to the CPU kernels' to fp32 rounding; bf16 (FlashAttention-2) as close to the fp64 gradient as the CPU
    flash kernel's bf16 run. With per-layer checkpointing the attention layers recompute in query tiles (lead keys);
    GLM-5's MLA attends densely here (positions within its top-k: one shared latent head as keys and values)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 97, (12 if arch == "glm_moe_dsa" else 30,), generator=g)
    responses = [torch.randint(0, 97, (n,), generator=g) for n in (4, 1, 6)]
    engine = ls.EngineConfig(prompt_chunk=5 if arch == "glm_moe_dsa" else 8, prompt_graph_budget=0,
                             checkpoint_layers=checkpoint)
    fp32, bf16, ref64 = (_build(arch, dtype) for dtype in (torch.float32, torch.bfloat16, torch.float64))
    ref64.load_state_dict({k: v.double() for k, v in bf16.state_dict().items()})
    cpu = {"fp32": _grad(fp32, prompt, responses, engine), "bf16": _grad(bf16, prompt, responses, engine)}
    want_bf16 = _grad(ref64, prompt, responses, engine, mode="naive")
    monkeypatch.setattr(attention, "choose_kernel", sdpa_standin.as_on_cuda(attention.choose_kernel))
    cuda_fp32 = _grad(fp32, prompt, responses, engine)
    assert {c[0] for c in standin.calls} == {"cuda_efficient"}
    cuda_bf16 = _grad(bf16, prompt, responses, engine)
    assert {c[0] for c in standin.calls} == {"cuda_efficient", "cuda_flash"}
    assert rel_err(cuda_fp32, cpu["fp32"]) <= 1e-5
    err_cpu, err_cuda = rel_err(cpu["bf16"], want_bf16), rel_err(cuda_bf16, want_bf16)
    assert math.isfinite(err_cuda) and err_cuda <= max(1.5 * err_cpu, 1e-2), (err_cuda, err_cpu)
