"""MLA latent + RoPE key and the DSA indexer key (GLM-5, DeepSeek)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .protocol import TokenState


@dataclass
class LatentState(TokenState):
    """[c_kv (normalised latent) | k_rope (after RoPE)] in one tensor `kv` [N, kv_lora_rank + rope_dim], and the
    DSA indexer key `index_k` [N, index_head_dim] (None for layers that reuse another layer's selection). The
    prefix is never up-projected per head."""

    kind = "latent"
    label = "MLA latent + RoPE key"
    grad_fields = ("kv",)  # the indexer gets no gradient from the LM loss (as in transformers)

    kv: torch.Tensor
    index_k: torch.Tensor | None = None

    @property
    def description(self) -> str:
        return f"{self.label} + indexer key" if self.index_k is not None else f"{self.label} (shared top-k)"
