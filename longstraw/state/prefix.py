"""`PrefixState`: what every layer keeps of `prompt[:-1]`, plus what a replay needs to start from it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .protocol import LayerState


@dataclass(frozen=True)
class RowMap:
    """The prompt positions of the rows one rank holds: ordered, disjoint `blocks` [(start, end)], whose tokens are
    the rows in order. One process holds one block, (0, length); a rank of a sequence-parallel group holds its
    block of every prompt chunk (`SequenceGroup.chunk_blocks`)."""

    blocks: tuple[tuple[int, int], ...]

    @classmethod
    def whole(cls, length: int) -> "RowMap":
        return cls(((0, length),))

    @property
    def rows(self) -> int:
        return sum(e - s for s, e in self.blocks)

    def before(self, position: int) -> int:
        """How many held rows lie before `position` (the visible rows of a prefix of that length)."""
        return sum(max(0, min(e, position) - s) for s, e in self.blocks)

    def owns(self, position: int) -> bool:
        return any(s <= position < e for s, e in self.blocks)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The position of every held row [rows], ascending."""
        if len(self.blocks) == 1:
            s, e = self.blocks[0]
            return torch.arange(s, e, device=device)
        return torch.cat([torch.arange(s, e, device=device) for s, e in self.blocks])


def boundary_states(layers: Sequence[LayerState]) -> dict[int, LayerState]:
    """The states exact mode keeps at a chunk start, by layer index (the fixed-size ones)."""
    return {i: b for i, s in enumerate(layers) if (b := s.boundary()) is not None}


@dataclass
class PrefixState:
    """State of `prompt[:-1]` per layer, plus the last prompt token (it starts every branch) and its position.

    `chunks` are the (start, end) ranges the prompt was captured in. For the exact mode, `boundaries[i]` holds
    `boundary_states` at the start of chunk i (to recompute chunk i), for every `boundary_every`-th chunk.
    With `routing` (MoE routing replay), every recompute of the prompt's chunks routes its tokens as capture did.

    A state sharded over a sequence-parallel group of C ranks holds, on each rank, the rows of its block of every
    chunk (`rows`) of every per-token layer, the whole prompt's fixed-size states, and the boundaries of the
    chunks i with i % C == its rank.
    """

    layers: list[LayerState]
    prompt_ids: torch.Tensor  # [P], int64, the whole prompt
    chunks: list[tuple[int, int]]
    model_fingerprint: str
    boundaries: dict[int, dict[int, LayerState]] = field(default_factory=dict)
    rows: RowMap | None = None  # the positions of the rows held; None: all of them
    boundary_every: int = 1  # exact mode keeps the boundaries of chunks 0, k, 2k, ... (the others are recomputed)
    # MoE routing replay: by MoE layer, the experts [rows, top_k] each held row's token was routed to at capture
    # (uint8 up to 256 experts), which every later forward of the prompt's tokens takes instead of re-routing
    routing: dict[int, torch.Tensor] | None = None
    # exact mode's capture: the autograd graphs it kept of the last chunks (engine/capture.py: PromptGraphs);
    # in memory only, never stored, used up by the prompt backward
    graphs: object | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rows is None:
            self.rows = RowMap.whole(self.length)

    @property
    def sharded(self) -> bool:
        """Whether this rank holds only some of the rows."""
        return self.rows.rows != self.length

    def owns(self, position: int) -> bool:
        return self.rows.owns(position)

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
    def routing_nbytes(self) -> int:
        return sum(t.nbytes for t in (self.routing or {}).values())

    def routing_rows(self, row: int, count: int) -> dict[int, torch.Tensor] | None:
        """The replayed routing of held rows row..row+count-1, as a segment takes it ([1, count, top_k] views)."""
        if self.routing is None:
            return None
        return {j: t[row : row + count][None] for j, t in self.routing.items()}

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
