"""Grouped-query self-attention (Llama/Qwen2/Qwen3, and Qwen3.5's gated variant) over a prefix state."""

from __future__ import annotations

import torch
from torch import nn

from ...segment import QueryTile, Segment, attend
from ...state import AttentionState
from .mixer import TokenMixer
from .rope import apply_rotary


def _heads(s: AttentionState) -> tuple[torch.Tensor, torch.Tensor]:
    return s.k, s.v


class Attention(TokenMixer):
    """q/k/v/o projections with HF names. `qk_norm`: a norm class applied per head to q and k (Qwen3);
    `gated`: q_proj packs [q | gate] per head and the output is multiplied by sigmoid(gate) (Qwen3.5)."""

    tiles_queries = True

    def __init__(
        self,
        layer_idx: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: type[nn.Module] | None = None,
        eps: float = 1e-6,
        gated: bool = False,
    ) -> None:
        super().__init__()
        self.layer_idx, self.heads, self.kv_heads, self.head_dim = layer_idx, heads, kv_heads, head_dim
        self.gated = gated
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, heads * head_dim * (2 if gated else 1), bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        if qk_norm is not None:
            self.q_norm = qk_norm(head_dim, eps)
            self.k_norm = qk_norm(head_dim, eps)

    @classmethod
    def from_config(cls, cfg, idx: int, *, o_bias: bool, qk_norm: type[nn.Module] | None, gated: bool = False
                    ) -> "Attention":
        """The attention of layer `idx` of a family config with GQA fields (heads, kv heads, head_dim)."""
        return cls(idx, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                   qkv_bias=cfg.attention_bias, o_bias=o_bias, qk_norm=qk_norm, eps=cfg.rms_norm_eps, gated=gated)

    def empty_state(self, tokens: int, dtype: torch.dtype, device: torch.device) -> AttentionState:
        shape = (self.kv_heads, tokens, self.head_dim)
        return AttentionState(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    def _kv(self, x: torch.Tensor, rope) -> AttentionState:
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if hasattr(self, "k_norm"):
            k = self.k_norm(k)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return AttentionState(apply_rotary(k.transpose(1, 2), *rope), v)

    def emit_state(self, x: torch.Tensor, rope, seg: Segment) -> None:
        seg.emit(self.layer_idx, self._kv(x, rope))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], seg: Segment) -> torch.Tensor:
        q, gate = self._queries(x, rope)
        kv = self._kv(x, rope)
        seg.emit(self.layer_idx, kv)
        out = attend(seg, self.layer_idx, q, seg.own_rows(self.layer_idx, kv), self.scale, _heads)
        return self._output(out, gate)

    def tile_forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], own: AttentionState,
                     tile: QueryTile, seg: Segment) -> torch.Tensor:
        """The output for a tile of the segment's tokens (x [B, t, hidden] and its rotary): `own` the tile's keys
        and values, the keys before it in `tile`; emits nothing (models/common/recompute.py)."""
        q, gate = self._queries(x, rope)
        return self._output(attend(seg, self.layer_idx, q, own, self.scale, _heads, tile), gate)

    def _queries(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q [B, H, T, d] after norm and rotary, and the output gate [B, T, H, d] (gated attention) or None."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, -1)
        gate = None
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        return apply_rotary(q.transpose(1, 2), *rope), gate

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(b, t, -1))
        return self.o_proj(out)
