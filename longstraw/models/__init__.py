"""Model families. Each family maps transformers `model_type`s to an own PyTorch module with HF names."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from torch import nn

from .checkpoint import iter_tensors, read_config
from .config import DENSE_TYPES, QWEN3_5_TYPES, dense_config_from_hf, glm_moe_dsa_config_from_hf, qwen3_5_config_from_hf
from .dense import DenseForCausalLM
from .glm_moe_dsa import GlmMoeDsaForCausalLM
from .qwen3_5 import Qwen35ForCausalLM

FAMILIES = {
    **{t: (dense_config_from_hf, DenseForCausalLM) for t in DENSE_TYPES},
    **{t: (qwen3_5_config_from_hf, Qwen35ForCausalLM) for t in QWEN3_5_TYPES},
    "glm_moe_dsa": (glm_moe_dsa_config_from_hf, GlmMoeDsaForCausalLM),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
log = logging.getLogger("longstraw")
# checkpoint prefixes that hold no text-model weights (vision tower, multi-token-prediction heads)
IGNORED_PREFIXES = ("model.visual.", "mtp.")
RENAMED_PREFIXES = {"model.language_model.": "model."}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def config_from_hf(cfg: dict):
    """The family config for a transformers config dict; unknown model_type -> error naming the supported ones."""
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        raise ValueError(f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return FAMILIES[mt][0](cfg)


def _build(cfg: dict) -> nn.Module:
    fc = config_from_hf(cfg)
    return FAMILIES[cfg["model_type"]][1](fc)


def _cast(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """model.to(dtype), except the tensors the family keeps in at least fp32 (router, indexer head weights)."""
    model.to(dtype=dtype)
    keep = getattr(model, "fp32_suffixes", ())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(keep):
            t.data = t.data.to(torch.promote_types(dtype, torch.float32))
    return model


def build_model(hf_config: dict, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """A randomly initialised model from a transformers config dict (std 0.02 for matrices, as transformers)."""
    model = _build(hf_config).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() >= 2:
                p.normal_(0.0, 0.02)
            # 1-D parameters (norm weights, A_log, dt_bias) keep their modules' own initialisation
    return _cast(model, dtype)


def _checkpoint_name(name: str, layers: int) -> str | None:
    """Map a checkpoint key to our parameter name (None: not part of the text model)."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    for old, new in RENAMED_PREFIXES.items():
        if name.startswith(old):
            name = new + name[len(old) :]
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= layers:  # extra layers beyond num_hidden_layers are MTP heads
        return None
    return name


def _fuse_experts(per_expert: dict[str, dict[int, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down checkpoint tensors -> fused gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    fused = {}
    for prefix, experts in per_expert.items():
        n = max(experts) + 1
        missing = [e for e in range(n) if set(experts.get(e, {})) != {"gate", "up", "down"}]
        if missing:
            raise ValueError(f"{prefix}: experts {missing[:5]} lack some of gate/up/down_proj in the checkpoint")
        fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in range(n)])
        fused[f"{prefix}.down_proj"] = torch.stack([experts[e]["down"] for e in range(n)])
    return fused


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """Load an HF checkpoint directory (config.json + *.safetensors, sharded or not)."""
    cfg = read_config(path)
    with torch.device("meta"):
        model = _build(cfg)
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    tied = getattr(model.config, "tie_word_embeddings", False)
    keep = getattr(model, "fp32_suffixes", ())
    layers = model.config.num_hidden_layers
    raw: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    ignored = 0
    for key, t in iter_tensors(path, device):
        name = _checkpoint_name(key, layers)
        if name is None or (tied and name == "lm_head.weight"):
            ignored += name is None
            continue
        if m := _EXPERT.match(name):
            per_expert.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
            continue
        raw[name] = t
    raw.update(_fuse_experts(per_expert))
    loaded: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name not in expected:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg['model_type']} model")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(expected[name].shape)}")
        loaded[name] = t.to(torch.promote_types(dtype, torch.float32) if name.endswith(keep) else dtype)
    if ignored:
        log.info("ignored %d checkpoint tensors outside the text model (vision tower, MTP heads)", ignored)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device)
