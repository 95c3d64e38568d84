"""Grouped-query self-attention (Llama/Qwen2/Qwen3) that runs on a segment, optionally over a prefix state."""

from __future__ import annotations

import torch
from torch import nn

from ...ops.attention import segment_attention
from ...state import Segment
from .norm import RMSNorm
from .rope import apply_rotary


class Attention(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.layer_idx, self.heads, self.kv_heads, self.head_dim = layer_idx, heads, kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)

    def _project(self, x: torch.Tensor, rope, with_q: bool = True):
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(self, "k_norm"):
            k = self.k_norm(k)
        k = apply_rotary(k.transpose(1, 2), *rope)
        if not with_q:
            return None, k, v
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        return apply_rotary(q.transpose(1, 2), *rope), k, v

    def emit_kv(self, x: torch.Tensor, rope, seg: Segment) -> None:
        """Only compute and hand over this segment's K/V (the capture of the last layer needs nothing else)."""
        _, k, v = self._project(x, rope, with_q=False)
        seg.emit(self.layer_idx, k, v)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], seg: Segment) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self._project(x, rope)
        seg.emit(self.layer_idx, k, v)
        out = segment_attention(
            q, k, v, self.scale, prefix=seg.prefix_kv(self.layer_idx), prefix_grad=seg.prefix_grad(self.layer_idx)
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
