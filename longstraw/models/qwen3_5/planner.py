"""Qwen3.5's planner profile: Gated DeltaNet and gated full-attention layers (`layer_types`), per-head attention."""

from __future__ import annotations

from ..planner import FamilyPlanner, HeadAttention
from .config import Qwen35Config, text_config


class Qwen35Planner(FamilyPlanner):
    def layer_kinds(self, cfg: Qwen35Config) -> tuple[str, ...]:
        return cfg.layer_types

    def proxy_config(self, hf_config: dict, kind: str, layers: int) -> dict:
        # the text model alone: a multimodal config's text part
        return {**text_config(hf_config), "model_type": "qwen3_5_text", "num_hidden_layers": layers,
                "layer_types": [kind] * layers}

    def attention(self, cfg: Qwen35Config) -> HeadAttention:
        return HeadAttention(cfg.num_attention_heads, cfg.head_dim)
