"""Multi-head latent attention with the DSA lightning indexer (GLM-5 `self_attn`), run in absorbed form.

The prefix state per token is the normalised latent c_kv, the RoPE key and the indexer key (LatentState). Queries
are moved into the latent space with the key half of kv_b_proj (W_uk); attention then runs over [c_kv | k_rope]
as a single shared key/value head (values: the c_kv part), and the value half (W_uv) is applied afterwards. The
cached prefix is never up-projected per head.

DSA: the indexer scores prefix + segment positions for every query and each query attends only over its top
`index_topk` positions (ties: lower position first). As in transformers, the selection is not differentiated:
the indexer gets no gradient from the LM loss. When index_topk covers every visible position, attention is
dense and runs on the flash path instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.fp32_matmul import HALF_DTYPES, matmul_fp32
from ...segment import Segment, attend, attend_sparse, select_topk
from ...state import LatentState
from .mixer import TokenMixer
from .norm import RMSNorm
from .rope import apply_rotary_interleaved


def _rope_part(x: torch.Tensor, rope, rope_dim: int, first: bool) -> torch.Tensor:
    """Apply interleaved RoPE to the rope_dim features at the start (`first`) or end of the last dim.
    x: [B, T, ..., D]; cos/sin are [T, rope_dim] and broadcast over the dims between T and D."""
    cos, sin = rope
    extra = x.dim() - 3
    cos, sin = cos.view(cos.shape[0], *([1] * extra), -1), sin.view(sin.shape[0], *([1] * extra), -1)
    if first:
        return torch.cat([apply_rotary_interleaved(x[..., :rope_dim], cos, sin), x[..., rope_dim:]], dim=-1)
    return torch.cat([x[..., :-rope_dim], apply_rotary_interleaved(x[..., -rope_dim:], cos, sin)], dim=-1)


def _latent_heads(s: LatentState) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA's one shared key/value head: [c_kv | k_rope] as both (values: its c_kv part)."""
    kv = s.kv.unsqueeze(-3)
    return kv, kv


def _latent_rows(s: LatentState) -> torch.Tensor:
    return s.kv


def _index_keys(s: LatentState) -> torch.Tensor:
    return s.index_k


def _fp32_unless_half(t: torch.Tensor) -> torch.Tensor:
    """An indexer operand as its scores' products take it: half precision as it is, anything else in fp32 (as
    transformers' indexer, which scores in fp32 whatever the model's dtype)."""
    return t if t.dtype in HALF_DTYPES else t.float()


class Indexer(nn.Module):
    """DSA lightning indexer (names as transformers): per-token key, per-head queries from the q LoRA residual."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, rope_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.rope_dim = heads, head_dim, rope_dim
        self.wq_b = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)
        self.scale = head_dim**-0.5

    def key(self, x: torch.Tensor, rope) -> torch.Tensor:
        return _rope_part(self.k_norm(self.wk(x)), rope, self.rope_dim, first=True)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head indexer queries [B, T, Hi, D] and head weights [B, T, Hi] in fp32; the queries of a half-precision
        model stay in its dtype, which `scores` multiplies as it is, into fp32."""
        b, t, _ = x.shape
        q = _rope_part(self.wq_b(q_resid).view(b, t, self.heads, self.head_dim), rope, self.rope_dim, first=True)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.heads**-0.5
        return _fp32_unless_half(q), w

    def scores(self, qw: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor) -> torch.Tensor:
        """sum_h w_h relu(q_h . k * scale) in fp32: [B, T, L] for keys [L, D] (prefix, shared) or [B, L, D] (own
        tokens). As transformers' fp32 products of the bf16 queries and keys, computed as bf16 products with fp32
        accumulation where the device has them (ops/fp32_matmul.py): the same values, on tensor cores."""
        q, w = qw
        keys = _fp32_unless_half(keys)
        b, t, h, d = q.shape
        if keys.dim() == 2:  # shared by the batch: one product for all its queries
            per_head = matmul_fp32(q.reshape(1, b * t * h, d), keys.t()[None])
        else:
            per_head = matmul_fp32(q.reshape(b, t * h, d), keys.expand(b, -1, -1).transpose(1, 2))
        per_head = per_head.view(b, t, h, -1)
        return torch.einsum("bth,bthl->btl", w, F.relu(per_head * self.scale))


class MLAttention(TokenMixer):
    def __init__(self, layer_idx: int, cfg, has_indexer: bool) -> None:
        super().__init__()
        self.layer_idx, self.heads = layer_idx, cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank, self.index_topk = cfg.kv_lora_rank, cfg.index_topk
        self.scale = cfg.softmax_scale
        h = cfg.hidden_size
        self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.heads * (self.nope + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, h, bias=cfg.attention_bias)
        self.reads_other_layers = not has_indexer
        # whether the next layer reuses this layer's selection: only then does it stay in the segment (a capture
        # in layer-major order holds one segment per chunk)
        types = cfg.indexer_types
        self.passes_selection_on = layer_idx + 1 < len(types) and types[layer_idx + 1] == "shared"
        if has_indexer:
            self.indexer = Indexer(h, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, self.rope_dim)

    def empty_state(self, tokens: int, dtype: torch.dtype, device: torch.device) -> LatentState:
        kv = torch.empty(tokens, self.rank + self.rope_dim, dtype=dtype, device=device)
        ik = None
        if hasattr(self, "indexer"):
            ik = torch.empty(tokens, self.indexer.head_dim, dtype=dtype, device=device)
        return LatentState(kv, ik)

    def _latent(self, x: torch.Tensor, rope) -> LatentState:
        """[c_kv | k_rope] of the segment's tokens [B, T, rank + rope] and (no grad) their indexer keys."""
        c, kr = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        kv = torch.cat([self.kv_a_layernorm(c), _rope_part(kr, rope, self.rope_dim, first=False)], dim=-1)
        ik = None
        if hasattr(self, "indexer"):
            with torch.no_grad():
                ik = self.indexer.key(x, rope)
        return LatentState(kv, ik)

    def emit_state(self, x: torch.Tensor, rope, seg: Segment) -> None:
        seg.emit(self.layer_idx, self._latent(x, rope))

    def _select(self, x, q_resid, rope, own: LatentState, seg: Segment):
        """Top-k positions per query over the prefix and `own` (the segment's own rows; None: every visible
        position fits in index_topk)."""
        if not hasattr(self, "indexer"):
            sel = seg.dsa_topk  # a "shared" layer reuses the last full indexer's selection
            seg.dsa_topk = sel if self.passes_selection_on else None
            return sel
        sel = None
        if self.index_topk < seg.visible_positions(own.tokens):
            with torch.no_grad():
                sel = select_topk(seg, self.layer_idx, self.index_topk, self.indexer.queries(x, q_resid, rope),
                                  self.indexer.scores, _index_keys, own)
        seg.dsa_topk = sel if self.passes_selection_on else None
        return sel

    def forward(self, x: torch.Tensor, rope, seg: Segment) -> torch.Tensor:
        b, t, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(b, t, self.heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        q_rope = _rope_part(q_rope, rope, self.rope_dim, first=True)
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        qa = torch.cat([torch.einsum("bthn,hnc->bthc", q_nope, w_uk), q_rope], dim=-1)  # [B, T, H, rank + rope]

        new = self._latent(x, rope)
        seg.emit(self.layer_idx, new)
        own = seg.own_rows(self.layer_idx, new)
        sel = self._select(x, q_resid, rope, own, seg)
        if sel is None:  # dense: one shared head whose values are the keys; keep the c_kv part of the output
            o = attend(seg, self.layer_idx, qa.transpose(1, 2), own, self.scale, _latent_heads)
            o = o.transpose(1, 2)[..., : self.rank]
        else:
            o = attend_sparse(seg, self.layer_idx, qa, own, sel, self.scale, self.rank, _latent_rows)
        out = torch.einsum("bthc,hvc->bthv", o, w_uv)
        return self.o_proj(out.reshape(b, t, -1))
