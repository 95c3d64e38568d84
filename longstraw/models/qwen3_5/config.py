"""Config of the Qwen3.5 text model (`qwen3_5_text`, or the text part of a `qwen3_5` multimodal config)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
# the Gated DeltaNet shapes: transformers' defaults are one model's, never safe to assume for another
LINEAR_KEYS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
               "linear_num_value_heads")


def text_config(cfg: dict) -> dict:
    """The text model's config dict (a copy): a multimodal `qwen3_5` config's `text_config`, else `cfg`."""
    return dict(cfg.get("text_config") or cfg) if cfg["model_type"] == "qwen3_5" else dict(cfg)


@dataclass(frozen=True, kw_only=True)
class Qwen35Config(ModelConfig):
    model_type: str = "qwen3_5_text"
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.get("partial_rotary_factor", 1.0))

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen35Config":
        text = text_config(cfg)
        common = cls.common(text, "qwen3_5", LINEAR_KEYS)
        n = text["num_hidden_layers"]
        interval = text.get("full_attention_interval", 4)
        layer_types = tuple(
            text.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
        )
        unknown = set(layer_types) - {"linear_attention", "full_attention"}
        if unknown or len(layer_types) != n:
            raise ValueError(f"qwen3_5 layer_types must list {n} of linear_attention/full_attention, got {sorted(unknown)}")
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"qwen3_5 hidden_act {text['hidden_act']!r} is not supported (silu only)")
        if text["linear_conv_kernel_dim"] < 2:
            raise ValueError("linear_conv_kernel_dim must be >= 2")
        heads = text["num_attention_heads"]
        # the multimodal layout keeps tie_word_embeddings at the top level
        common["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", common["tie_word_embeddings"]))
        return cls(
            **common,
            num_key_value_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or text["hidden_size"] // heads,
            layer_types=layer_types,
            **{k: text[k] for k in LINEAR_KEYS},
            raw=cfg,
        )
