"""The context of one forward over a segment of tokens: where it starts, the prefix it reads, what it emits.

A prompt chunk (capture, exact-mode recompute) and a batch of replayed branches read a `PrefixView`; a decode
step also writes its new tokens into a `DecodeCache`.

A mixer asks its segment to attend (`own_rows`, then `attend`, or for DSA `select_topk` and `attend_sparse`)
without knowing whether the keys are the segment's own, a decode cache, or a prefix sharded over ranks: the
segment knows its prefix rows, their dState sink (exact mode), its cache and the group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..ops import sparse_attention
from ..ops.attention import decode_attention, segment_attention
from ..ops.gated_delta import gated_delta_rule, split_gated_delta_rule
from ..ops.sparse_attention import select_topk_global, sparse_latent_attention
from ..ops.split_attention import split_chunk_attention
from ..ops.split_sparse_attention import SplitLayout, split_select_topk, split_sparse_attention
from ..parallel.sequence import ONE_RANK, SequenceGroup
from .prefix import RowMap
from .protocol import LayerState, TokenState

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

    def prefix_grad(self, layer: int) -> LayerState | None:
        """The dState sink for those rows (exact mode), else None."""
        p = self.prefix
        if p is None or p.grads is None or p.length == 0:
            return None
        return self._visible(p.grads[layer])

    def initial_state(self, layer: int) -> LayerState | None:
        """The fixed-size state a layer starts from (None: from zeros, at the sequence start)."""
        return None if self.prefix is None else self.prefix.layers[layer]

    # ---- attention: what a mixer asks of its segment ----------------------------------------------------------
    def own_rows(self, layer: int, new: TokenState) -> TokenState:
        """The rows of its own that the segment's queries attend to, given what the layer computed for the
        segment's tokens (`new`, batch dim first): `new` itself, or when decoding, the branch's tokens so far with
        `new` written after them (static decode: the whole buffer, of which `cache.visible` rows count)."""
        return new if self.cache is None else self.cache.extend(layer, new)

    def attend(self, layer: int, q: Tensor, own: TokenState, scale: float,
               heads: Callable[[TokenState], tuple[Tensor, Tensor]], tile: QueryTile | None = None) -> Tensor:
        """Softmax attention of q [B, H, T, d] over the layer's visible prefix and `own` (from `own_rows`):
        causal over a segment's own tokens, or a decode step over its branch so far; merged over the group when
        the prefix is sharded; in exact mode the backward adds dLoss/dPrefix into the prefix's sink.

        `heads(state)` are the (keys, values) of a layer state's rows: [Hkv, N, d] for the prefix, [B, Hkv, L, d]
        for `own` (k and v may be one tensor: absorbed MLA's shared latent head). With `tile`, q are a tile of the
        segment's queries, `own` their own rows, and the keys before them come with the tile."""
        k, v = heads(own)
        lead, lead_grad = (None, None) if tile is None else (tile.lead, tile.lead_grad)
        if self.across_ranks:
            group = self.parallel
            sink = self.prefix_grad(layer)
            block = None
            if tile is not None:  # the earlier blocks' keys come with their ranks' attention of these queries
                sizes, earlier = tile.sizes, None
                if self.split is not None:
                    block = (*tile.block, tile.block_grad, self.split.later)
            elif self.split is not None:
                sizes, earlier = self.split.sizes, self.split.earlier
            else:
                sizes, earlier = [q.shape[2]] * group.size, None
            return split_chunk_attention(q, k, v, scale, heads(self._visible(self.prefix.layers[layer])),
                                         None if sink is None else heads(sink), sizes, earlier, group, lead=lead,
                                         lead_grad=lead_grad, block=block)
        rows = self.prefix_rows(layer)
        prefix = None if rows is None else heads(rows)
        if self.cache is not None:
            return decode_attention(q, k, v, scale, prefix, parallel=self.parallel, own_visible=self.cache.visible)
        sink = self.prefix_grad(layer)
        return segment_attention(q, k, v, scale, prefix, None if sink is None else heads(sink),
                                 parallel=self.parallel, lead=lead, lead_grad=lead_grad)

    def conv_tail(self, layer: int, inputs: Tensor, width: int) -> tuple[Tensor, Tensor]:
        """A causal convolution's context: the last `width` inputs before the segment and those at its end, given
        the segment's inputs [B, dim, T] and the layer's fixed-size state (`.conv` [dim, width]; zeros at the
        sequence start). On a split chunk, the blocks before this rank's supply the first (a halo) and the
        chunk's last blocks the second, the same on every rank."""
        init = self.initial_state(layer)
        b, dim, _ = inputs.shape
        start = inputs.new_zeros(b, dim, width) if init is None else init.conv.to(inputs.dtype).expand(b, -1, -1)
        if self.split is None:
            return start, torch.cat([start, inputs], dim=-1)[..., -width:]
        mine = torch.cat([inputs.new_zeros(b, dim, width), inputs], dim=-1)[..., -width:]
        group, sizes = self.split.group, self.split.sizes
        tails = group.gather_blocks(mine, [b] * group.size, dim=0, autograd=True)
        ordered = [tails[r][..., width - min(width, sizes[r]):] for r in self.split.order]
        before = [tails[r][..., width - min(width, sizes[r]):] for r in self.split.earlier]
        return (torch.cat([start, *before], dim=-1)[..., -width:], torch.cat([start, *ordered], dim=-1)[..., -width:])

    def delta_rule(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
        """The gated delta rule over the segment from the layer's fixed-size state (`.ssm`; zeros at the sequence
        start): (o, final state), see ops/gated_delta.py. On a split chunk the ranks compose their blocks."""
        init = self.initial_state(layer)
        ssm0 = None if init is None else init.ssm.expand(q.shape[0], -1, -1, -1)
        if self.split is None:
            return gated_delta_rule(q, k, v, g, beta, ssm0)
        return split_gated_delta_rule(q, k, v, g, beta, ssm0, self.split.group, self.split.order)

    def select_topk(self, layer: int, k: int, queries: tuple[Tensor, ...],
                    score: Callable[[tuple[Tensor, ...], Tensor], Tensor], keys: Callable[[TokenState], Tensor],
                    own: TokenState):
        """DSA: the top-k positions per query (ties: the lower position) over the whole visible prefix (every
        rank's rows, when sharded) and the own rows: (positions [B, T, k'] ascending, valid [B, T, k']), the same
        on every rank; see `ops.sparse_attention.select_topk`. On a split chunk or spread branches: a
        `SplitSelection` of every rank's queries over the rows this rank holds, for `attend_sparse`.

        `queries` are the indexer's queries ([B, T, ...] each), `score(queries, keys)` their scores [B, T, L]
        over key rows [L, D] (the prefix streams through in blocks of `sparse_attention.key_block`, one block's
        scores alive at a time) or [B, L, D]; `keys(state)` a state's index key rows; `own` the rows from `own_rows`. The segment
        masks the own rows each query may not see."""
        rows = self.prefix_rows(layer)
        if self.across_ranks:
            own_keys = keys(own)
            lay = self._split_layout(own.tokens, own_keys.device)
            kb = sparse_attention.key_block(queries[0], lay.group.size)
            return split_select_topk(queries, score, None if rows is None else keys(rows), own_keys, k, lay, kb)
        kb = sparse_attention.key_block(queries[0])
        count = 0 if rows is None else rows.tokens
        own_scores = score(queries, keys(own))
        device = own_scores.device
        positions = self._row_positions(device)
        # Looping over block numbers, not over range(0, count, kb), lets torch.compile keep `count` symbolic: its
        # guard is on the number of blocks
        blocks = ((torch.arange(b * kb, min((b + 1) * kb, count), device=device) if positions is None
                   else positions[b * kb : (b + 1) * kb],
                   score(queries, keys(rows.map(lambda t: t[..., b * kb : (b + 1) * kb, :]))))
                  for b in range(-(-count // kb)))
        first = self.prefix_length
        mine = (torch.arange(first, first + own_scores.shape[-1], device=device), self._mask_own(own_scores))
        return select_topk_global(blocks, mine, k, self.parallel)

    def visible_positions(self, own_tokens: int) -> int:
        """The most positions a query of the segment sees (on any rank), given its own rows' count."""
        return self.prefix_length + (sum(self.split.sizes) if self.split is not None else own_tokens)

    def _split_layout(self, own_tokens: int, device: torch.device) -> SplitLayout:
        """Who holds which rows and queries, on a split chunk or spread branches."""
        group = self.parallel
        if self.split is not None:
            sizes, starts = self.split.sizes, [a for a, _ in self.split.blocks]
        else:
            sizes, starts = [own_tokens] * group.size, [self.start] * group.size
        return SplitLayout(sizes, starts, self.start, self.prefix_length, self.prefix.row_positions(device),
                           self.spread, group)

    def _row_positions(self, device: torch.device) -> Tensor | None:
        """The positions of the held prefix rows when they are not simply 0.. (a sharded prefix), else None."""
        p = self.prefix
        return None if p is None or p.rows is None or p.rows.blocks[0][0] == 0 and len(p.rows.blocks) == 1 \
            else p.row_positions(device)

    def _mask_own(self, s: Tensor) -> Tensor:
        """-inf where a query may not see an own row: after it (a segment's own tokens), or not yet written (the
        static decode's buffer); a dynamic decode step sees all of its branch so far."""
        if self.cache is None:
            return s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        if (visible := self.cache.visible) is not None:
            return s.masked_fill(torch.arange(s.shape[-1], device=s.device) >= visible, float("-inf"))
        return s

    def attend_sparse(self, layer: int, q: Tensor, own: TokenState, selected, scale: float, vdim: int,
                      rows: Callable[[TokenState], Tensor]) -> Tensor:
        """DSA: softmax attention of q [B, T, H, D] over the `selected` rows (from `select_topk`) of the layer's
        prefix and `own` (from `own_rows`), one shared key/value row set for all heads (absorbed MLA: the
        values are the first `vdim` features of the keys). `rows(state)` are a state's key rows: [N, D] for the
        prefix, [B, L, D] for `own`. Returns [B, T, H, vdim]; in exact mode the backward adds into the sink."""
        pre, sink = self.prefix_rows(layer), self.prefix_grad(layer)
        if self.across_ranks:
            lay = self._split_layout(own.tokens, q.device)
            return split_sparse_attention(q, rows(own), None if pre is None else rows(pre), selected, scale, vdim,
                                          None if sink is None else rows(sink), lay)
        return sparse_latent_attention(
            q, rows(own), None if pre is None else rows(pre), *selected, scale, vdim,
            None if sink is None else rows(sink), length=self.prefix_length,
            row_positions=self._row_positions(q.device), parallel=self.parallel)
