"""What a step's autograd work holds per token, for the planner: each layer kind's saved bytes, measured on CPU
proxies of one and two layers of that kind (bf16), with the ops whose GPU kernels save other tensors than the CPU
path counted as the GPU kernels save them.

- Attention (dense, gated, absorbed MLA, DSA's sparse attention) saves q, k, v, out and the log-sum-exp on both
  paths (ops/attention.py, ops/sparse_attention.py: flash-style autograd functions), so the CPU measure holds.
- The gated delta rule (Qwen3.5's linear layers) runs flash-linear-attention's chunk kernel on GPU, which saves
  q, k (at the key heads), their L2-norm factors, v, the cumulative gate, beta and the chunk-local matrix A
  [64 per value head]; the torch chunked form on CPU saves about 20x more (its per-chunk matrices). The
  proxies count the kernel's tensors in place of the torch form's.
- Linear layers, norms, the MLP / MoE and the short convolution are the same torch ops on both.

Per-layer checkpointing (`EngineConfig.checkpoint_layers`) keeps each layer's input (hidden x 2 bytes) and one
recomputed layer's activations at a time, its dense MLP run in token tiles (`LayerKind.tiled_saving`), or an
attention layer's whole recompute in query tiles (`LayerKind.query_tiles`): `ActivationProfile.per_token`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..engine.budget import PROBE_TOKENS, activation_bytes_per_token
from ..lora import add_lora
from ..models.registry import build_model, config_from_hf, planner_profile
from ..ops import gated_delta

FLA_CHUNK = 64  # flash-linear-attention's chunk: A holds 64 entries per token and value head


@dataclass(frozen=True)
class LayerKind:
    name: str
    count: int
    bytes_per_token: int  # one layer of this kind, autograd-saved (GPU kernels' tensors)
    tiled_saving: int = 0  # what it holds less when recomputed: its MLP in token tiles (models/common/recompute.py)
    # an attention layer recomputed over this many query tiles (recompute.py) holds one tile's share of its bytes,
    # and for all its tokens `tiled_whole` per token: keys and values, their gradients (fp32), its input's gradient
    query_tiles: int = 1
    tiled_whole: int = 0

    @property
    def recomputed(self) -> int:
        """Bytes per token of one recomputed layer of this kind."""
        if self.query_tiles > 1:
            return -(-self.bytes_per_token // self.query_tiles) + self.tiled_whole
        return self.bytes_per_token - self.tiled_saving


@dataclass(frozen=True)
class ActivationProfile:
    kinds: tuple[LayerKind, ...]
    layers: int
    hidden_bytes: int  # one layer's input per token (the hidden state)
    last_saving: int  # the prompt chunk's last layer only emits its state: what it saves less than a full one
    gpu: bool = True  # measured for the GPU path (else the CPU path's)

    @property
    def whole(self) -> int:
        """Bytes per token of every layer's activations (a chunk or branch under one graph)."""
        return sum(k.count * k.bytes_per_token for k in self.kinds) - self.last_saving

    @property
    def largest(self) -> int:
        """One recomputed layer's activations, the most of any kind (in query or MLP tiles)."""
        return max(k.recomputed for k in self.kinds)

    def per_token(self, checkpoint: bool) -> int:
        """Bytes per token held at the peak of a chunk's (or branch's) backward: every layer's activations, or
        with per-layer checkpointing every layer's input and one recomputed layer's activations."""
        return self.layers * self.hidden_bytes + self.largest if checkpoint else self.whole


def fla_saved_bytes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Bytes flash-linear-attention's chunk_gated_delta_rule saves for q, k [B, T, Hk, dk], v [B, T, Hv, dv] in
    bf16: the L2-normalised q and k at the key heads (grouped value heads need no repeat) with their fp32 norm
    factors; v, the fp32 cumulative gate, beta and A [T, Hv, 64] at the value heads (fla/ops/gated_delta_rule/
    chunk.py's save_for_backward)."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2:]
    return b * t * (hk * 2 * (2 * dk + 4) + hv * (2 * dv + 4 + 2 + 2 * FLA_CHUNK))


@contextmanager
def gpu_kernels_counted() -> Iterator[list[int]]:
    """Within, the torch chunked delta rule saves nothing for autograd that a `saved_tensors_hooks` outside sees;
    the bytes the GPU kernel would save for each call add up in the yielded list's one entry."""
    counted = [0]
    torch_form = gated_delta.chunk_gated_delta_rule

    def as_kernel(q, k, v, g, beta, initial_state=None, *args, **kw):
        counted[0] += fla_saved_bytes(q, k, v)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return torch_form(q, k, v, g, beta, initial_state, *args, **kw)

    gated_delta.chunk_gated_delta_rule = as_kernel
    try:
        yield counted
    finally:
        gated_delta.chunk_gated_delta_rule = torch_form


def _proxies(hf_config: dict) -> list[tuple[str, int, Callable[[int], dict], bool]]:
    """(kind, how many layers, the config of n layers of that kind, whether the last layer is one) for each
    distinct layer kind, as the family's planner profile (models/planner.py) gives them, with a small vocabulary."""
    family = planner_profile(hf_config["model_type"])
    kinds = family.layer_kinds(config_from_hf(hf_config))

    def layers_of(kind: str) -> Callable[[int], dict]:
        return lambda n: {**family.proxy_config(hf_config, kind, n), "vocab_size": 256, "tie_word_embeddings": False}

    return [(k, kinds.count(k), layers_of(k), k == kinds[-1]) for k in dict.fromkeys(kinds)]


def _proxy(cfg: dict, lora: dict | None, dtype: torch.dtype) -> torch.nn.Module:
    """The proxy model of `cfg`. With `lora` it carries the adapters and frozen weights, which save less (no
    input kept for a frozen weight's gradient)."""
    torch.manual_seed(0)
    model = build_model(cfg, dtype=dtype)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    present = [t for t in (lora or {}).get("target_modules", []) if any(n.endswith("." + t) for n in names)]
    if present:  # a proxy of one layer kind has only that kind's modules
        add_lora(model, r=lora["r"], target_modules=present)
    elif lora is not None:
        model.requires_grad_(False)
    return model


def _tiled_saving(model: torch.nn.Module) -> int:
    """Bytes per token a recomputed layer of the proxy's kind holds less with its MLP in token tiles: what its
    feed-forward half (post-attention norm and MLP) saves beside its input, but one tile's share of it."""
    layer = model.decoder_layers[0]
    dtype = next(model.parameters()).dtype
    tiles = layer.mlp.recompute_tiles
    if tiles <= 1:
        return 0
    x = torch.randn(1, PROBE_TOKENS, model.config.hidden_size, dtype=dtype, requires_grad=True)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer._feed_forward(x)
    saved = sum(n for ptr, n in storages.items() if ptr not in weights and ptr != x.untyped_storage().data_ptr())
    per_token = -(-saved // PROBE_TOKENS)
    return per_token - -(-per_token // tiles)


def _query_tiles(model: torch.nn.Module) -> tuple[int, int]:
    """(query tiles, bytes per token held whole) of the proxy's layer recomputed over query tiles; (1, 0) when it
    does not tile (`DecoderLayer.query_tile_count`)."""
    layer = model.decoder_layers[0]
    tiles = layer.query_tile_count
    if tiles <= 1:
        return 1, 0
    dtype = next(model.parameters()).dtype
    keys = layer.mixer.empty_state(1, dtype, "meta").bytes_per_token
    acc = torch.promote_types(dtype, torch.float32).itemsize // dtype.itemsize  # their gradients add up in fp32
    return tiles, (1 + acc) * keys + model.config.hidden_size * dtype.itemsize


def _probe(model: torch.nn.Module, gpu: bool) -> int:
    """Saved bytes per token of a proxy model (`gpu`: the GPU kernels' tensors)."""
    if not gpu:
        return activation_bytes_per_token(model)
    with gpu_kernels_counted() as kernel:
        measured = activation_bytes_per_token(model)
    # the kernel's bytes grow with the tokens alone: per token, over the two probe chunks (1x and 2x PROBE_TOKENS)
    return measured + -(-kernel[0] // (3 * PROBE_TOKENS))


def activation_profile(hf_config: dict, lora: dict | None = None, *, gpu: bool = True,
                       dtype: torch.dtype = torch.bfloat16) -> ActivationProfile:
    """Each layer kind's saved bytes per token, from proxies of one and two layers of it: a layer costs what the
    second one adds; the first probe's difference to one layer is what the last layer of a prompt chunk saves
    less (it only emits its state). `gpu`: the GPU kernels' tensors where they differ (else the CPU path's)."""
    proxies = _proxies(hf_config)  # first: it names a family without a planner profile
    model_cfg = config_from_hf(hf_config)
    kinds, saving = [], 0
    for name, count, layers_of, has_last in proxies:
        single = _proxy(layers_of(1), lora, dtype)
        one = _probe(single, gpu)
        layer = _probe(_proxy(layers_of(2), lora, dtype), gpu) - one
        kinds.append(LayerKind(name, count, layer, _tiled_saving(single), *_query_tiles(single)))
        if has_last:
            saving = max(0, layer - one)
    width = torch.empty(0, dtype=dtype).element_size()
    return ActivationProfile(tuple(kinds), model_cfg.num_hidden_layers, model_cfg.hidden_size * width, saving, gpu)
