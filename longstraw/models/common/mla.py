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

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.attention import decode_attention, segment_attention
from ...ops.sparse_attention import KEY_BLOCK, select_topk, select_topk_sharded, sparse_latent_attention
from ...state import LatentState, Segment
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
        """Per-head indexer queries [B, T, Hi, D] and head weights [B, T, Hi], in fp32."""
        b, t, _ = x.shape
        q = _rope_part(self.wq_b(q_resid).view(b, t, self.heads, self.head_dim), rope, self.rope_dim, first=True)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.heads**-0.5
        return q.float(), w

    def scores(self, qw: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, causal: bool) -> torch.Tensor:
        """sum_h w_h relu(q_h . k * scale): [B, T, L] for keys [L, D] (prefix, shared) or [B, L, D] (own tokens;
        `causal` masks the positions after each query with -inf)."""
        q, w = qw
        k = keys.float() if keys.dim() == 3 else keys.float().expand(q.shape[0], -1, -1)
        s = torch.einsum("bth,bthl->btl", w, F.relu(torch.einsum("bthd,bld->bthl", q, k) * self.scale))
        if causal:
            s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return s


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

    def _select(self, x, q_resid, rope, own: LatentState, prefix: LatentState | None, seg: Segment, causal: bool):
        """Top-k positions per query over prefix ++ own (None: every visible position fits in index_topk).
        `causal`: own holds the segment's tokens (False when decoding: own is the branch so far, query last).
        Sharded, `prefix` is this rank's rows and the selection is over the whole prefix."""
        if not hasattr(self, "indexer"):
            return seg.dsa_topk  # a "shared" layer reuses the last full indexer's selection
        n = 0 if seg.prefix is None else seg.prefix.length  # the whole prefix's, on every rank
        sel = None
        if self.index_topk < n + own.kv.shape[1]:
            with torch.no_grad():
                qw = self.indexer.queries(x, q_resid, rope)
                rows, offset = (0, 0) if prefix is None else (prefix.kv.shape[0], seg.prefix.offset)
                # streamed: one block of prefix scores exists at a time. Looping over block numbers, not over
                # range(0, rows, KEY_BLOCK), lets torch.compile keep `rows` symbolic: its guard is on the count
                blocks = ((offset + b * KEY_BLOCK,
                           self.indexer.scores(qw, prefix.index_k[b * KEY_BLOCK : (b + 1) * KEY_BLOCK], False))
                          for b in range(-(-rows // KEY_BLOCK)))
                own_scores = self.indexer.scores(qw, own.index_k, causal=causal)
                if seg.cache is not None and (visible := seg.cache.visible) is not None:  # static decode: unwritten rows
                    own_scores = own_scores.masked_fill(
                        torch.arange(own_scores.shape[-1], device=own_scores.device) >= visible, float("-inf"))
                if seg.parallel is None:
                    sel = select_topk(itertools.chain(blocks, [(n, own_scores)]), self.index_topk)
                else:
                    sel = select_topk_sharded(blocks, (n, own_scores), self.index_topk, seg.parallel)
        seg.dsa_topk = sel
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

        own = self._latent(x, rope)
        seg.emit(self.layer_idx, own)
        prefix, grad = seg.prefix_rows(self.layer_idx), seg.prefix_grad(self.layer_idx)
        decoding = seg.cache is not None
        if decoding:  # own becomes the branch's tokens so far, this one included
            own = seg.cache.extend(self.layer_idx, own)
        sel = self._select(x, q_resid, rope, own, prefix, seg, causal=not decoding)
        if sel is None:  # dense: one shared head whose values are the keys; keep the c_kv part of the output
            kv = own.kv[:, None]
            pk = None if prefix is None else (prefix.kv[None], prefix.kv[None])
            if decoding:
                o = decode_attention(qa.transpose(1, 2), kv, kv, self.scale, pk, parallel=seg.parallel,
                                     own_visible=seg.cache.visible)
            else:
                pg = None if grad is None else (grad.kv[None], grad.kv[None])
                o = segment_attention(qa.transpose(1, 2), kv, kv, self.scale, prefix=pk, prefix_grad=pg,
                                      parallel=seg.parallel)
            o = o.transpose(1, 2)[..., : self.rank]
        else:
            n = 0 if seg.prefix is None else seg.prefix.length
            o = sparse_latent_attention(
                qa, own.kv, None if prefix is None else prefix.kv, *sel, self.scale, self.rank,
                None if grad is None else grad.kv, length=n, offset=0 if seg.prefix is None else seg.prefix.offset,
                parallel=seg.parallel,
            )
        out = torch.einsum("bthc,hvc->bthv", o, w_uv)
        return self.o_proj(out.reshape(b, t, -1))

