"""Model configuration read from a transformers ``config.json`` (no transformers import needed)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

DENSE_TYPES = ("llama", "qwen2", "qwen3")
QWEN3_5_TYPES = ("qwen3_5", "qwen3_5_text")


def fingerprint(cfg) -> str:
    """Hash of an architecture config; a prefix state records it so it is never replayed on another model."""
    d = asdict(cfg)
    d.pop("raw", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


class _Fingerprinted:
    """Family configs: a prefix state records `fingerprint` so it is never replayed on another architecture."""

    @property
    def fingerprint(self) -> str:
        return fingerprint(self)


@dataclass(frozen=True)
class LayerStateSpec:
    """What one layer keeps of a prompt: elements per token (in the model dtype) and fixed elements."""

    kind: str
    per_token: int = 0
    per_token_nograd: int = 0  # part of per_token that gets no gradient (DSA indexer keys)
    fixed: int = 0  # in the model dtype
    fixed_fp32: int = 0  # kept in fp32 whatever the model dtype (delta-rule state)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    # the remaining keys of HF `rope_parameters` (factor, low_freq_factor, ...), kept as given
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class DenseConfig(_Fingerprinted):
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

    def state_spec(self) -> list[LayerStateSpec]:
        kv = LayerStateSpec("attention K/V", per_token=2 * self.num_key_value_heads * self.head_dim)
        return [kv] * self.num_hidden_layers


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


@dataclass(frozen=True)
class Qwen35Config(_Fingerprinted):
    """Qwen3.5 text model (`qwen3_5_text`, or the text part of a `qwen3_5` multimodal config)."""

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
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "qwen3_5_text"
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.get("partial_rotary_factor", 1.0))

    def state_spec(self) -> list[LayerStateSpec]:
        kv = LayerStateSpec("attention K/V", per_token=2 * self.num_key_value_heads * self.head_dim)
        conv_dim = 2 * self.linear_num_key_heads * self.linear_key_head_dim
        conv_dim += self.linear_num_value_heads * self.linear_value_head_dim
        ssm = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        lin = LayerStateSpec(
            "Gated DeltaNet conv+recurrent", fixed=conv_dim * (self.linear_conv_kernel_dim - 1), fixed_fp32=ssm
        )
        return [kv if t == "full_attention" else lin for t in self.layer_types]


def qwen3_5_config_from_hf(cfg: dict) -> Qwen35Config:
    text = dict(cfg.get("text_config") or cfg) if cfg["model_type"] == "qwen3_5" else dict(cfg)
    tie = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
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
    if text.get("linear_conv_kernel_dim", 4) < 2:
        raise ValueError("linear_conv_kernel_dim must be >= 2")
    heads = text["num_attention_heads"]
    return Qwen35Config(
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        max_position_embeddings=text.get("max_position_embeddings", 32768),
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope=_rope_from_hf(text),
        layer_types=layer_types,
        linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
        linear_key_head_dim=text.get("linear_key_head_dim", 128),
        linear_value_head_dim=text.get("linear_value_head_dim", 128),
        linear_num_key_heads=text.get("linear_num_key_heads", 16),
        linear_num_value_heads=text.get("linear_num_value_heads", 32),
        tie_word_embeddings=tie,
        attention_bias=bool(text.get("attention_bias", False)),
        raw=cfg,
    )


@dataclass(frozen=True)
class GlmMoeDsaConfig(_Fingerprinted):
    """GLM-5 (`glm_moe_dsa`): MLA + DSA indexer attention in every layer, MoE after `first_k_dense_replace`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "glm_moe_dsa"
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def softmax_scale(self) -> float:
        from .common.mla import yarn_softmax_scale

        return yarn_softmax_scale(self.qk_nope_head_dim + self.qk_rope_head_dim, self.rope)

    def state_spec(self) -> list[LayerStateSpec]:
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        full = LayerStateSpec(
            "MLA latent + RoPE key + indexer key", per_token=latent + self.index_head_dim, per_token_nograd=self.index_head_dim
        )
        shared = LayerStateSpec("MLA latent + RoPE key (shared top-k)", per_token=latent)
        return [full if t == "full" else shared for t in self.indexer_types]


def glm_moe_dsa_config_from_hf(cfg: dict) -> GlmMoeDsaConfig:
    n = cfg["num_hidden_layers"]
    n_dense = min(cfg.get("first_k_dense_replace", 3), n)
    mlp_types = tuple(cfg.get("mlp_layer_types") or ["dense"] * n_dense + ["sparse"] * (n - n_dense))
    indexer_types = cfg.get("indexer_types")
    if indexer_types is None:
        pattern = cfg.get("index_topk_pattern")
        if pattern is not None:
            indexer_types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else pattern
        else:  # transformers' schedule: a full indexer every `freq` layers from `offset` on, all full before
            freq, offset = max(cfg.get("index_topk_freq", 1), 1), cfg.get("index_skip_topk_offset", 2)
            indexer_types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    indexer_types = tuple(indexer_types)
    if len(mlp_types) != n or set(mlp_types) - {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types must list {n} of dense/sparse")
    if len(indexer_types) != n or set(indexer_types) - {"full", "shared"} or indexer_types[0] != "full":
        raise ValueError(f"indexer_types must list {n} of full/shared, starting with full")
    if not cfg.get("q_lora_rank"):
        raise ValueError("glm_moe_dsa needs q_lora_rank (the indexer reads the q LoRA residual)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"glm_moe_dsa hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    experts = cfg.get("n_routed_experts", cfg.get("num_experts", 256))
    if experts % cfg.get("n_group", 1):
        raise ValueError("n_routed_experts must be divisible by n_group")
    return GlmMoeDsaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        moe_intermediate_size=cfg.get("moe_intermediate_size", 2048),
        num_hidden_layers=n,
        num_attention_heads=cfg["num_attention_heads"],
        q_lora_rank=cfg["q_lora_rank"],
        kv_lora_rank=cfg.get("kv_lora_rank", 512),
        qk_nope_head_dim=cfg.get("qk_nope_head_dim", 192),
        qk_rope_head_dim=cfg.get("qk_rope_head_dim", 64),
        v_head_dim=cfg.get("v_head_dim", 256),
        index_topk=cfg.get("index_topk", 2048),
        index_head_dim=cfg.get("index_head_dim", 128),
        index_n_heads=cfg.get("index_n_heads", 32),
        n_routed_experts=experts,
        n_shared_experts=cfg.get("n_shared_experts", 1),
        num_experts_per_tok=cfg.get("num_experts_per_tok", 8),
        n_group=cfg.get("n_group", 1),
        topk_group=cfg.get("topk_group", 1),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        max_position_embeddings=cfg.get("max_position_embeddings", 202752),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope=_rope_from_hf(cfg),
        mlp_layer_types=mlp_types,
        indexer_types=indexer_types,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        raw=cfg,
    )
