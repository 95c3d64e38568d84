"""Qwen3.5 text model: Gated DeltaNet linear layers with every n-th layer gated full attention.

Parameter names follow transformers' `Qwen3_5ForCausalLM` (the multimodal checkpoint layout is mapped on load).
"""

from __future__ import annotations

from .common.attention import Attention
from .common.decoder import CausalLM, DecoderLayer
from .common.deltanet import GatedDeltaNet
from .common.mlp import SwiGLU
from .common.norm import ZeroCenteredRMSNorm
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
            self.self_attn = Attention(
                idx,
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                qkv_bias=cfg.attention_bias,
                o_bias=cfg.attention_bias,
                qk_norm=ZeroCenteredRMSNorm,
                eps=cfg.rms_norm_eps,
                gated=True,
            )
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35ForCausalLM(CausalLM):
    def __init__(self, cfg: Qwen35Config) -> None:
        # text-only mRoPE has equal positions on all three axes, i.e. plain 1-D RoPE on the rotary dims
        super().__init__(cfg, Qwen35DecoderLayer, ZeroCenteredRMSNorm, cfg.rotary_dim)

    def activation_bytes_per_token(self) -> int:
        """Estimated autograd-saved bytes per token of a forward, attention and linear layers averaged."""
        c = self.config
        attn = 5 * 2 * c.num_attention_heads * c.head_dim + 4 * c.num_key_value_heads * c.head_dim
        vd = c.linear_num_value_heads * c.linear_value_head_dim
        conv = 2 * c.linear_num_key_heads * c.linear_key_head_dim + vd
        lin = 4 * conv + 6 * vd + 64 * c.linear_num_value_heads  # conv in/out, q/k/v, gate, norm, intra-chunk
        elems = sum(attn if t == "full_attention" else lin for t in c.layer_types)
        elems += c.num_hidden_layers * (14 * c.hidden_size + 6 * c.intermediate_size)
        return elems * self.lm_head.weight.element_size()
