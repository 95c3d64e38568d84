"""Per-layer activation checkpointing: a layer keeps only its input for the backward, and runs its forward again
when the backward reaches it (torch's non-reentrant checkpoint), so a chunk or a branch holds its layers' inputs
plus one layer's activations at a time, not every layer's.

Two things make a layer of ours more than a function of its input:
- it reads and writes its `Segment`: the state it emits, and DSA's top-k selection that the next "shared" layers
  reuse. The recompute runs with the selection the layer saw the first time and leaves the segment as it found
  it;
- on a sequence-parallel group its forward makes collectives. The recompute is always whole (no early stop), so
  every rank makes the same collectives in the same order whatever tensors its own backward needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ...state import Segment

Out = TypeVar("Out")


def recomputed(fn: Callable[[torch.Tensor, tuple, Segment], Out], x: torch.Tensor, rope: tuple, seg: Segment) -> Out:
    """fn(x, rope, seg) (a layer's forward, `capture` or `emit_state`) under activation checkpointing."""
    selection = seg.dsa_topk
    first = True

    def run(x: torch.Tensor) -> Out:
        nonlocal first
        if first:
            first = False
            return fn(x, rope, seg)
        emitted, after = dict(seg.emitted), seg.dsa_topk
        seg.dsa_topk = selection
        try:
            return fn(x, rope, seg)
        finally:
            seg.emitted.clear()
            seg.emitted.update(emitted)
            seg.dsa_topk = after

    with set_checkpoint_early_stop(False):
        return checkpoint(run, x, use_reentrant=False)
