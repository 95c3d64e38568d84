"""The experts' two paths (sorted by expert; `torch._grouped_mm` with no host sync, or one product per expert hit)
against a per-expert reference written here as transformers loops: same output and gradients, experts that get no
token included."""

from __future__ import annotations

import pytest
import torch

import torch.nn.functional as F

from longstraw.models.common.moe import Experts, grouped_experts, groupable, grouped_mm_takes


def _experts(dtype: torch.dtype) -> Experts:
    torch.manual_seed(0)
    e = Experts(experts=6, hidden=32, intermediate=16)
    with torch.no_grad():
        for p in e.parameters():
            p.normal_(0, 0.1)
    return e.to(dtype)


def _reference(e: Experts, x, idx, w):
    """Each expert over the tokens that chose it, by mask (no sorting), as transformers' eager experts loop."""
    out = torch.zeros_like(x)
    for k in range(e.gate_up_proj.shape[0]):
        token, slot = (idx == k).nonzero(as_tuple=True)
        gate, up = F.linear(x[token], e.gate_up_proj[k]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, e.down_proj[k]) * w[token, slot, None].to(x.dtype)
        out = out.index_add(0, token, y)
    return out


def _run(e: Experts, fn, x, idx, w):
    e.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    out = fn(x, idx, w)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
    return out.detach(), x.grad, w.grad, e.gate_up_proj.grad, e.down_proj.grad


@pytest.mark.parametrize("dtype,tol,grouped", [(torch.float32, 1e-5, True), (torch.bfloat16, 3e-2, True),
                                                (torch.float64, 1e-12, False)])
def test_experts_equal_the_reference(dtype, tol, grouped):
    e = _experts(dtype)
    x = torch.randn(11, 32, dtype=dtype)
    idx = torch.randint(0, 5, (11, 2))  # expert 5 gets no token
    idx[:, 1] = (idx[:, 0] + 1) % 5
    w = torch.rand(11, 2, dtype=torch.float32)
    assert groupable(x, e.gate_up_proj, e.down_proj) == grouped
    got, want = _run(e, e, x, idx, w), _run(e, lambda *a: _reference(e, *a), x, idx, w)
    for a, b in zip(got, want):
        assert float((a.float() - b.float()).abs().max()) <= tol * max(1.0, float(b.float().abs().max()))
    assert float(got[3][5].abs().max()) == 0.0  # the idle expert gets no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_tokens_still_reach_the_rows(dtype):
    """A rank with no rows (expert parallelism) still has a graph from its output to its rows."""
    e = _experts(dtype)
    x = torch.randn(0, 32, dtype=dtype, requires_grad=True)
    out = e._sorted(x, torch.zeros(0, dtype=torch.long), e.gate_up_proj, e.down_proj)
    assert out.shape == (0, 32) and out.grad_fn is not None
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 32)


def test_fp64_and_unaligned_sizes_take_the_loop():
    e = _experts(torch.float64)
    assert not groupable(torch.randn(3, 32, dtype=torch.float64), e.gate_up_proj, e.down_proj)
    odd = Experts(experts=2, hidden=6, intermediate=4)
    assert not groupable(torch.randn(3, 6), odd.gate_up_proj, odd.down_proj)


@pytest.mark.parametrize("device,dtype,compiling,grouped", [
    ("cpu", torch.float32, False, True),
    ("cpu", torch.bfloat16, False, True),
    ("cpu", torch.float32, True, False),  # torch.compile's meta function for _grouped_mm takes bf16 only
    ("cpu", torch.bfloat16, True, True),
    ("cuda", torch.float32, False, False),  # the CUDA kernel takes bf16 only
    ("cuda", torch.bfloat16, False, True),
    ("cuda", torch.float16, True, False),
])
def test_grouped_mm_dtypes_per_device(device, dtype, compiling, grouped):
    assert grouped_mm_takes(device, dtype, compiling) == grouped


def test_the_refused_case_really_fails_under_compile():
    """What the rule above encodes: tracing fp32 `_grouped_mm` fails, the loop it falls back to does not."""
    e = _experts(torch.float32)
    x, idx, w = torch.randn(4, 32), torch.tensor([[0, 1]] * 4), torch.rand(4, 2)
    rows, experts = x.repeat_interleave(2, 0), idx.reshape(-1).sort().values
    with pytest.raises(Exception, match="BF16"):
        torch.compile(grouped_experts, backend="eager", fullgraph=True)(rows, experts, e.gate_up_proj, e.down_proj)
    torch.testing.assert_close(torch.compile(e, backend="eager")(x, idx, w), _reference(e, x, idx, w))
