"""Rotary position embeddings with the HF `rope_parameters` variants that are position-independent."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")
SCALING_ROPE = ("linear", "llama3", "yarn")  # the types whose factor extends the positions


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    # the remaining keys of HF `rope_parameters` (factor, low_freq_factor, ...), kept as given
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    @classmethod
    def from_hf(cls, cfg: dict) -> "RopeConfig":
        # transformers >= 5 writes `rope_parameters`; older checkpoints have `rope_theta` + `rope_scaling`
        rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rp.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rp.pop("rope_type", rp.pop("type", "default")) or "default"
        return cls(theta=theta, rope_type=rope_type, params=tuple(sorted(rp.items())))


def inverse_frequencies(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for `dim` rotary dims and the cos/sin scale, following transformers' definitions.

    Always computed on the CPU in fp32 (also while a model is being built on the meta device)."""
    base = rope.theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    kind = rope.rope_type
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / rope.get("factor"), 1.0
    if kind == "llama3":
        factor, lo, hi = rope.get("factor"), rope.get("low_freq_factor"), rope.get("high_freq_factor")
        old_len = rope.get("original_max_position_embeddings") or max_positions
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(rope, dim, max_positions)
    raise ValueError(
        f"rope_type {kind!r} is not supported (position-dependent scaling cannot be replayed from a stored "
        f"prefix state); supported: {', '.join(SUPPORTED_ROPE)}"
    )


def _yarn(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    base = rope.theta
    orig = rope.get("original_max_position_embeddings") or max_positions
    factor = rope.get("factor") or max_positions / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.get("attention_factor")
    if attn is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr_dim(fast), corr_dim(slow)
    if rope.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn)


class Rotary(nn.Module):
    """Computes (cos, sin) for a contiguous range of positions; rotate-half convention (Llama/Qwen).

    `inv_freq` is a non-persistent fp32 buffer: it follows the model to its device (`.to`, `.cuda`, `to_empty`, or
    the device it is built on), so the first compiled call finds it there (a lazy move inside the compiled forward
    would skip CUDA graphs and recompile), and it stays out of the state dict (HF checkpoints load as they are).
    Whatever a move asks, it is recomputed from the fp32 CPU values: `model.to(bf16)` does not round it, and a
    model built on the meta device gets the real values at `to_empty` / `.to(device)`."""

    def __init__(self, rope: RopeConfig, dim: int, max_positions: int) -> None:
        super().__init__()
        self._inv_freq_fp32, self.scale = inverse_frequencies(rope, dim, max_positions)  # on the CPU, always
        # the device the model is built on (the default device, e.g. under `with torch.device("meta")`)
        self.register_buffer("inv_freq", self._inv_freq_fp32.to(torch.empty(0).device, copy=True), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        # nn.Module's moves and casts (`to`, `cuda`, `to_empty`, `half`, ...) all come here: find only the device
        # `fn` sends a tensor to, and place the fp32 values there
        self.inv_freq = self._inv_freq_fp32.to(_destination(fn, self.inv_freq.device), copy=True)
        return self

    def forward(
        self, start: int | torch.Tensor, length: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`start` may be a 0-dim device tensor (the static decode: no host value, the same graph every step)."""
        if self.inv_freq.device != torch.device(device):
            raise ValueError(f"rotary inv_freq is on {self.inv_freq.device} but the positions are asked on {device}: "
                             "move the whole model to that device (model.to(device)), not only its parameters")
        pos = torch.arange(length, device=device, dtype=torch.float32) + start  # exact: positions < 2^24
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def _destination(fn, current: torch.device) -> torch.device:
    """The device nn.Module's tensor function `fn` moves a tensor on `current` to. From the meta device a move
    that needs the values fails (torch cannot copy out of meta): that is a move to a real device, found with a
    host probe (the values are recomputed anyway)."""
    try:
        return fn(torch.empty(0, device=current)).device
    except NotImplementedError:
        if current.type != "meta":
            raise
        return fn(torch.empty(0)).device


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [T, rotary_dim]. Partial rotary (rotary_dim < head_dim) rotates the
    first rotary_dim features and passes the rest through (Qwen3.5)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek/GLM layout: pairs (x0, x1), (x2, x3), ... rotate together; the output lists the rotated even
    features, then the rotated odd ones (as transformers does). cos/sin: [T, rotary_dim] = cat(freqs, freqs);
    x: [..., T, rotary_dim]."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def yarn_softmax_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """qk_head_dim^-0.5, times mscale^2 when YaRN sets mscale_all_dim (as transformers' GLM/DeepSeek)."""
    scale = qk_head_dim**-0.5
    m_all = rope.get("mscale_all_dim") if rope.rope_type != "default" else None
    if m_all:
        factor = rope.get("factor")
        m = 0.1 * m_all * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    return scale
