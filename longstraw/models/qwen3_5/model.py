"""Qwen3.5 text model: Gated DeltaNet linear layers with every n-th layer gated full attention.

Parameter names follow transformers' `Qwen3_5ForCausalLM` (the multimodal checkpoint layout is mapped on load).
"""

from __future__ import annotations

from ..common.attention import Attention
from ..common.decoder import CausalLM, DecoderLayer
from ..common.deltanet import GatedDeltaNet
from ..common.mlp import SwiGLU
from ..common.norm import ZeroCenteredRMSNorm
from .config import Qwen35Config


class Qwen35DecoderLayer(DecoderLayer):
    def __init__(self, cfg: Qwen35Config, idx: int) -> None:
        super().__init__()
        if cfg.layer_types[idx] == "linear_attention":
            self.mixer_name = "linear_attn"
            self.linear_attn = GatedDeltaNet(
                idx,
                cfg.hidden_size,
                cfg.linear_num_key_heads,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
                cfg.linear_conv_kernel_dim,
                cfg.rms_norm_eps,
            )
        else:
            self.self_attn = Attention.from_config(cfg, idx, o_bias=cfg.attention_bias, qk_norm=ZeroCenteredRMSNorm,
                                                   gated=True)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35ForCausalLM(CausalLM):
    def __init__(self, cfg: Qwen35Config) -> None:
        # text-only mRoPE has equal positions on all three axes, i.e. plain 1-D RoPE on the rotary dims
        super().__init__(cfg, Qwen35DecoderLayer, ZeroCenteredRMSNorm, cfg.rotary_dim)

