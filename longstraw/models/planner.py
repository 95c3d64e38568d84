"""A family's planner profile: what `longstraw plan` (longstraw/tools/) needs to know of a family beyond the
model it builds, so that the tools name no family.

- its layer kinds: each layer's kind, in order; the planner measures one proxy per kind (layers of one kind
  save the same activations);
- its proxy configs: a config of a few layers of one kind, cut to what one token's activations depend on;
- its attention geometry: the widths the planner counts the attention's gathered queries and backward buffers
  by (`HeadAttention` or `LatentSparseAttention`; a new kind of attention adds a geometry here and its bytes in
  tools/plan.py).

Each family subclasses `FamilyPlanner` in its package (`planner.py`) and registers it in models/registry.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from .config import ModelConfig


@dataclass(frozen=True)
class HeadAttention:
    """Attention with per-head queries, keys and values (ops/attention.py, ops/split_attention.py): dense and
    gated attention."""

    heads: int  # query heads
    head_dim: int


@dataclass(frozen=True)
class LatentSparseAttention:
    """MLA absorbed into its latent space, over the top-k keys DSA's indexer selects (ops/sparse_attention.py,
    ops/split_sparse_attention.py): a query is `heads` rows of latent + rope width, plus the indexer's query."""

    heads: int
    latent_dim: int  # kv_lora_rank: the shared latent key and value
    rope_dim: int  # qk_rope_head_dim: the shared RoPE key
    index_heads: int
    index_head_dim: int
    top_k: int  # keys each query attends to


AttentionGeometry = HeadAttention | LatentSparseAttention


class FamilyPlanner(ABC):
    """The planner profile of one family (see the module's docstring)."""

    @abstractmethod
    def layer_kinds(self, cfg: ModelConfig) -> tuple[str, ...]:
        """Each of the model's layers' kind, in order (one per layer)."""

    @abstractmethod
    def proxy_config(self, hf_config: dict, kind: str, layers: int) -> dict:
        """A transformers config dict (of the text model) of `layers` layers, all of `kind`, otherwise as
        `hf_config`, with its MoE cut to the experts one token uses (what a token's activations depend on). The
        planner sets its vocabulary."""

    @abstractmethod
    def attention(self, cfg: ModelConfig) -> AttentionGeometry:
        """The geometry of the model's attention layers."""
