"""Gated DeltaNet token mixer (Qwen3.5 `linear_attn`): causal depthwise conv + gated delta rule, fixed-size state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...segment import Segment, conv_tail, delta_rule
from ...state import RecurrentState
from .mixer import TokenMixer
from .norm import GatedRMSNorm


class GatedDeltaNet(TokenMixer):
    def __init__(
        self,
        layer_idx: int,
        hidden: int,
        k_heads: int,
        v_heads: int,
        k_dim: int,
        v_dim: int,
        conv_kernel: int = 4,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.layer_idx, self.k_heads, self.v_heads, self.k_dim, self.v_dim = layer_idx, k_heads, v_heads, k_dim, v_dim
        self.conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        self.kernel = conv_kernel
        # registration order and names as in transformers' Qwen3_5GatedDeltaNet
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(v_heads).uniform_(1, 16)))
        self.norm = GatedRMSNorm(v_dim, eps)
        self.out_proj = nn.Linear(v_heads * v_dim, hidden, bias=False)
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, v_heads * v_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, v_heads, bias=False)

    def empty_state(self, tokens: int, dtype: torch.dtype, device: torch.device) -> RecurrentState:
        """The state before any token: zero conv inputs and a zero delta-rule state (fp32, fp64 for fp64)."""
        acc = torch.promote_types(dtype, torch.float32)
        return RecurrentState(
            torch.zeros(self.conv_dim, self.kernel - 1, dtype=dtype, device=device),
            torch.zeros(self.v_heads, self.k_dim, self.v_dim, dtype=acc, device=device),
        )

    def _recurrence(self, x: torch.Tensor, seg: Segment):
        b, t, _ = x.shape
        mixed = self.in_proj_qkv(x).transpose(1, 2)  # [B, conv_dim, T]
        tail, final_tail = conv_tail(seg, self.layer_idx, mixed, self.kernel - 1)
        padded = torch.cat([tail, mixed], dim=-1)
        conv = F.silu(F.conv1d(padded, self.conv1d.weight, groups=self.conv_dim)).transpose(1, 2)
        kd = self.k_heads * self.k_dim
        q, k, v = conv.split([kd, kd, self.v_heads * self.v_dim], dim=-1)
        q = q.reshape(b, t, self.k_heads, self.k_dim)
        k = k.reshape(b, t, self.k_heads, self.k_dim)
        v = v.reshape(b, t, self.v_heads, self.v_dim)
        beta = torch.sigmoid(self.in_proj_b(x))
        acc = torch.promote_types(x.dtype, torch.float32)
        g = -self.A_log.to(acc).exp() * F.softplus(self.in_proj_a(x).to(acc) + self.dt_bias)
        o, ssm = delta_rule(seg, self.layer_idx, q, k, v, g, beta)
        return o, RecurrentState(final_tail, ssm)

    def emit_state(self, x: torch.Tensor, rope, seg: Segment) -> None:
        seg.emit(self.layer_idx, self._recurrence(x, seg)[1])

    def forward(self, x: torch.Tensor, rope, seg: Segment) -> torch.Tensor:
        b, t, _ = x.shape
        o, final = self._recurrence(x, seg)
        seg.emit(self.layer_idx, final)
        z = self.in_proj_z(x).reshape(b, t, self.v_heads, self.v_dim)
        return self.out_proj(self.norm(o, z).reshape(b, t, -1))
