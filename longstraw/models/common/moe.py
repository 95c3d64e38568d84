"""Mixture of experts with a sigmoid router (GLM-5 / DeepSeek-V3): group-limited top-k, score-correction bias,
normalised top-k weights, routed scaling, plus shared experts.

The experts run as grouped matrix products (`torch._grouped_mm`): the (token, expert) pairs sorted by expert, each
expert's rows a contiguous block whose end offsets stay on the device, so routing never waits for the host (a loop
over the experts hit needs their row counts on the host: one sync per MoE layer per forward, which stalls a GPU).
`_grouped_mm` wants 16-byte-aligned rows. Its CUDA kernel takes bf16 only, and so does the meta function that
torch.compile traces with; the CPU kernel also takes fp32 and fp16. Other cases (fp32 on a GPU or under compile, fp64
tests, odd sizes) take the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ...parallel.experts import FusedExperts
from .mlp import SwiGLU

if TYPE_CHECKING:
    from ...segment import Segment


class TopkRouter(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int, groups: int, topk_groups: int, norm_topk: bool,
                 scaling: float) -> None:
        super().__init__()
        self.top_k, self.experts, self.groups, self.topk_groups = top_k, experts, groups, topk_groups
        self.norm_topk, self.scaling = norm_topk, scaling
        self.weight = nn.Parameter(torch.zeros(experts, hidden, dtype=torch.float32))
        # only shifts which experts are chosen, never their weights; updated by load balancing, not by gradient
        self.register_buffer("e_score_correction_bias", torch.zeros(experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, route: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, top_k] with autograd, expert indices [N, top_k]). `route(chosen)`, if
        given, turns the router's choice into the experts taken (routing replay); the weights are the router's
        scores at those, normalised as usual, so the router still gets its gradient."""
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
            if route is not None:
                idx = route(idx)
        w = scores.gather(1, idx)
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scaling, idx


def grouped_mm_takes(device_type: str, dtype: torch.dtype, compiling: bool) -> bool:
    """Whether `torch._grouped_mm` takes `dtype` on this device (under torch.compile, what its meta function takes)."""
    if device_type == "cpu" and not compiling:
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    return dtype == torch.bfloat16


class Experts(FusedExperts):
    """Experts fused as transformers stores them: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].

    Expert-parallel (`ep`, set by longstraw/parallel/experts.py under ZeRO-2/3): the parameters are this rank's
    experts' shard, and the (token, expert) rows travel to the rank owning their expert and back."""

    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, intermediate))
        self.ep = None

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [N, hidden], idx / w [N, top_k] -> sum over each token's experts of w x expert(x)."""
        # stable: a token's pairs keep their order, so sums are reproducible
        experts, order = idx.reshape(-1).sort(stable=True)
        token = order // idx.shape[1]
        if self.ep is None:
            y = self._sorted(x[token], experts, self.gate_up_proj, self.down_proj)
        else:
            gate_up, down = self.ep.weights(self)
            y = self.ep.route(x[token], experts, lambda rows, ids: self._sorted(rows, ids, gate_up, down))
        y = y * w.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add(0, token, y)

    def _sorted(self, rows: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
                ) -> torch.Tensor:
        """Each row through its expert: `rows` [M, hidden] sorted by `experts` [M], ids into `gate_up` / `down`."""
        if groupable(rows, gate_up, down):
            return grouped_experts(rows, experts, gate_up, down)
        return looped_experts(rows, experts, gate_up, down)


def groupable(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `grouped_experts` takes these rows and weights here (dtype, device, 16-byte-aligned sizes)."""
    align = 16 // rows.element_size()
    sizes = (rows.shape[-1], down.shape[-1])
    return (grouped_mm_takes(rows.device.type, rows.dtype, torch.compiler.is_compiling())
            and gate_up.dtype == rows.dtype and all(n % align == 0 for n in sizes)
            and rows.shape[0] > 0)  # its backward fails on no rows


def grouped_experts(rows: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
                    ) -> torch.Tensor:
    """`Experts._sorted` as two grouped products, each expert's rows a block (no host sync)."""
    # each expert's end row: a fixed-size result (bincount's size would depend on the data under compile)
    every = torch.arange(gate_up.shape[0], device=experts.device, dtype=experts.dtype)
    ends = torch.searchsorted(experts, every, right=True).to(torch.int32)
    gate, up = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    return torch._grouped_mm((F.silu(gate) * up).contiguous(), down.transpose(1, 2), offs=ends)


def looped_experts(rows: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
                   ) -> torch.Tensor:
    """`Experts._sorted` as one product per expert hit (the row counts go to the host)."""
    counts = torch.bincount(experts, minlength=gate_up.shape[0]).tolist()
    blocks = rows.split(counts)
    # with no rows at all, one empty product still ties the result to `rows` (expert parallelism's backward
    # all-to-all runs on every rank only if every rank's graph reaches it)
    hits = [e for e, n in enumerate(counts) if n] or [0]
    out = []
    for e in hits:
        gate, up = F.linear(blocks[e], gate_up[e]).chunk(2, dim=-1)
        out.append(F.linear(F.silu(gate) * up, down[e]))
    return torch.cat(out)


class MoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, experts: int, shared: int, top_k: int, groups: int,
                 topk_groups: int, norm_topk: bool, scaling: float) -> None:
        super().__init__()
        self.experts = Experts(experts, hidden, intermediate)
        self.gate = TopkRouter(hidden, experts, top_k, groups, topk_groups, norm_topk, scaling)
        self.shared_experts = SwiGLU(hidden, intermediate * shared)
        # recomputed whole under per-layer checkpointing: tiles would multiply the expert-parallel all-to-alls
        self.recompute_tiles = 1

    def forward(self, x: torch.Tensor, seg: Segment | None = None, layer: int | None = None) -> torch.Tensor:
        """x [B, T, hidden]; with `seg`, the tokens go to the experts `seg.route(layer, ...)` gives (replayed or
        recorded routing, segment/core.py)."""
        flat = x.reshape(-1, x.shape[-1])
        stored = expert_id_dtype(self.gate.experts)  # what a recording keeps: GLM-5's ids in uint8
        route = None if seg is None else \
            lambda chosen: seg.route(layer, chosen.view(*x.shape[:-1], -1), stored).reshape(chosen.shape)
        w, idx = self.gate(flat, route)
        return self.experts(flat, idx, w).view_as(x) + self.shared_experts(x)


def expert_id_dtype(experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds the ids of `experts` experts (stored routing: GLM-5's 256 in uint8)."""
    if experts <= 256:
        return torch.uint8
    return torch.int16 if experts <= 2**15 else torch.int32


def moe_layers(model: nn.Module) -> dict[int, TopkRouter]:
    """The router of each MoE layer of a `CausalLM`, by decoder-layer index (none for a dense model)."""
    return {i: layer.mlp.gate for i, layer in enumerate(model.decoder_layers) if isinstance(layer.mlp, MoE)}
