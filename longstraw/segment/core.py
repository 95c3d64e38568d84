"""The context of one forward over a segment of tokens: where it starts, the prefix it reads, what it emits.

A prompt chunk (capture, exact-mode recompute) and a batch of replayed branches read a `PrefixView`; a decode
step also writes its new tokens into a `DecodeCache`; a prompt chunk that the ranks of a group compute together
carries a `ChunkSplit`.

`Segment` is data and plain accessors only: which prefix rows a layer sees (`prefix_rows`, `visible_prefix`),
their dState sink in exact mode (`prefix_grad`), the fixed-size state a layer starts from (`initial_state`), the
rows of its own (`own_rows`), the group and the split. Each mixing primitive is a function of a segment in its own
module beside this one (`attention`, `sparse_attention`, `delta_rule`, `convolution`), which picks the op for the
case (own tokens, decode step, split chunk or spread branches); a new primitive is a new module of that kind, with
no change here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel.sequence import ONE_RANK, SequenceGroup
from ..state import LayerState, RowMap, TokenState

Tensor = torch.Tensor


@dataclass
class PrefixView:
    """Each layer's prefix state with its first `length` tokens visible, and, in exact mode, the dState sinks
    (`grads`, one per layer) that the backward adds dLoss/dPrefix into.

    Sharded over a sequence-parallel group (`parallel`; ONE_RANK: all of it is here), per-token layers hold this
    rank's rows only, at the positions `rows` gives (None: rows are positions 0..); fixed-size states are the
    whole prefix's on every rank."""

    layers: list[LayerState]
    length: int
    grads: dict[int, LayerState] | None = None
    rows: RowMap | None = None
    parallel: SequenceGroup = ONE_RANK

    @property
    def visible_rows(self) -> int:
        """How many of the held rows lie before `length`."""
        return self.length if self.rows is None else self.rows.before(self.length)

    def row_positions(self, device: torch.device) -> torch.Tensor:
        return torch.arange(self.visible_rows, device=device) if self.rows is None else \
            self.rows.positions(device)[: self.visible_rows]

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


@dataclass(frozen=True)
class ChunkSplit:
    """This rank's block of a prompt chunk whose blocks the ranks of `group` compute together (the split schedule,
    parallel/sequence.py): `blocks` are the blocks' (start, end) by rank."""

    blocks: list[tuple[int, int]]
    group: SequenceGroup

    @property
    def sizes(self) -> list[int]:
        return [e - s for s, e in self.blocks]

    @property
    def order(self) -> list[int]:
        """The ranks in the position order of their blocks."""
        return sorted(range(len(self.blocks)), key=lambda r: self.blocks[r][0])

    @property
    def earlier(self) -> list[int]:
        """The ranks whose blocks precede this rank's, in position order."""
        mine = self.blocks[self.group.rank][0]
        return [r for r in self.order if self.blocks[r][0] < mine]

    @property
    def later(self) -> list[int]:
        """The ranks whose blocks follow this rank's, in position order."""
        mine = self.blocks[self.group.rank][0]
        return [r for r in self.order if self.blocks[r][0] > mine]


@dataclass(frozen=True)
class QueryTile:
    """Some consecutive queries of a segment's own tokens that attend on their own (a tile of a recomputed layer,
    models/common/recompute.py): `lead` are the keys and values [B, Hkv, L, d] of the segment's tokens before the
    tile, which they see besides the prefix and their own; on a split chunk, `block` are the keys and values of
    this rank's whole block, which the later blocks' tiles see (the earlier blocks' reach this tile the same way,
    on their ranks). Both are constant to autograd: the backward adds their gradient into `lead_grad` and
    `block_grad` if given. `sizes`: every rank's tile length when the queries meet every rank's rows."""

    lead: tuple[Tensor, Tensor] | None
    sizes: list[int]
    lead_grad: tuple[Tensor, Tensor] | None = None
    block: tuple[Tensor, Tensor] | None = None
    block_grad: tuple[Tensor, Tensor] | None = None


class Segment:
    """Positions `start`.. of a forward. `prefix` (None: the segment starts at the sequence start) is read, never
    written. With `collect`, each layer hands what it adds to the state to `emitted` (per-token rows, or the final
    fixed-size state), batch dim first.

    `routing` routes the MoE layers' tokens to given experts (routing replay); with `record_routing`, each MoE layer
    writes where it sent them into `routed`.

    Not a dataclass on purpose: a segment is context the layers share by reference (`emitted`, `dsa_topk`), and
    module wrappers rebuild dataclass arguments (FSDP passes the tensors in its inputs through autograd functions
    and reassembles the containers), which would leave each layer writing into a copy."""

    def __init__(self, start: int = 0, prefix: PrefixView | None = None, cache: DecodeCache | None = None,
                 collect: bool = False, split: ChunkSplit | None = None, spread: bool = False,
                 checkpoint_layers: bool = False, routing: dict[int, Tensor] | None = None,
                 record_routing: bool = False) -> None:
        self.start, self.prefix, self.cache, self.collect, self.split = start, prefix, cache, collect, split
        # under autograd each layer keeps only its input and reruns in the backward (models/common/recompute.py)
        self.checkpoint_layers = checkpoint_layers
        # spread: the ranks of the prefix's group hold different sequences (each its share of the branches, of
        # one length), whose queries all visit every rank's rows
        self.spread = spread
        self.emitted: dict[int, LayerState] = {}
        # DSA: the top-k of the last layer with its own indexer in this forward, reused by the "shared" layers
        self.dsa_topk: tuple[torch.Tensor, torch.Tensor] | None = None
        # MoE routing replay: by decoder layer, the experts [B, T, top_k] (any integer dtype) the segment's tokens
        # go to instead of their router's choice; a row of -1 leaves that token to its router (padding, fillers)
        self.routing = routing
        # with record_routing, each MoE layer writes the experts it sent the tokens to into `routed` [B, T, top_k]
        self.record_routing = record_routing
        self.routed: dict[int, Tensor] = {}

    def emit(self, layer: int, state: LayerState) -> None:
        if self.collect:
            self.emitted[layer] = state

    def route(self, layer: int, chosen: Tensor, stored: torch.dtype | None = None) -> Tensor:
        """MoE: the experts [B, T, top_k] layer `layer` sends the segment's tokens to, given its router's choice
        `chosen` (that shape): the replayed ones (`routing`) where the segment has them, else `chosen`; written into
        `routed` (in dtype `stored`, if given) when the segment records."""
        forced = None if self.routing is None else self.routing.get(layer)
        if forced is None:
            ids = chosen
        else:
            if forced.shape != chosen.shape:
                raise ValueError(f"the routing replayed for layer {layer} has shape {tuple(forced.shape)}, but the "
                                 f"layer routes {tuple(chosen.shape)} (batch, tokens, top_k): pass one row of expert "
                                 "ids per token of the segment")
            forced = forced.to(device=chosen.device, dtype=chosen.dtype)
            ids = torch.where(forced[..., :1] >= 0, forced, chosen)
        if self.record_routing:
            self.routed[layer] = ids if stored is None else ids.to(stored)
        return ids

    @property
    def across_ranks(self) -> bool:
        """Whether the segment's queries meet every rank's rows through the split ops: a split chunk, or spread
        branches."""
        return self.split is not None or self.spread

    @property
    def parallel(self) -> SequenceGroup:
        """The group the prefix is sharded over (ONE_RANK: it is all here)."""
        return ONE_RANK if self.prefix is None else self.prefix.parallel

    @property
    def prefix_length(self) -> int:
        """The tokens before the segment's own that its queries see: the whole prefix's, on every rank."""
        return 0 if self.prefix is None else self.prefix.length

    def _visible(self, rows: LayerState) -> LayerState:
        return rows.narrow(0, min(self.prefix.visible_rows, rows.tokens))

    def prefix_rows(self, layer: int) -> LayerState | None:
        """The visible rows of a per-token layer's prefix state (this rank's, when sharded: maybe none of them);
        None when the prefix is empty."""
        if self.prefix is None or self.prefix.length == 0:
            return None
        return self._visible(self.prefix.layers[layer])

    def visible_prefix(self, layer: int) -> LayerState:
        """The visible rows of a per-token layer's prefix state held here, maybe none of them (the split ops take
        every rank's rows, an empty block included); the segment must have a prefix."""
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

    # ---- what a mixing primitive reads ----------------------------------------------------------------------
    def own_rows(self, layer: int, new: TokenState) -> TokenState:
        """The rows of its own that the segment's queries attend to, given what the layer computed for the
        segment's tokens (`new`, batch dim first): `new` itself, or when decoding, the branch's tokens so far with
        `new` written after them (static decode: the whole buffer, of which `cache.visible` rows count)."""
        return new if self.cache is None else self.cache.extend(layer, new)

    def visible_positions(self, own_tokens: int) -> int:
        """The most positions a query of the segment sees (on any rank), given its own rows' count."""
        return self.prefix_length + (sum(self.split.sizes) if self.split is not None else own_tokens)
