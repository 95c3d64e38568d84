"""The RMSNorm variants of the families; one normalisation body, `rms_normalize`."""

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed (and returned) in at least fp32."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm as in Llama/Qwen: statistics in at least fp32, weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps).to(x.dtype)


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3.5's RMSNorm: weight stored as an offset from 1, applied in fp32: (x / rms(x)) * (1 + w)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_normalize(x, self.eps)
        return (h * (1.0 + self.weight.to(h.dtype))).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm of the delta-rule output, then multiplied by silu(gate) (Qwen3.5 linear layers)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        return (super().forward(x) * torch.nn.functional.silu(gate.to(acc))).to(x.dtype)
