"""Attention K/V (GQA: Llama, Qwen3, Qwen3.5's gated attention)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .protocol import TokenState


@dataclass
class AttentionState(TokenState):
    """K (after norm and RoPE) and V, [kv_heads, N, head_dim]; as a segment emits them [B, kv_heads, T, head_dim]."""

    kind = "attention"
    label = "attention K/V"
    grad_fields = ("k", "v")

    k: torch.Tensor
    v: torch.Tensor
