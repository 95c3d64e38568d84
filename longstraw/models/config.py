"""What the family configs share: reading a transformers config.json dict with clear errors, the common fields,
and the architecture fingerprint a prefix state records (no transformers import needed)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from .common.rope import RopeConfig

# keys every family needs: they set the shapes, and a wrong guess would load the checkpoint into the wrong model
COMMON_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def require(cfg: dict, family: str, keys: Iterable[str]) -> None:
    """ValueError naming every missing key at once."""
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise ValueError(
            f"{family} config lacks {', '.join(missing)}: these set the model's shapes and have no safe default; "
            "use the checkpoint's own config.json (transformers' save_pretrained writes them all)"
        )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Fields of every family. A family config adds its own and is built by its `from_hf(cfg)`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def fingerprint(self) -> str:
        """Hash of the architecture; a prefix state records it so it is never replayed on another model."""
        d = asdict(self)
        d.pop("raw", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    @staticmethod
    def common(cfg: dict, family: str, extra_required: Iterable[str] = (), max_positions: int = 32768,
               eps: float = 1e-6) -> dict:
        """The shared fields' values from a config dict (`max_positions`, `eps`: the family's defaults), after
        checking that the required keys are there."""
        require(cfg, family, (*COMMON_REQUIRED, *extra_required))
        return dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            max_position_embeddings=cfg.get("max_position_embeddings", max_positions),
            rms_norm_eps=cfg.get("rms_norm_eps", eps),
            rope=RopeConfig.from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )
