"""Dense decoder-only transformers: llama, qwen2, qwen3. Parameter names follow transformers' *ForCausalLM."""

from __future__ import annotations

import torch
from torch import nn

from ..state import Segment
from .common.attention import Attention
from .common.mlp import SwiGLU
from .common.norm import RMSNorm
from .common.rope import Rotary
from .config import DenseConfig


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DenseConfig, idx: int) -> None:
        super().__init__()
        # registration order as in transformers, so named_parameters() lists the same order
        self.self_attn = Attention(
            idx,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.o_proj_bias,
            qk_norm=cfg.qk_norm,
            eps=cfg.rms_norm_eps,
        )
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, seg: Segment) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, seg)
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseModel(nn.Module):
    def __init__(self, cfg: DenseConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = Rotary(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)


class DenseForCausalLM(nn.Module):
    """`forward(input_ids)` -> logits [B, T, V]. With a `Segment`, runs positions seg.start.. over a prefix state.

    `logits_from` limits the LM head to positions >= it (GRPO scores only responses); `logits_from=None`
    with `seg.collect` skips the head entirely (prompt capture needs only K/V).
    """

    def __init__(self, cfg: DenseConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DenseModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def state_layers(self) -> list[tuple[int, int]]:
        """(kv_heads, head_dim) of each layer's per-token prefix state."""
        return [(self.config.num_key_value_heads, self.config.head_dim)] * self.config.num_hidden_layers

    def activation_bytes_per_token(self) -> int:
        """Estimated autograd-saved bytes per token of a forward (norms, projections, MLP intermediates)."""
        c = self.config
        elems = 8 * c.hidden_size + 3 * c.num_attention_heads * c.head_dim
        elems += 2 * c.num_key_value_heads * c.head_dim + 4 * c.intermediate_size
        return elems * c.num_hidden_layers * self.lm_head.weight.element_size()

    def forward(
        self, input_ids: torch.Tensor, seg: Segment | None = None, logits_from: int | None = 0
    ) -> torch.Tensor | None:
        seg = seg or Segment()
        m = self.model
        x = m.embed_tokens(input_ids)
        rope = m.rotary_emb(seg.start, input_ids.shape[1], x.dtype, x.device)
        last = len(m.layers) - 1
        for i, layer in enumerate(m.layers):
            if logits_from is None and i == last:
                # capture: the last layer's K/V are all that is kept, its output feeds nothing
                layer.self_attn.emit_kv(layer.input_layernorm(x), rope, seg)
                return None
            x = layer(x, rope, seg)
        return self.lm_head(m.norm(x[:, logits_from:]))
