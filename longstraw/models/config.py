"""What the family configs share: reading a transformers config.json dict with clear errors, the common fields,
and the architecture fingerprint a prefix state records (no transformers import needed)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from .common.rope import SCALING_ROPE, RopeConfig

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

    @property
    def max_positions(self) -> int:
        """The positions the model accepts: with RoPE scaling by a factor (linear, llama3, yarn),
        original_max_position_embeddings (else max_position_embeddings) x factor, as vLLM and transformers users
        read a scaled config; max_position_embeddings when that is larger, or without scaling."""
        factor = self.rope.get("factor")
        if self.rope.rope_type not in SCALING_ROPE or not factor or factor <= 1:
            return self.max_position_embeddings
        return max(self.max_position_embeddings, int(self._original_positions * factor))

    @property
    def _original_positions(self) -> int:
        return self.rope.get("original_max_position_embeddings") or self.max_position_embeddings

    def positions_error(self, what: str, positions: int) -> str:
        """One line for `what` (e.g. "prompt of 2,100,000 tokens"), which needs `positions` positions, past the
        model's: the numbers, and the RoPE scaling that extends them (the smallest power-of-two factor over the
        original positions that covers them)."""
        kind, factor = self.scaling_for(positions).split(":")
        return (f"{what} exceeds the model's {self.max_positions:,} positions; extend them with RoPE scaling: "
                f"`rope_scaling: {{rope_type: {kind}, factor: {factor}}}` in the run config's model section "
                f"(or --rope-scaling {kind}:{factor})")

    def scaling_for(self, positions: int) -> str:
        """The `--rope-scaling` (TYPE:FACTOR) that makes the model accept `positions`: the config's scaling type
        (yarn if it has none), the smallest power-of-two factor over its original positions that covers them."""
        kind = self.rope.rope_type if self.rope.rope_type in SCALING_ROPE else "yarn"
        factor = 2
        while self._original_positions * factor < positions:
            factor *= 2
        return f"{kind}:{factor}"

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


def with_rope_scaling(cfg: dict, scaling: dict | None) -> dict:
    """`cfg` (a transformers config dict; not changed) with the RoPE scaling `scaling` merged into its rope
    parameters: the one place a run's `rope_scaling` override (or `--rope-scaling`) reaches a model config.

    `scaling` is a dict as HF writes `rope_scaling`: rope_type (or type) linear, llama3 or yarn, factor > 1, and
    optionally original_max_position_embeddings (default: the config's own original positions, else its
    max_position_embeddings) and the type's other keys (beta_fast, low_freq_factor, ...). It updates the dict
    the config already uses (`rope_parameters`, or an old config's `rope_scaling`; that of `text_config` in a
    multimodal config), so rope_theta and partial_rotary_factor stay; max_position_embeddings is kept as is."""
    if not scaling:
        return cfg
    s = dict(scaling)
    kind = s.pop("rope_type", None) or s.pop("type", None)
    s.pop("type", None)
    if kind not in SCALING_ROPE:
        raise ValueError(f"rope_scaling rope_type {kind!r} is not a scaling type; use one of {', '.join(SCALING_ROPE)}")
    factor = s.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise ValueError(f"rope_scaling factor must be a number > 1, got {factor!r}")
    out = dict(cfg)
    nested = isinstance(out.get("text_config"), dict)
    target = dict(out["text_config"]) if nested else out
    key = "rope_parameters" if target.get("rope_parameters") or not target.get("rope_scaling") else "rope_scaling"
    old = dict(target.get(key) or {})
    old.pop("type", None)
    original = (s.get("original_max_position_embeddings") or old.get("original_max_position_embeddings")
                or target.get("max_position_embeddings"))
    new = {**old, **s, "rope_type": kind}
    if original:
        new["original_max_position_embeddings"] = int(original)
    if kind == "llama3" and (missing := [k for k in ("low_freq_factor", "high_freq_factor") if k not in new]):
        raise ValueError(f"rope_scaling of type llama3 needs {' and '.join(missing)} (the config has none)")
    target[key] = new
    if nested:
        out["text_config"] = target
    return out
