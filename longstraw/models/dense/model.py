"""Dense decoder-only transformers: llama, qwen2, qwen3. Parameter names follow transformers' *ForCausalLM."""

from __future__ import annotations

from ..common.attention import Attention
from ..common.decoder import CausalLM, DecoderLayer
from ..common.mlp import SwiGLU
from ..common.norm import RMSNorm
from .config import DenseConfig


class DenseDecoderLayer(DecoderLayer):
    def __init__(self, cfg: DenseConfig, idx: int) -> None:
        super().__init__()
        # registration order as in transformers, so named_parameters() lists the same order
        qk_norm = RMSNorm if cfg.qk_norm else None
        self.self_attn = Attention.from_config(cfg, idx, o_bias=cfg.o_proj_bias, qk_norm=qk_norm)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DenseForCausalLM(CausalLM):
    def __init__(self, cfg: DenseConfig) -> None:
        super().__init__(cfg, DenseDecoderLayer, RMSNorm, cfg.head_dim)
