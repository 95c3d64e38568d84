import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm as in Llama/Qwen: statistics in at least fp32, weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: weight stored as an offset from 1, applied in fp32: (x / rms(x)) * (1 + w)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        h = x.to(acc)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(acc))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the delta-rule output, then multiplied by silu(gate) (Qwen3.5 linear layers)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        acc = torch.promote_types(dtype, torch.float32)
        h = x.to(acc)
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * torch.nn.functional.silu(gate.to(acc))).to(dtype)
