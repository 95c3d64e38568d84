"""`TokenMixer`: what a layer's token mixer (attention, Gated DeltaNet, MLA) implements for the engine."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from ...segment import Segment
from ...state import LayerState


class TokenMixer(nn.Module, ABC):
    """Mixes tokens over the prefix state and the segment. `layer_idx` keys its entry in a `Segment`.

    A mixer reaches other tokens only through its segment, by the primitives of `longstraw.segment` (`attend`,
    `conv_tail`, `delta_rule`, `select_topk`, `attend_sparse`, one module each), so the ranks of a group can each
    run only their block of a prompt chunk through it (the split schedule, parallel/sequence.py)."""

    layer_idx: int
    reads_other_layers: bool = False  # a DSA layer that reuses an earlier layer's selection (in its segment)
    # whether a recomputed layer may run it over tiles of its queries: then it has `_kv(x, rope)` (the state it
    # emits for x) and `tile_forward` (models/common/recompute.py)
    tiles_queries: bool = False

    @abstractmethod
    def empty_state(self, tokens: int, dtype: torch.dtype, device: torch.device | str) -> LayerState:
        """Its prefix state for `tokens` tokens: per-token buffers to fill, or the fixed-size state before any."""

    @abstractmethod
    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], seg: Segment) -> torch.Tensor:
        """The mixer's output for x [B, T, hidden]: reads its prefix from `seg` and emits what it adds."""

    @abstractmethod
    def emit_state(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], seg: Segment) -> None:
        """Only emit what the segment adds to the state (the last layer of a prompt chunk needs no output)."""
