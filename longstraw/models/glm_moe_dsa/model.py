"""GLM-5 (`glm_moe_dsa`): MLA with the DSA indexer in every layer, MoE MLPs after the first dense layers.

Parameter names follow transformers' `GlmMoeDsaForCausalLM` (experts fused; per-expert checkpoint keys are
stacked on load). The router weight, its correction bias and the indexer head weights stay fp32, as there.
"""

from __future__ import annotations

from ..common.decoder import CausalLM, DecoderLayer
from ..common.mla import MLAttention
from ..common.mlp import SwiGLU
from ..common.moe import MoE
from ..common.norm import RMSNorm
from .config import GlmMoeDsaConfig


class GlmDecoderLayer(DecoderLayer):
    def __init__(self, cfg: GlmMoeDsaConfig, idx: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(idx, cfg, has_indexer=cfg.indexer_types[idx] == "full")
        if cfg.mlp_layer_types[idx] == "sparse":
            self.mlp = MoE(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.n_routed_experts,
                cfg.n_shared_experts,
                cfg.num_experts_per_tok,
                cfg.n_group,
                cfg.topk_group,
                cfg.norm_topk_prob,
                cfg.routed_scaling_factor,
            )
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GlmMoeDsaForCausalLM(CausalLM):
    # kept in fp32 whatever the model dtype (as transformers' _keep_in_fp32_modules)
    fp32_suffixes = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")

    def __init__(self, cfg: GlmMoeDsaConfig) -> None:
        super().__init__(cfg, GlmDecoderLayer, RMSNorm, cfg.qk_rope_head_dim)

