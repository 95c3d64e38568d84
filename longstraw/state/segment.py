"""The context of one forward over a segment of tokens: where it starts, the prefix it reads, what it emits.

A prompt chunk (capture, exact-mode recompute) and a batch of replayed branches read a `PrefixView`; a decode
step also writes its new tokens into a `DecodeCache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .protocol import LayerState

if TYPE_CHECKING:
    from ..parallel import SequenceParallel


@dataclass
class PrefixView:
    """Each layer's prefix state with its first `length` tokens visible, and, in exact mode, the dState sinks
    (`grads`, one per layer) that the backward adds dLoss/dPrefix into.

    Sharded over a sequence-parallel group (`parallel`), per-token layers hold this rank's rows only, the first of
    them at position `offset`; fixed-size states are the whole prefix's on every rank."""

    layers: list[LayerState]
    length: int
    grads: dict[int, LayerState] | None = None
    offset: int = 0
    parallel: SequenceParallel | None = None

    def __getitem__(self, layer: int) -> LayerState:
        return self.layers[layer]


@dataclass
class DecodeCache:
    """Per-branch buffers (batch dim first) of the tokens the branches generated so far, `filled` of them written,
    for the layers whose state grows with tokens.

    `filled` is an int, or for the static decode a 0-dim device tensor: then a step reads the whole buffer with
    the rows from `visible` on masked out, so every step has the same shapes and no host value (one compiled graph
    for all steps, which CUDA graphs can replay)."""

    layers: dict[int, LayerState]
    filled: int | torch.Tensor = 0

    def __getitem__(self, layer: int) -> LayerState:
        return self.layers[layer]

    @property
    def static(self) -> bool:
        return isinstance(self.filled, torch.Tensor)

    @property
    def visible(self) -> torch.Tensor | None:
        """Static decode: how many buffer rows a one-token step sees, its own included (a device tensor); else None."""
        return self.filled + 1 if self.static else None

    def extend(self, layer: int, new: LayerState) -> LayerState:
        """Write a decode step's `new` rows at `filled`; the layer's generated tokens so far, the new ones included
        (static decode: the whole buffer, of which `visible` rows count)."""
        buf = self.layers[layer].append(self.filled, new)
        return buf if self.static else buf.narrow(0, self.filled + new.tokens)


class Segment:
    """Positions `start`.. of a forward. `prefix` (None: the segment starts at the sequence start) is read, never
    written. With `collect`, each layer hands what it adds to the state to `emitted` (per-token rows, or the final
    fixed-size state), batch dim first.

    Not a dataclass on purpose: a segment is context the layers share by reference (`emitted`, `dsa_topk`), and
    module wrappers rebuild dataclass arguments (FSDP passes the tensors in its inputs through autograd functions
    and reassembles the containers), which would leave each layer writing into a copy."""

    def __init__(self, start: int = 0, prefix: PrefixView | None = None, cache: DecodeCache | None = None,
                 collect: bool = False) -> None:
        self.start, self.prefix, self.cache, self.collect = start, prefix, cache, collect
        self.emitted: dict[int, LayerState] = {}
        # DSA: the top-k of the last layer with its own indexer in this forward, reused by the "shared" layers
        self.dsa_topk: tuple[torch.Tensor, torch.Tensor] | None = None

    def emit(self, layer: int, state: LayerState) -> None:
        if self.collect:
            self.emitted[layer] = state

    @property
    def parallel(self) -> SequenceParallel | None:
        """The group the prefix is sharded over (None: it is all here)."""
        return None if self.prefix is None else self.prefix.parallel

    def _visible(self, rows: LayerState) -> LayerState:
        p = self.prefix
        return rows.narrow(0, min(max(p.length - p.offset, 0), rows.tokens))

    def prefix_rows(self, layer: int) -> LayerState | None:
        """The visible rows of a per-token layer's prefix state (this rank's, when sharded: maybe none of them);
        None when the prefix is empty."""
        if self.prefix is None or self.prefix.length == 0:
            return None
        return self._visible(self.prefix.layers[layer])

    def prefix_grad(self, layer: int) -> LayerState | None:
        """The dState sink for those rows (exact mode), else None."""
        p = self.prefix
        if p is None or p.grads is None or p.length == 0:
            return None
        return self._visible(p.grads[layer])

    def initial_state(self, layer: int) -> LayerState | None:
        """The fixed-size state a layer starts from (None: from zeros, at the sequence start)."""
        return None if self.prefix is None else self.prefix.layers[layer]
