"""The dense families' planner profile: one layer kind, per-head attention."""

from __future__ import annotations

from ..planner import FamilyPlanner, HeadAttention
from .config import DenseConfig


class DensePlanner(FamilyPlanner):
    def layer_kinds(self, cfg: DenseConfig) -> tuple[str, ...]:
        return ("decoder",) * cfg.num_hidden_layers

    def proxy_config(self, hf_config: dict, kind: str, layers: int) -> dict:
        out = {**hf_config, "num_hidden_layers": layers}
        if "layer_types" in hf_config:  # newer configs list every layer's (full) attention
            out["layer_types"] = ["full_attention"] * layers
        return out

    def attention(self, cfg: DenseConfig) -> HeadAttention:
        return HeadAttention(cfg.num_attention_heads, cfg.head_dim)
