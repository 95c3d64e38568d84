"""The decoder skeleton every family shares: embed -> layers (mixer + MLP, pre-norm residuals) -> norm -> head."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch
from torch import nn

from ...segment import Segment
from ...state import LayerState
from .head import chunked_logprobs, default_head_chunk
from .mixer import TokenMixer
from .moe import MoE
from .recompute import query_tiled, recomputed, tile_bounds, token_tiled
from .rope import Rotary


class DecoderLayer(nn.Module):
    """Pre-norm block. Subclasses register `self_attn`/`linear_attn`, `mlp`, then the two norms (HF order)."""

    mixer_name = "self_attn"

    @property
    def mixer(self) -> TokenMixer:
        return getattr(self, self.mixer_name)

    def forward(self, x: torch.Tensor, rope, seg: Segment) -> torch.Tensor:
        return self._block(x, rope, seg)

    def _block(self, x: torch.Tensor, rope, seg: Segment) -> torch.Tensor:
        if bounds := self.query_tiles(x, seg):
            out, state = query_tiled(self, x, rope, seg, bounds, self._weights(self))
            seg.emit(self.mixer.layer_idx, state)
            return out
        x = x + self.mixer(self.input_layernorm(x), rope, seg)
        if not (seg.checkpoint_layers and torch.is_grad_enabled()):
            return x + self._feed_forward(x, seg)
        weights = self._weights(self.post_attention_layernorm, self.mlp)
        return x + token_tiled(partial(self._feed_forward, seg=seg), x, self.mlp.recompute_tiles, weights)

    @staticmethod
    def _weights(*modules: nn.Module) -> list[nn.Parameter]:
        return [p for m in modules for p in m.parameters() if p.requires_grad]

    @property
    def query_tile_count(self) -> int:
        """How many query tiles this layer recomputes over (1: it recomputes whole): as many as its MLP's
        recompute tiles, when its mixer can (one tile's activations then stay near two of the layer's inputs)."""
        return self.mlp.recompute_tiles if self.mixer.tiles_queries else 1

    def query_tiles(self, x: torch.Tensor, seg: Segment) -> list[list[tuple[int, int]]] | None:
        """Under per-layer checkpointing, every rank's query tiles (`recompute.tile_bounds`) when this layer
        recomputes itself over tiles of its queries, else None."""
        if not (seg.checkpoint_layers and torch.is_grad_enabled() and seg.cache is None):
            return None
        t = x.shape[1]
        sizes = seg.split.sizes if seg.split is not None else [t] * (seg.parallel.size if seg.across_ranks else 1)
        return tile_bounds(sizes, self.query_tile_count)

    def _tile_block(self, x: torch.Tensor, rope, own, tile, seg: Segment) -> torch.Tensor:
        """The block's output for a tile of its tokens (x: their input), `own` and `tile` the tile's keys and
        values and those before it (recompute.py)."""
        h = x + self.mixer.tile_forward(self.input_layernorm(x), rope, own, tile, seg)
        return h + self._feed_forward(h, seg)

    def _feed_forward(self, x: torch.Tensor, seg: Segment | None = None) -> torch.Tensor:
        """The post-attention norm and MLP; a MoE routes through `seg` (routing replay and recording)."""
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            return self.mlp(h, seg, self.mixer.layer_idx)
        return self.mlp(h)

    # Capture returns what the layer emitted beside its output. FSDP (`parallel/fsdp.py`) registers both as
    # forward methods and hooks the tensors they return, so a gradient that enters the layer through its emitted
    # state (exact mode's prompt backward starts there) finds the layer's parameters gathered.
    def capture(self, x: torch.Tensor, rope, seg: Segment) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """`forward`, and the differentiable tensors this layer emitted into `seg`."""
        return self._block(x, rope, seg), self._emitted(seg)

    def emit_state(self, x: torch.Tensor, rope, seg: Segment) -> tuple[torch.Tensor, ...]:
        """The last layer in capture: its mixer's state only (nothing after the mixer is needed)."""
        self.mixer.emit_state(self.input_layernorm(x), rope, seg)
        return self._emitted(seg)

    def _emitted(self, seg: Segment) -> tuple[torch.Tensor, ...]:
        new = seg.emitted.get(self.mixer.layer_idx)
        return () if new is None else new.differentiable()


class TextModel(nn.Module):
    """embed_tokens -> layers -> norm, with the rotary embedding shared by the layers (HF names and order)."""

    def __init__(self, cfg, layer: type[DecoderLayer], norm: type[nn.Module], rotary_dim: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = Rotary(cfg.rope, rotary_dim, cfg.max_position_embeddings)


class CausalLM(nn.Module):
    """The `PrefixLM` of every family (models/protocol.py). `forward(input_ids)` -> logits [B, T, V]; with a
    `Segment`, positions seg.start.. over a prefix state. A family passes its layer class, final norm class and
    rotary dims."""

    fp32_suffixes: tuple[str, ...] = ()

    def __init__(self, cfg, layer: type[DecoderLayer], norm: type[nn.Module], rotary_dim: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg, layer, norm, rotary_dim)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def empty_state(self, tokens: int, dtype: torch.dtype, device: torch.device | str) -> list[LayerState]:
        return [layer.mixer.empty_state(tokens, dtype, device) for layer in self.model.layers]

    def empty_cache(self, rows: int, tokens: int, dtype: torch.dtype, device: torch.device | str
                    ) -> dict[int, LayerState]:
        """Per-branch buffers for decoding `tokens` tokens, for the layers whose state grows with tokens."""
        states = self.empty_state(tokens, dtype, device)
        return {i: buf for i, s in enumerate(states) if (buf := s.decode_buffer(rows)) is not None}

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def layers_stand_alone(self) -> bool:
        """Whether each layer reads only its own state (no DSA layer reuses another layer's selection), so that
        the layers may run over the chunks one layer at a time."""
        return not any(layer.mixer.reads_other_layers for layer in self.model.layers)

    def embed(self, input_ids: torch.Tensor, seg: Segment):
        """The embeddings [B, T, hidden] of positions seg.start.. and their rotary (cos, sin). (An entry point of
        its own, which FSDP gathers the root unit for; the model's other methods call `_start`.)"""
        return self._start(input_ids, seg)

    def _start(self, input_ids: torch.Tensor, seg: Segment):
        x = self.model.embed_tokens(input_ids)
        return x, self.model.rotary_emb(seg.start, input_ids.shape[1], x.dtype, x.device)

    @staticmethod
    def _layer(fn, x: torch.Tensor, rope, seg: Segment, layer: DecoderLayer | None = None):
        """fn(x, rope, seg), one layer's step: checkpointed when the segment asks for it and autograd records,
        unless `layer` (fn's layer, for its output) recomputes itself over query tiles."""
        if seg.checkpoint_layers and torch.is_grad_enabled() and not (layer and layer.query_tiles(x, seg)):
            return recomputed(fn, x, rope, seg)
        return fn(x, rope, seg)

    def forward(self, input_ids: torch.Tensor, seg: Segment | None = None, logits_from: int = 0) -> torch.Tensor:
        """`logits_from` limits the LM head to positions >= it (GRPO scores only responses)."""
        seg = seg or Segment()
        x, rope = self._start(input_ids, seg)
        for layer in self.model.layers:
            x = self._layer(layer, x, rope, seg, layer)
        return self.lm_head(self.model.norm(x[:, logits_from:]))

    def token_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor, seg: Segment | None = None,
                       logits_from: int = 0, head_chunk: int | None = None, entropy: bool = False
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """log softmax(logits)[targets] [B, T - logits_from] of positions >= `logits_from` (targets: that shape),
        in fp32 (fp64 for fp64 models), as `forward` + `token_logprobs` would give, but the norm, LM head and
        log-softmax run over `head_chunk` tokens at a time (default: `default_head_chunk(vocab)`, 256 MiB of fp32
        logits), each chunk recomputed in the backward (head.py): the logits of all the tokens never exist at
        once. With `entropy`, also each position's entropy (no autograd): (logp, entropy)."""
        seg = seg or Segment()
        x, rope = self._start(input_ids, seg)
        for layer in self.model.layers:
            x = self._layer(layer, x, rope, seg, layer)
        chunk = default_head_chunk(self.config.vocab_size) if head_chunk is None else head_chunk
        return chunked_logprobs(self._head, x[:, logits_from:], targets, chunk, entropy)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(x))

    def emit_states(self, input_ids: torch.Tensor, seg: Segment) -> None:
        """Prompt capture: every layer emits its state into `seg`; the last one skips its output, and no LM head."""
        x, rope = self._start(input_ids, seg)
        *layers, last = self.model.layers
        for layer in layers:
            x, _ = self._layer(layer.capture, x, rope, seg, layer)
        self._layer(last.emit_state, x, rope, seg)

    def emit_states_by_layer(self, chunks: list[tuple[torch.Tensor, Segment]], stored: Callable[[int, int], None],
                             hold: Callable[[nn.Module], AbstractContextManager] = lambda _: nullcontext()) -> None:
        """Prompt capture in layer-major order: each layer runs over every chunk (input ids [1, t] and its segment,
        in order) before the next layer starts, inside `hold(layer)` (ZeRO-3: the layer's weights gathered once,
        not once per chunk). `stored(layer, chunk)` is called after each, to add what the layer emitted for the
        chunk to the state before the next chunk reads it. Holds every chunk's hidden states meanwhile."""
        starts = [self._start(ids, seg) for ids, seg in chunks]
        xs, ropes = [x for x, _ in starts], [rope for _, rope in starts]
        last = len(self.model.layers) - 1
        for j, layer in enumerate(self.model.layers):
            with hold(layer):
                for i, (_, seg) in enumerate(chunks):
                    if j < last:
                        xs[i], _ = layer.capture(xs[i], ropes[i], seg)
                    else:
                        layer.emit_state(xs[i], ropes[i], seg)
                    stored(j, i)
