"""Prefix state: what each layer keeps of the prompt to continue from it, and the per-forward segment context."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor


def _nbytes(*ts: Tensor) -> int:
    return sum(t.nelement() * t.element_size() for t in ts)


@dataclass
class AttentionState:
    """Per-token state of an attention layer: K (after norm and RoPE) and V, [kv_heads, N, head_dim].

    As a segment's output (emitted by a layer) the tensors keep their batch dim: [B, kv_heads, T, head_dim].
    """

    k: Tensor
    v: Tensor

    @property
    def nbytes(self) -> int:
        return _nbytes(self.k, self.v)

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.k, self.v)

    def differentiable(self) -> tuple[Tensor, ...]:
        """The tensors that carry gradient (as emitted by a segment, with autograd history)."""
        return (self.k, self.v)

    def grad_buffer(self) -> "AttentionState":
        """dLoss/dState buffer, zeros, with this state's layout."""
        return AttentionState(torch.zeros_like(self.k), torch.zeros_like(self.v))

    def rows(self, start: int, end: int) -> list[Tensor]:
        """Positions [start, end) of the differentiable tensors, with a batch dim of 1 (matches `emit`)."""
        return [self.k[None, :, start:end], self.v[None, :, start:end]]


@dataclass
class LatentState:
    """Per-token state of an MLA layer (GLM-5, DeepSeek): [c_kv (normalised latent) | k_rope (after RoPE)] in one
    tensor `kv` [N, kv_lora_rank + rope_dim], and the DSA indexer key `index_k` [N, index_head_dim] (None for
    layers that reuse another layer's selection). The prefix is never up-projected per head."""

    kv: Tensor
    index_k: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return _nbytes(*self.tensors())

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.kv,) if self.index_k is None else (self.kv, self.index_k)

    def differentiable(self) -> tuple[Tensor, ...]:
        return (self.kv,)  # the indexer gets no gradient from the LM loss (as in transformers)

    def grad_buffer(self) -> "LatentState":
        return LatentState(torch.zeros_like(self.kv))

    def rows(self, start: int, end: int) -> list[Tensor]:
        return [self.kv[None, start:end]]


@dataclass
class RecurrentState:
    """Fixed-size state of a linear-attention (Gated DeltaNet) layer after some tokens.

    conv: the last kernel-1 inputs of the causal depthwise conv, [conv_dim, kernel-1] (model dtype);
    ssm: the delta-rule state, [v_heads, k_dim, v_dim] in fp32. With a batch dim in front inside a forward.
    """

    conv: Tensor
    ssm: Tensor

    @property
    def nbytes(self) -> int:
        return _nbytes(self.conv, self.ssm)

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.conv, self.ssm)

    def differentiable(self) -> tuple[Tensor, ...]:
        return (self.conv, self.ssm)

    def expand_rows(self, rows: int) -> "RecurrentState":
        """The state for `rows` branches as broadcast views (no copy; each branch's next state is its own)."""
        return RecurrentState(self.conv[None].expand(rows, *self.conv.shape), self.ssm[None].expand(rows, *self.ssm.shape))

    def leaf(self) -> "RecurrentState":
        """The same storage as a fresh autograd leaf (no copy): its .grad collects dLoss/dState."""
        return RecurrentState(self.conv.detach().requires_grad_(), self.ssm.detach().requires_grad_())

    def grads(self) -> "RecurrentState":
        """dLoss/d(this leaf), zeros where nothing flowed."""
        return RecurrentState(
            self.conv.grad if self.conv.grad is not None else torch.zeros_like(self.conv),
            self.ssm.grad if self.ssm.grad is not None else torch.zeros_like(self.ssm),
        )


LayerState = AttentionState | LatentState | RecurrentState
PerTokenState = AttentionState | LatentState


@dataclass
class PrefixState:
    """State of `prompt[:-1]`, per layer, plus what a replay needs: the last prompt token and its position.

    `chunks` are the (start, end) ranges the prompt was captured in. For the exact mode, `boundaries[i]` holds the
    recurrent layers' states at the start of chunk i (to recompute chunk i), for every `boundary_every`-th chunk.
    """

    layers: list[LayerState]
    prompt_ids: Tensor  # [P], int64, the whole prompt (its last token starts every branch)
    chunks: list[tuple[int, int]]
    model_fingerprint: str
    boundaries: dict[int, dict[int, RecurrentState]] = field(default_factory=dict)

    @property
    def length(self) -> int:
        """Tokens covered by the state (P - 1)."""
        return self.prompt_ids.numel() - 1

    @property
    def last_token(self) -> int:
        return int(self.prompt_ids[-1])

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def boundary_nbytes(self) -> int:
        return sum(s.nbytes for b in self.boundaries.values() for s in b.values())

    @property
    def fixed_nbytes(self) -> int:
        """Bytes of the fixed-size (recurrent) part of the state."""
        return sum(s.nbytes for s in self.layers if isinstance(s, RecurrentState))

    def grad_buffer(self) -> dict[int, PerTokenState]:
        """dLoss/dState buffer for the per-token part of the state (the exact mode's leaves)."""
        return {i: s.grad_buffer() for i, s in enumerate(self.layers) if not isinstance(s, RecurrentState)}

    def snapshot(self) -> list[Tensor]:
        return [t.clone() for layer in self.layers for t in layer.tensors()]


@dataclass
class Segment:
    """Context of one forward over a segment of tokens starting at position `start`.

    Attention layers attend over the first `prefix_len` tokens of their `prefix` entry plus the segment; with
    `grad`, dLoss/dprefix is added into it during backward. Recurrent layers start from their `prefix` entry
    (a RecurrentState, shared by all batch rows) or from zeros. With `collect=True` each layer hands what it
    adds to the state to `emitted`: new K/V for attention, the final state for recurrent layers.
    """

    start: int = 0
    prefix: list[LayerState] | None = None
    prefix_len: int = 0
    grad: dict[int, PerTokenState] | None = None
    collect: bool = False
    emitted: dict[int, LayerState] = field(default_factory=dict)
    scratch: dict = field(default_factory=dict)  # passed between layers of one forward (DSA top-k sharing)
    # decoding: per-branch buffers of the tokens generated so far (batch dim first), `cache_len` of them filled;
    # per-token layers write the new token at cache_len and attend over prefix + cache
    cache: dict[int, "PerTokenState"] | None = None
    cache_len: int = 0

    def emit(self, layer: int, state: LayerState) -> None:
        if self.collect:
            self.emitted[layer] = state

    def prefix_kv(self, layer: int) -> tuple[Tensor, Tensor] | None:
        if self.prefix is None or self.prefix_len == 0:
            return None
        s = self.prefix[layer]
        return s.k[:, : self.prefix_len], s.v[:, : self.prefix_len]

    def prefix_grad(self, layer: int) -> tuple[Tensor, Tensor] | None:
        if self.grad is None or self.prefix_len == 0:
            return None
        g = self.grad[layer]
        return g.k[:, : self.prefix_len], g.v[:, : self.prefix_len]

    def prefix_latent(self, layer: int) -> tuple[LatentState, LatentState | None] | None:
        """The first prefix_len positions of an MLA layer's state, and of its gradient buffer."""
        if self.prefix is None or self.prefix_len == 0:
            return None
        s, n = self.prefix[layer], self.prefix_len
        ik = None if s.index_k is None else s.index_k[:n]
        g = None if self.grad is None else LatentState(self.grad[layer].kv[:n])
        return LatentState(s.kv[:n], ik), g

    def initial_state(self, layer: int) -> RecurrentState | None:
        return None if self.prefix is None else self.prefix[layer]
