"""Prefix state: what each layer keeps of the prompt to continue from it, and the per-forward segment context."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor


@dataclass
class AttentionState:
    """K (after norm and RoPE) and V of the prefix tokens of one attention layer: [kv_heads, N, head_dim]."""

    k: Tensor
    v: Tensor

    @property
    def nbytes(self) -> int:
        return self.k.nelement() * self.k.element_size() + self.v.nelement() * self.v.element_size()

    def zeros_like(self) -> "AttentionState":
        return AttentionState(torch.zeros_like(self.k), torch.zeros_like(self.v))

    def narrow(self, start: int, length: int) -> "AttentionState":
        return AttentionState(self.k.narrow(1, start, length), self.v.narrow(1, start, length))


@dataclass
class PrefixState:
    """State of `prompt[:-1]`, per layer, plus what a replay needs: the last prompt token and its position.

    `chunks` are the (start, end) ranges the prompt was captured in; the exact mode recomputes them in reverse.
    """

    layers: list[AttentionState]
    prompt_ids: Tensor  # [P], int64, the whole prompt (last token starts every branch)
    chunks: list[tuple[int, int]]
    model_fingerprint: str

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

    def zeros_like(self) -> list[AttentionState]:
        """A gradient buffer with the layout of the state (dLoss/dState)."""
        return [layer.zeros_like() for layer in self.layers]

    def snapshot(self) -> list[Tensor]:
        return [t.clone() for layer in self.layers for t in (layer.k, layer.v)]


@dataclass
class Segment:
    """Context of one forward over a segment of tokens starting at position `start`.

    A segment attends over the first `prefix_len` tokens of `prefix` (if any) plus itself; when `grad` is given,
    dLoss/dprefix is added into it during backward. With `collect=True` each attention layer hands its new K/V
    to `emitted` (with autograd history, if grad mode is on).
    """

    start: int = 0
    prefix: list[AttentionState] | None = None
    prefix_len: int = 0
    grad: list[AttentionState] | None = None
    collect: bool = False
    emitted: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)

    def emit(self, layer: int, k: Tensor, v: Tensor) -> None:
        if self.collect:
            self.emitted[layer] = (k, v)

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
