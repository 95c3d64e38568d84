"""Config of the dense families (llama, qwen2, qwen3) from a transformers config.json dict."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig

MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True, kw_only=True)
class DenseConfig(ModelConfig):
    num_key_value_heads: int
    head_dim: int
    o_proj_bias: bool = False  # attention_bias: q/k/v bias
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf(cls, cfg: dict) -> "DenseConfig":
        mt = cfg["model_type"]
        if mt not in MODEL_TYPES:
            raise ValueError(f"model_type {mt!r} is not a dense family; supported: {', '.join(MODEL_TYPES)}")
        layer_types = cfg.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types) or cfg.get("use_sliding_window"):
            raise ValueError(
                f"{mt} config uses sliding-window layers ({sorted(set(layer_types))}); LongStraw supports full "
                "attention only for dense models. Set use_sliding_window=false in config.json."
            )
        common = cls.common(cfg, mt)
        heads = cfg["num_attention_heads"]
        bias = common["attention_bias"]
        return cls(
            **common | {"attention_bias": True if mt == "qwen2" else bias},  # qwen2: always q/k/v bias, no o bias
            model_type=mt,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            o_proj_bias=False if mt == "qwen2" else bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if mt == "llama" else False,
            qk_norm=mt == "qwen3",
            raw=cfg,
        )
