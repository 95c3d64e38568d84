"""The experts' grouped path (sorted by expert, `torch._grouped_mm`, no host sync) against the per-expert loop it
replaces: same output and gradients, experts that get no token included."""

from __future__ import annotations

import pytest
import torch

from longstraw.models.common.moe import Experts, grouped_mm_takes


def _experts(dtype: torch.dtype) -> Experts:
    torch.manual_seed(0)
    e = Experts(experts=6, hidden=32, intermediate=16)
    with torch.no_grad():
        for p in e.parameters():
            p.normal_(0, 0.1)
    return e.to(dtype)


def _run(e: Experts, path: str, x, idx, w):
    e.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    out = getattr(e, path)(x, idx, w)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
    return out.detach(), x.grad, w.grad, e.gate_up_proj.grad, e.down_proj.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_grouped_experts_equal_the_loop(dtype, tol):
    e = _experts(dtype)
    x = torch.randn(11, 32, dtype=dtype)
    idx = torch.randint(0, 5, (11, 2))  # expert 5 gets no token
    idx[:, 1] = (idx[:, 0] + 1) % 5
    w = torch.rand(11, 2, dtype=torch.float32)
    assert e._groupable(x)
    got, want = _run(e, "_grouped", x, idx, w), _run(e, "_looped", x, idx, w)
    for a, b in zip(got, want):
        assert float((a.float() - b.float()).abs().max()) <= tol * max(1.0, float(b.float().abs().max()))
    assert float(got[3][5].abs().max()) == 0.0  # the idle expert gets no gradient


def test_fp64_and_unaligned_sizes_take_the_loop():
    e = _experts(torch.float64)
    assert not e._groupable(torch.randn(3, 32, dtype=torch.float64))
    odd = Experts(experts=2, hidden=6, intermediate=4)
    assert not odd._groupable(torch.randn(3, 6))


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
    with pytest.raises(Exception, match="BF16"):
        torch.compile(e._grouped, backend="eager", fullgraph=True)(x, idx, w)
    torch.testing.assert_close(torch.compile(e, backend="eager")(x, idx, w), e._looped(x, idx, w))
