"""Model configuration read from a transformers ``config.json`` (no transformers import needed)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

DENSE_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    # the remaining keys of HF `rope_parameters` (factor, low_freq_factor, ...), kept as given
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class DenseConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def fingerprint(self) -> str:
        """Hash of the architecture; a prefix state records it so it is never replayed on another model."""
        d = asdict(self)
        d.pop("raw")
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _rope_from_hf(cfg: dict) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints have `rope_theta` + `rope_scaling`.
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rp.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rp.pop("rope_type", rp.pop("type", "default")) or "default"
    return RopeConfig(theta=theta, rope_type=rope_type, params=tuple(sorted(rp.items())))


def dense_config_from_hf(cfg: dict) -> DenseConfig:
    mt = cfg["model_type"]
    if mt not in DENSE_TYPES:
        raise ValueError(f"model_type {mt!r} is not a dense family; supported: {', '.join(DENSE_TYPES)}")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types) or cfg.get("use_sliding_window"):
        raise ValueError(
            f"{mt} config uses sliding-window layers ({sorted(set(layer_types))}); LongStraw supports full "
            "attention only for dense models. Set use_sliding_window=false in config.json."
        )
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    attention_bias = bool(cfg.get("attention_bias", False))
    return DenseConfig(
        model_type=mt,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope=_rope_from_hf(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # qwen2 always has q/k/v bias and no o bias; llama/qwen3 put attention_bias on q/k/v/o
        attention_bias=True if mt == "qwen2" else attention_bias,
        o_proj_bias=False if mt == "qwen2" else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) if mt == "llama" else False,
        qk_norm=mt == "qwen3",
        raw=cfg,
    )
