"""Gated delta rule (Qwen3.5 linear layers) against an independent float64 step-by-step reference.

The reference is written here, not taken from the library: per value head, with a [dk, dv] state S,
    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
with q, k L2-normalised (x * rsqrt(sum x^2 + 1e-6)), q scaled by dk^-0.5 and each key head serving Hv/Hk
consecutive value heads (repeat_interleave). It loops over tokens and over heads with plain matrix products.

Also: the model-level gradient w.r.t. a Gated DeltaNet layer's prefix (recurrent) state, by finite differences.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import longstraw as ls
from longstraw.engine.replay import replay_logprobs
from longstraw.ops.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from longstraw.segment import PrefixView, Segment
from longstraw.state import AttentionState, RecurrentState
from tests.conftest import state_tensors


def reference_gated_delta(q, k, v, g, beta, initial_state=None):
    """float64 step-by-step gated delta rule. Returns (o [B,T,Hv,dv], final state [B,Hv,dk,dv])."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * dk**-0.5
    q = q.repeat_interleave(hv // hk, dim=2)
    k = k.repeat_interleave(hv // hk, dim=2)
    outs = []
    finals = []
    for bi in range(b):
        heads_o, heads_s = [], []
        for h in range(hv):
            s = torch.zeros(dk, dv, dtype=torch.float64) if initial_state is None else initial_state[bi, h].double()
            o_h = []
            for i in range(t):
                s = torch.exp(g[bi, i, h]) * s
                kt = k[bi, i, h]
                pred = s.T @ kt  # [dv]: what the state predicts for this key
                s = s + torch.outer(kt, beta[bi, i, h] * (v[bi, i, h] - pred))
                o_h.append(s.T @ q[bi, i, h])
            heads_o.append(torch.stack(o_h))  # [T, dv]
            heads_s.append(s)
        outs.append(torch.stack(heads_o, dim=1))  # [T, Hv, dv]
        finals.append(torch.stack(heads_s))  # [Hv, dk, dv]
    return torch.stack(outs), torch.stack(finals)


def make_inputs(b, t, hk, hv, dk, dv, with_state, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hk, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(b, t, hk, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(b, t, hv, dv, generator=gen, dtype=torch.float64)
    # negative log-decays of moderate size: the state still carries information across chunks
    g = -F.softplus(torch.randn(b, t, hv, generator=gen, dtype=torch.float64) - 1.0)
    beta = torch.sigmoid(torch.randn(b, t, hv, generator=gen, dtype=torch.float64))
    s0 = torch.randn(b, hv, dk, dv, generator=gen, dtype=torch.float64) if with_state else None
    inputs = [q, k, v, g, beta]
    return [x.to(dtype) for x in inputs], (None if s0 is None else s0.to(dtype))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def functional(o, s, wo, ws):
    """A random linear functional of (output, final state)."""
    return (o.double() * wo).sum() + (s.double() * ws).sum()


def grads_of(fn, inputs, s0, wo, ws):
    """Outputs and gradients of functional(fn(...)) w.r.t. q, k, v, g, beta and (if given) the initial state."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    s_leaf = None if s0 is None else s0.detach().clone().requires_grad_(True)
    o, s = fn(*leaves, s_leaf)
    wrt = leaves + ([s_leaf] if s_leaf is not None else [])
    grads = torch.autograd.grad(functional(o, s, wo, ws), wrt)
    return o.detach(), s.detach(), grads


SHAPES = [(2, 2), (2, 4)]  # (Hk, Hv): plain and grouped (each key head serves 2 value heads)
B, DK, DV = 2, 8, 6


@pytest.mark.parametrize("t", [1, 7, 64, 130])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("hk,hv", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_reference_fp32(t, chunk, hk, hv, with_state):
    inputs, s0 = make_inputs(B, t, hk, hv, DK, DV, with_state)
    o, s = chunk_gated_delta_rule(*inputs, initial_state=s0, chunk_size=chunk)
    assert o.shape == (B, t, hv, DV) and o.dtype == torch.float32
    assert s.shape == (B, hv, DK, DV) and s.dtype == torch.float32
    o_ref, s_ref = reference_gated_delta(*inputs, s0)
    assert rel(o, o_ref) <= 1e-4
    assert rel(s, s_ref) <= 1e-4
    o_rec, s_rec = recurrent_gated_delta_rule(*inputs, initial_state=s0)
    assert rel(o_rec, o_ref) <= 1e-4
    assert rel(s_rec, s_ref) <= 1e-4
    # the comparison is meaningful: the outputs are not all tiny
    assert float(o_ref.abs().max()) > 1e-2


@pytest.mark.parametrize("t", [1, 7, 64, 130])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("hk,hv", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_outputs_and_gradients_fp64(t, chunk, hk, hv, with_state):
    inputs, s0 = make_inputs(B, t, hk, hv, DK, DV, with_state, dtype=torch.float64, seed=1)
    gen = torch.Generator().manual_seed(7)
    wo = torch.randn(B, t, hv, DV, generator=gen, dtype=torch.float64)
    ws = torch.randn(B, hv, DK, DV, generator=gen, dtype=torch.float64)
    o_ref, s_ref, g_ref = grads_of(lambda *a: reference_gated_delta(*a[:5], a[5]), inputs, s0, wo, ws)

    def chunked(*a):
        return chunk_gated_delta_rule(*a[:5], initial_state=a[5], chunk_size=chunk)

    def recurrent(*a):
        return recurrent_gated_delta_rule(*a[:5], initial_state=a[5])

    for fn in (chunked, recurrent):
        o, s, g = grads_of(fn, inputs, s0, wo, ws)
        assert o.dtype == s.dtype == torch.float64
        assert rel(o, o_ref) <= 1e-10
        assert rel(s, s_ref) <= 1e-10
        names = ["q", "k", "v", "g", "beta", "initial_state"]
        assert len(g) == len(g_ref) == (6 if with_state else 5)
        for name, got, want in zip(names, g, g_ref):
            if name == "g" and t == 1 and not with_state:
                # one token on a zero state: the decay multiplies nothing
                assert float(want.abs().max()) == 0 and float(got.abs().max()) <= 1e-14
                continue
            assert float(want.abs().max()) > 0, name
            assert rel(got, want) <= 1e-9, (fn.__name__, name, rel(got, want))


@pytest.mark.parametrize("hk,hv", SHAPES)
def test_fp32_gradients_close_to_fp64_reference(hk, hv):
    t = 100
    inputs, s0 = make_inputs(B, t, hk, hv, DK, DV, True, seed=2)
    gen = torch.Generator().manual_seed(8)
    wo = torch.randn(B, t, hv, DV, generator=gen, dtype=torch.float64)
    ws = torch.randn(B, hv, DK, DV, generator=gen, dtype=torch.float64)
    inputs64 = [x.double() for x in inputs]
    _, _, g_ref = grads_of(lambda *a: reference_gated_delta(*a[:5], a[5]), inputs64, s0.double(), wo, ws)
    _, _, g = grads_of(lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5], chunk_size=32), inputs, s0, wo, ws)
    for name, got, want in zip(["q", "k", "v", "g", "beta", "initial_state"], g, g_ref):
        assert got.dtype == torch.float32, name
        assert rel(got, want) <= 1e-4, (name, rel(got, want))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("t1", [1, 37, 64])
def test_chaining_equals_one_pass(dtype, tol, t1):
    """Running T tokens at once == running T1 tokens, then the rest from the first call's final state;
    gradients w.r.t. the first segment's inputs flow through the chained state."""
    t, hk, hv, chunk = 100, 2, 4, 16
    inputs, s0 = make_inputs(B, t, hk, hv, DK, DV, True, dtype=dtype, seed=3)
    gen = torch.Generator().manual_seed(9)
    wo = torch.randn(B, t, hv, DV, generator=gen, dtype=torch.float64)
    ws = torch.randn(B, hv, DK, DV, generator=gen, dtype=torch.float64)

    def once(*a):
        return chunk_gated_delta_rule(*a[:5], initial_state=a[5], chunk_size=chunk)

    def chained(*a):
        o1, s1 = chunk_gated_delta_rule(*(x[:, :t1] for x in a[:5]), initial_state=a[5], chunk_size=chunk)
        o2, s2 = chunk_gated_delta_rule(*(x[:, t1:] for x in a[:5]), initial_state=s1, chunk_size=chunk)
        return torch.cat([o1, o2], dim=1), s2

    o, s, g = grads_of(once, inputs, s0, wo, ws)
    o_c, s_c, g_c = grads_of(chained, inputs, s0, wo, ws)
    assert rel(o_c, o) <= tol
    assert rel(s_c, s) <= tol
    for name, got, want in zip(["q", "k", "v", "g", "beta", "initial_state"], g_c, g):
        assert float(want.abs().max()) > 0, name
        assert rel(got, want) <= tol, (name, rel(got, want))
    if dtype == torch.float64:
        # ... and they do reach it: dropping the chained state's graph changes the first segment's gradients
        def cut(*a):
            o1, s1 = chunk_gated_delta_rule(*(x[:, :t1] for x in a[:5]), initial_state=a[5], chunk_size=chunk)
            o2, s2 = chunk_gated_delta_rule(*(x[:, t1:] for x in a[:5]), initial_state=s1.detach(), chunk_size=chunk)
            return torch.cat([o1, o2], dim=1), s2

        _, _, g_cut = grads_of(cut, inputs, s0, wo, ws)
        assert rel(g_cut[2][:, :t1], g[2][:, :t1]) > 1e-3


@pytest.mark.parametrize("chunk", [2, 64])
def test_gradcheck_small(chunk):
    """Finite differences in float64 w.r.t. every input, the initial state included."""
    inputs, s0 = make_inputs(1, 5, 1, 2, 3, 3, True, dtype=torch.float64, seed=4)
    leaves = [x.clone().requires_grad_(True) for x in inputs] + [s0.clone().requires_grad_(True)]

    def fn(q, k, v, g, beta, s):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s, chunk_size=chunk)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)

    # initial state and v alone, the others held fixed
    def fn_sv(v, s):
        return chunk_gated_delta_rule(inputs[0], inputs[1], v, inputs[3], inputs[4], initial_state=s, chunk_size=chunk)

    assert torch.autograd.gradcheck(fn_sv, (leaves[2], leaves[5]), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_zero_initial_state_equals_none():
    inputs, _ = make_inputs(B, 20, 2, 4, DK, DV, False, seed=5)
    o, s = chunk_gated_delta_rule(*inputs, chunk_size=16)
    o0, s0 = chunk_gated_delta_rule(*inputs, initial_state=torch.zeros(B, 4, DK, DV), chunk_size=16)
    assert torch.allclose(o, o0, atol=1e-6) and torch.allclose(s, s0, atol=1e-6)


def test_bf16_inputs_keep_fp32_state():
    inputs, s0 = make_inputs(B, 70, 2, 4, DK, DV, True, seed=6)
    o, s = chunk_gated_delta_rule(*(x.bfloat16() for x in inputs[:3]), *inputs[3:], initial_state=s0, chunk_size=64)
    assert o.dtype == torch.bfloat16
    assert s.dtype == torch.float32
    o_ref, s_ref = reference_gated_delta(*(x.bfloat16() for x in inputs[:3]), *inputs[3:], s0)
    assert rel(o, o_ref) <= 2e-2
    assert rel(s, s_ref) <= 1e-4  # only the inputs were rounded; the state is accumulated in fp32


# --- model level: the gradient w.r.t. a linear layer's prefix state -------------------------------------------------

QWEN35_TINY = dict(
    model_type="qwen3_5_text",
    vocab_size=53,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=4,
    linear_value_head_dim=4,
    linear_conv_kernel_dim=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def fp64_model_and_state():
    torch.manual_seed(0)
    model = ls.build_model(QWEN35_TINY, dtype=torch.float64)
    with torch.no_grad():  # O(1) weights so the prefix state really moves the log-probs
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            elif "A_log" in name:
                p.copy_(torch.randn_like(p) * 0.5 - 1.0)
            else:
                p.add_(0.2 * torch.randn_like(p))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 53, (40,), generator=gen)
    state = ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=16))
    response = torch.randint(0, 53, (6,), generator=gen)
    return model, state, response


@pytest.mark.parametrize("layer", [0, 2])
def test_model_prefix_state_gradient(fp64_model_and_state, layer):
    model, state, response = fp64_model_and_state
    assert isinstance(state.layers[layer], RecurrentState)
    assert isinstance(state.layers[1], AttentionState)
    base = state.layers[layer]
    assert base.ssm.dtype == torch.float64 and base.conv.dtype == torch.float64
    snapshot = state_tensors(state)

    def logp_sum(conv, ssm):
        prefix = list(state.layers)
        prefix[layer] = RecurrentState(conv, ssm)
        return replay_logprobs(model, state, [response], prefix=prefix)[0].sum()

    # autograd through a leaf prefix state (the way exact mode passes recurrent states)
    leaf = base.leaf()
    prefix = list(state.layers)
    prefix[layer] = leaf
    loss = replay_logprobs(model, state, [response], prefix=prefix)[0].sum()
    loss.backward()
    grads = leaf.leaf_grad()
    assert float(grads.ssm.abs().max()) > 1e-6
    assert float(grads.conv.abs().max()) > 1e-6
    model.zero_grad(set_to_none=True)

    # same thing through a Segment directly
    leaf2 = base.leaf()
    prefix2 = list(state.layers)
    prefix2[layer] = leaf2
    ids = torch.cat([state.prompt_ids[-1:], response[:-1]])[None]
    seg = Segment(start=state.length, prefix=PrefixView(prefix2, state.length))
    lp = torch.log_softmax(model(ids, seg), -1).gather(-1, response[None, :, None]).sum()
    lp.backward()
    assert torch.allclose(leaf2.ssm.grad, grads.ssm, rtol=1e-10, atol=1e-14)
    model.zero_grad(set_to_none=True)

    # central finite differences along random directions
    gen = torch.Generator().manual_seed(layer)
    eps = 1e-5
    with torch.no_grad():
        for _ in range(3):
            d_ssm = torch.randn(base.ssm.shape, generator=gen, dtype=torch.float64)
            d_conv = torch.randn(base.conv.shape, generator=gen, dtype=torch.float64)
            for d_c, d_s in ((0 * d_conv, d_ssm), (d_conv, 0 * d_ssm)):
                fd = (logp_sum(base.conv + eps * d_c, base.ssm + eps * d_s)
                      - logp_sum(base.conv - eps * d_c, base.ssm - eps * d_s)) / (2 * eps)
                an = (grads.ssm * d_s).sum() + (grads.conv * d_c).sum()
                assert abs(float(fd - an)) <= 1e-6 * max(1.0, abs(float(an))), (float(fd), float(an))

    # full Jacobian check w.r.t. the ssm state
    ssm = base.ssm.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s: logp_sum(base.conv, s), (ssm,), eps=1e-6, atol=1e-7, rtol=1e-5)

    # the state itself was only read
    assert all(torch.equal(a, b) for a, b in zip(snapshot, state_tensors(state)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and flash-linear-attention)")
def test_cuda_kernel_equals_the_reference_with_initial_state_gradient(monkeypatch):
    """gated_delta_rule on CUDA (flash-linear-attention's chunk kernel) against the torch reference on CPU:
    outputs, final state and the gradients of all inputs, the initial state's (dh0) included. Where FLA refuses its
    backward on this machine (`fla_backward_refused`), the gradients come from the torch rule on CUDA instead and
    only the forward without autograd is FLA's: the test checks that each took the path it says."""
    from longstraw.ops import gated_delta
    from longstraw.ops.gated_delta import _fla_kernel, fla_backward_refused, gated_delta_rule

    if _fla_kernel() is None:  # on a GPU the kernels are the path under test: missing is a failure, not a skip
        pytest.fail("CUDA is available but flash-linear-attention is not installed: pip install -e '.[gpu]'")
    calls = []  # the FLA kernels the dispatch ran, by name
    monkeypatch.setattr(gated_delta, "_fla_kernel", lambda name="chunk_gated_delta_rule": (
        lambda *a, **kw: calls.append(name) or _fla_kernel(name)(*a, **kw)))
    torch.manual_seed(0)
    b, t, hk, hv, dk, dv = 1, 100, 2, 4, 64, 64
    inputs = [torch.randn(b, t, hk, dk), torch.randn(b, t, hk, dk), torch.randn(b, t, hv, dv),
              -torch.rand(b, t, hv), torch.rand(b, t, hv), torch.randn(b, hv, dk, dv)]

    def run(device, fn):
        xs = [x.to(device).requires_grad_() for x in inputs]
        o, final = fn(*xs[:5], initial_state=xs[5])
        (o.float().square().sum() + final.float().square().sum()).backward()
        return [t.detach().float().cpu() for t in (o, final, *(x.grad for x in xs))]

    def close(a, want):
        return float((a - want).abs().max()) <= 2e-3 * max(1.0, float(want.abs().max()))

    want = run("cpu", chunk_gated_delta_rule)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the refusal's warning: asserted in test_fla_backward_refused
        got = run("cuda", gated_delta_rule)
    assert len(calls) == (0 if fla_backward_refused() else 1), (calls, fla_backward_refused())
    assert all(close(a, w) for a, w in zip(got, want, strict=True))
    with torch.no_grad():
        o, final = gated_delta_rule(*(x.cuda() for x in inputs[:5]), initial_state=inputs[5].cuda())
    assert calls == ["chunk_gated_delta_rule"] * (1 if fla_backward_refused() else 2)  # no grad: always FLA's
    assert close(o.float().cpu(), want[0]) and close(final.float().cpu(), want[1])


@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
def test_one_token_step_equals_the_reference_with_gradients(hk, hv):
    """The dispatch's single-token path (decode steps, 1-token replays): outputs, final state and every input's
    gradient, the initial state's included, equal the independent float64 reference."""
    from longstraw.ops.gated_delta import gated_delta_rule

    torch.manual_seed(1)
    b, dk, dv = 3, 8, 8
    xs = [torch.randn(b, 1, hk, dk, dtype=torch.float64), torch.randn(b, 1, hk, dk, dtype=torch.float64),
          torch.randn(b, 1, hv, dv, dtype=torch.float64), -torch.rand(b, 1, hv, dtype=torch.float64),
          torch.rand(b, 1, hv, dtype=torch.float64), torch.randn(b, hv, dk, dv, dtype=torch.float64)]

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in xs]
        o, final = fn(*leaves[:5], initial_state=leaves[5])
        (o.square().sum() + final.square().sum()).backward()
        return [o, final, *(x.grad for x in leaves)]

    for got, want in zip(run(gated_delta_rule), run(reference_gated_delta), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        o, final = gated_delta_rule(*xs[:5], initial_state=xs[5])
    torch.testing.assert_close(o, reference_gated_delta(*xs[:5], initial_state=xs[5])[0], rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and flash-linear-attention)")
def test_cuda_decode_step_equals_the_reference():
    """A decode step on CUDA (flash-linear-attention's fused recurrent kernel, no autograd) against the torch
    rule on CPU, with grouped value heads and an initial state."""
    from longstraw.ops.gated_delta import _fla_kernel, gated_delta_rule

    if _fla_kernel("fused_recurrent_gated_delta_rule") is None:  # as above: a failure on a GPU, not a skip
        pytest.fail("CUDA is available but flash-linear-attention is not installed: pip install -e '.[gpu]'")
    torch.manual_seed(0)
    b, hk, hv, dk, dv = 8, 2, 4, 128, 128
    xs = [torch.randn(b, 1, hk, dk), torch.randn(b, 1, hk, dk), torch.randn(b, 1, hv, dv), -torch.rand(b, 1, hv),
          torch.rand(b, 1, hv), torch.randn(b, hv, dk, dv)]
    with torch.no_grad():
        got = gated_delta_rule(*(x.cuda() for x in xs[:5]), initial_state=xs[5].cuda())
        want = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5])
    for a, w in zip(got, want):
        assert float((a.float().cpu() - w).abs().max()) <= 2e-3 * max(1.0, float(w.abs().max()))
