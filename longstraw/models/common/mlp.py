import math

import torch
import torch.nn.functional as F
from torch import nn


def mlp_tiles(hidden: int, intermediate: int) -> int:
    """How many token tiles a checkpointed layer's MLP recomputes in (models/common/recompute.py): enough that
    one tile's MLP activations (about six tensors of `intermediate` per token) stay near two hidden states of
    the chunk."""
    return max(1, math.ceil(3 * intermediate / hidden))


class SwiGLU(nn.Module):
    """gate_proj/up_proj/down_proj feed-forward (names as in transformers)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        # token tiles of its recompute under per-layer checkpointing (recompute.py)
        self.recompute_tiles = mlp_tiles(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
