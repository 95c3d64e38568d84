"""The decoder skeleton every family shares: embed -> layers (mixer + MLP, pre-norm residuals) -> norm -> head.

A layer's token mixer (attention, Gated DeltaNet, MLA) implements the state protocol:
    forward(x, rope, seg)       -> output, reading the prefix state from `seg` and emitting what it adds
    emit_state(x, rope, seg)    -> only emit the state (the last layer during capture needs nothing else)
    empty_state(n, dtype, device) -> its prefix state for n tokens
"""

from __future__ import annotations

import torch
from torch import nn

from ...state import LayerState, Segment
from .rope import Rotary


class DecoderLayer(nn.Module):
    """Pre-norm block. Subclasses register `self_attn`/`linear_attn`, `mlp`, then the two norms (HF order)."""

    mixer_name = "self_attn"

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, x: torch.Tensor, rope, seg: Segment) -> torch.Tensor:
        x = x + self.mixer(self.input_layernorm(x), rope, seg)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    """embed_tokens -> layers -> norm, with the rotary embedding shared by the layers (HF names and order)."""

    def __init__(self, cfg, layer: type[DecoderLayer], norm: type[nn.Module], rotary_dim: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = Rotary(cfg.rope, rotary_dim, cfg.max_position_embeddings)


class CausalLM(nn.Module):
    """`forward(input_ids)` -> logits [B, T, V]. With a `Segment`, runs positions seg.start.. over a prefix state.

    `logits_from` limits the LM head to positions >= it (GRPO scores only responses); `logits_from=None`
    skips the head entirely (prompt capture only needs each layer's state).
    A family passes its layer class, final norm class and rotary dims.
    """

    def __init__(self, cfg, layer: type[DecoderLayer], norm: type[nn.Module], rotary_dim: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg, layer, norm, rotary_dim)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def empty_state(self, tokens: int, dtype: torch.dtype, device: torch.device) -> list[LayerState]:
        return [layer.mixer.empty_state(tokens, dtype, device) for layer in self.model.layers]

    def empty_cache(self, rows: int, tokens: int, dtype: torch.dtype, device: torch.device) -> dict[int, LayerState]:
        """Per-branch buffers for decoding `tokens` tokens, for the layers with per-token state."""
        mixers = [layer.mixer for layer in self.model.layers]
        return {i: m.empty_cache(rows, tokens, dtype, device) for i, m in enumerate(mixers) if hasattr(m, "empty_cache")}

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
                layer.mixer.emit_state(layer.input_layernorm(x), rope, seg)
                return None
            x = layer(x, rope, seg)
        return self.lm_head(m.norm(x[:, logits_from:]))
