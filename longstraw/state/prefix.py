"""`PrefixState`: what every layer keeps of `prompt[:-1]`, plus what a replay needs to start from it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .protocol import LayerState


def boundary_states(layers: Sequence[LayerState]) -> dict[int, LayerState]:
    """The states exact mode keeps at a chunk start, by layer index (the fixed-size ones)."""
    return {i: b for i, s in enumerate(layers) if (b := s.boundary()) is not None}


@dataclass
class PrefixState:
    """State of `prompt[:-1]` per layer, plus the last prompt token (it starts every branch) and its position.

    `chunks` are the (start, end) ranges the prompt was captured in. For the exact mode, `boundaries[i]` holds
    `boundary_states` at the start of chunk i (to recompute chunk i), for every `boundary_every`-th chunk.

    A state sharded over a sequence-parallel group holds, on each rank, the rows of its `shard` (start, end) of
    every per-token layer, the whole prompt's fixed-size states, and the boundaries of its own chunks.
    """

    layers: list[LayerState]
    prompt_ids: torch.Tensor  # [P], int64, the whole prompt
    chunks: list[tuple[int, int]]
    model_fingerprint: str
    boundaries: dict[int, dict[int, LayerState]] = field(default_factory=dict)
    shard: tuple[int, int] | None = None  # the token range of the rows held; None: all of them
    boundary_every: int = 1  # exact mode keeps the boundaries of chunks 0, k, 2k, ... (the others are recomputed)
    # exact mode's capture: the autograd graphs it kept of the last chunks (engine/capture.py: PromptGraphs);
    # in memory only, never stored, used up by the prompt backward
    graphs: object | None = field(default=None, repr=False, compare=False)

    @property
    def offset(self) -> int:
        """Position of the first row held."""
        return 0 if self.shard is None else self.shard[0]

    def owns(self, position: int) -> bool:
        return self.shard is None or self.shard[0] <= position < self.shard[1]

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
        """Bytes of the part of the state that does not grow with the prompt."""
        return sum(s.fixed_bytes for s in self.layers)

    def grad_buffer(self) -> dict[int, LayerState]:
        """dLoss/dState buffers, zeros, one per layer (the exact mode's sinks and leaf gradients)."""
        return {i: s.grad_buffer() for i, s in enumerate(self.layers)}

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for layer in self.layers for t in layer.tensors()]
