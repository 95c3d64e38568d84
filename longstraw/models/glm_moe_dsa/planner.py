"""GLM-5's planner profile: dense and MoE layers (`mlp_layer_types`), MLA with DSA's top-k selection."""

from __future__ import annotations

from ..planner import FamilyPlanner, LatentSparseAttention
from .config import GlmMoeDsaConfig


class GlmMoeDsaPlanner(FamilyPlanner):
    def layer_kinds(self, cfg: GlmMoeDsaConfig) -> tuple[str, ...]:
        return cfg.mlp_layer_types

    def proxy_config(self, hf_config: dict, kind: str, layers: int) -> dict:
        # a token's activations depend on the experts it uses, not on how many there are; every proxy layer has
        # an indexer (a config's first layer must): an upper bound for the layers that share a selection
        return {**hf_config, "num_hidden_layers": layers, "mlp_layer_types": [kind] * layers,
                "indexer_types": ["full"] * layers, "n_routed_experts": hf_config["num_experts_per_tok"],
                "n_group": 1, "topk_group": 1}

    def attention(self, cfg: GlmMoeDsaConfig) -> LatentSparseAttention:
        return LatentSparseAttention(cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                     cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk)
