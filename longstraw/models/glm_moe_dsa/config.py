"""Config of GLM-5 (`glm_moe_dsa`): MLA + DSA indexer attention in every layer, MoE after `first_k_dense_replace`."""

from __future__ import annotations

from dataclasses import dataclass

from ..common.rope import yarn_softmax_scale
from ..config import ModelConfig, require

# MLA, indexer and MoE shapes differ between checkpoints of the family: never defaulted
REQUIRED = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_topk",
            "index_head_dim", "index_n_heads", "moe_intermediate_size", "num_experts_per_tok")


@dataclass(frozen=True, kw_only=True)
class GlmMoeDsaConfig(ModelConfig):
    model_type: str = "glm_moe_dsa"
    moe_intermediate_size: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]

    @property
    def softmax_scale(self) -> float:
        return yarn_softmax_scale(self.qk_nope_head_dim + self.qk_rope_head_dim, self.rope)

    @classmethod
    def from_hf(cls, cfg: dict) -> "GlmMoeDsaConfig":
        common = cls.common(cfg, "glm_moe_dsa", REQUIRED, max_positions=202752, eps=1e-5)
        experts = cfg.get("n_routed_experts", cfg.get("num_experts"))
        if experts is None:
            require(cfg, "glm_moe_dsa", ["n_routed_experts"])
        n = cfg["num_hidden_layers"]
        n_dense = min(cfg.get("first_k_dense_replace", 3), n)
        mlp_types = tuple(cfg.get("mlp_layer_types") or ["dense"] * n_dense + ["sparse"] * (n - n_dense))
        indexer_types = cfg.get("indexer_types")
        if indexer_types is None:
            pattern = cfg.get("index_topk_pattern")
            if pattern is not None:
                indexer_types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else pattern
            else:  # transformers' schedule: a full indexer every `freq` layers from `offset` on, all full before
                freq, offset = max(cfg.get("index_topk_freq", 1), 1), cfg.get("index_skip_topk_offset", 2)
                indexer_types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
        indexer_types = tuple(indexer_types)
        if len(mlp_types) != n or set(mlp_types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must list {n} of dense/sparse")
        if len(indexer_types) != n or set(indexer_types) - {"full", "shared"} or indexer_types[0] != "full":
            raise ValueError(f"indexer_types must list {n} of full/shared, starting with full")
        if not cfg["q_lora_rank"]:
            raise ValueError("glm_moe_dsa needs q_lora_rank > 0 (the indexer reads the q LoRA residual)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"glm_moe_dsa hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
        if experts % cfg.get("n_group", 1):
            raise ValueError("n_routed_experts must be divisible by n_group")
        return cls(
            **common,
            **{k: cfg[k] for k in REQUIRED},
            n_routed_experts=experts,
            n_shared_experts=cfg.get("n_shared_experts", 1),
            n_group=cfg.get("n_group", 1),
            topk_group=cfg.get("topk_group", 1),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            mlp_layer_types=mlp_types,
            indexer_types=indexer_types,
            raw=cfg,
        )
