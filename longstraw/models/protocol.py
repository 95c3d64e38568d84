"""`PrefixLM`: what the engine, rollout and store need of a model. `CausalLM` (models/common/decoder.py)
implements it for every family; its layers' mixers implement `TokenMixer` (models/common/mixer.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from ..state import LayerState, Segment
from .config import ModelConfig


class PrefixLM(Protocol):
    config: ModelConfig
    fp32_suffixes: tuple[str, ...]  # parameters kept in at least fp32 whatever the model dtype
    splits_tokens: bool  # the ranks of a group may each run only their block of a prompt chunk (sequence.py)

    def parameters(self) -> Iterator[nn.Parameter]:
        """As nn.Module's: the engine reads the model's dtype and device from the first."""

    def empty_state(self, tokens: int, dtype: torch.dtype, device: torch.device | str) -> list[LayerState]:
        """Every layer's prefix state for `tokens` tokens."""

    def empty_cache(self, rows: int, tokens: int, dtype: torch.dtype, device: torch.device | str
                    ) -> dict[int, LayerState]:
        """Per-branch buffers for decoding `tokens` tokens, for the layers whose state grows with tokens."""

    def __call__(self, input_ids: torch.Tensor, seg: Segment | None = None, logits_from: int = 0) -> torch.Tensor:
        """Logits [B, T - logits_from, V] of positions seg.start + logits_from.. over the segment's prefix."""

    def emit_states(self, input_ids: torch.Tensor, seg: Segment) -> None:
        """Only what each layer adds to the state, into `seg.emitted` (no LM head; prompt capture)."""
