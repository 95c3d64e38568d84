"""`PrefixLM`: what the engine, rollout and store need of a model. `CausalLM` (models/common/decoder.py)
implements it for every family; its layers' mixers implement `TokenMixer` (models/common/mixer.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from ..segment import Segment
from ..state import LayerState
from .config import ModelConfig


class PrefixLM(Protocol):
    config: ModelConfig
    fp32_suffixes: tuple[str, ...]  # parameters kept in at least fp32 whatever the model dtype

    def parameters(self) -> Iterator[nn.Parameter]:
        """As nn.Module's: the engine reads the model's dtype and device from the first."""

    def empty_state(self, tokens: int, dtype: torch.dtype, device: torch.device | str) -> list[LayerState]:
        """Every layer's prefix state for `tokens` tokens."""

    def empty_cache(self, rows: int, tokens: int, dtype: torch.dtype, device: torch.device | str
                    ) -> dict[int, LayerState]:
        """Per-branch buffers for decoding `tokens` tokens, for the layers whose state grows with tokens."""

    def __call__(self, input_ids: torch.Tensor, seg: Segment | None = None, logits_from: int = 0) -> torch.Tensor:
        """Logits [B, T - logits_from, V] of positions seg.start + logits_from.. over the segment's prefix."""

    def token_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor, seg: Segment | None = None,
                       logits_from: int = 0, head_chunk: int | None = None, entropy: bool = False
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """log softmax(logits)[targets] [B, T - logits_from] (fp32, fp64 for fp64 models) as from `__call__`,
        with the LM head run over `head_chunk` tokens at a time and recomputed in the backward: no tokens x vocab
        tensor is made or saved. With `entropy`, (logp, each position's entropy without autograd)."""

    decoder_layers: nn.ModuleList  # each with `capture` and `emit_state` (models/common/decoder.py)
    layers_stand_alone: bool  # no layer reads another layer's output in its segment (DSA's shared selection)

    def embed(self, input_ids: torch.Tensor, seg: Segment) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The embeddings of positions seg.start.. and their rotary (cos, sin)."""

    def emit_states(self, input_ids: torch.Tensor, seg: Segment) -> None:
        """Only what each layer adds to the state, into `seg.emitted` (no LM head; prompt capture)."""

    def emit_states_by_layer(self, chunks: list[tuple[torch.Tensor, Segment]], stored: Callable[[int, int], None],
                             hold: Callable[[nn.Module], AbstractContextManager]) -> None:
        """`emit_states` of several chunks, layer-major: each layer over every chunk before the next layer, inside
        `hold(layer)`; `stored(layer, chunk)` after each."""
