"""Mixture of experts with a sigmoid router (GLM-5 / DeepSeek-V3): group-limited top-k, score-correction bias,
normalised top-k weights, routed scaling, plus shared experts.

The experts run as grouped matrix products (`torch._grouped_mm`): the (token, expert) pairs sorted by expert, each
expert's rows a contiguous block whose end offsets stay on the device, so routing never waits for the host (a loop
over the experts hit needs their ids on the host: one sync per MoE layer per forward, which stalls a GPU).
`_grouped_mm` wants 16-byte-aligned rows. Its CUDA kernel takes bf16 only, and so does the meta function that
torch.compile traces with; the CPU kernel also takes fp32 and fp16. Other cases (fp32 on a GPU or under compile, fp64
tests, odd sizes) take the loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mlp import SwiGLU


class TopkRouter(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int, groups: int, topk_groups: int, norm_topk: bool,
                 scaling: float) -> None:
        super().__init__()
        self.top_k, self.experts, self.groups, self.topk_groups = top_k, experts, groups, topk_groups
        self.norm_topk, self.scaling = norm_topk, scaling
        self.weight = nn.Parameter(torch.zeros(experts, hidden, dtype=torch.float32))
        # only shifts which experts are chosen, never their weights; updated by load balancing, not by gradient
        self.register_buffer("e_score_correction_bias", torch.zeros(experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, top_k] with autograd, expert indices [N, top_k])."""
        acc = torch.promote_types(x.dtype, torch.float32)
        scores = F.linear(x.to(acc), self.weight.to(acc)).sigmoid()
        with torch.no_grad():
            choice = scores + self.e_score_correction_bias.to(acc)
            per_group = choice.view(-1, self.groups, self.experts // self.groups)
            group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
            best_groups = group_score.topk(self.topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best_groups, True)
            keep = keep[:, :, None].expand_as(per_group).reshape(-1, self.experts)
            idx = choice.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scaling, idx


def grouped_mm_takes(device_type: str, dtype: torch.dtype, compiling: bool) -> bool:
    """Whether `torch._grouped_mm` takes `dtype` on this device (under torch.compile, what its meta function takes)."""
    if device_type == "cpu" and not compiling:
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    return dtype == torch.bfloat16


class Experts(nn.Module):
    """Experts fused as transformers stores them: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [N, hidden], idx / w [N, top_k] -> sum over each token's experts of w x expert(x)."""
        if self._groupable(x):
            return self._grouped(x, idx, w)
        return self._looped(x, idx, w)

    def _groupable(self, x: torch.Tensor) -> bool:
        align = 16 // x.element_size()
        sizes = (x.shape[-1], self.down_proj.shape[-1])
        return (grouped_mm_takes(x.device.type, x.dtype, torch.compiler.is_compiling())
                and self.gate_up_proj.dtype == x.dtype and all(n % align == 0 for n in sizes))

    def _grouped(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # stable: a token's pairs keep their order, so sums are reproducible
        experts, order = idx.reshape(-1).sort(stable=True)
        token = order // idx.shape[1]
        # each expert's end row: a fixed-size result (bincount's size would depend on the data under compile)
        every = torch.arange(self.gate_up_proj.shape[0], device=idx.device, dtype=experts.dtype)
        ends = torch.searchsorted(experts, every, right=True).to(torch.int32)
        gate, up = torch._grouped_mm(x[token], self.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        y = torch._grouped_mm((F.silu(gate) * up).contiguous(), self.down_proj.transpose(1, 2), offs=ends)
        y = y * w.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add(0, token, y)

    def _looped(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The reference: one product per expert hit (their ids go to the host)."""
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            token, slot = (idx == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * w[token, slot, None].to(x.dtype)
            out = out.index_add(0, token, y)
        return out


class MoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, experts: int, shared: int, top_k: int, groups: int,
                 topk_groups: int, norm_topk: bool, scaling: float) -> None:
        super().__init__()
        self.experts = Experts(experts, hidden, intermediate)
        self.gate = TopkRouter(hidden, experts, top_k, groups, topk_groups, norm_topk, scaling)
        self.shared_experts = SwiGLU(hidden, intermediate * shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        w, idx = self.gate(flat)
        return self.experts(flat, idx, w).view_as(x) + self.shared_experts(x)
