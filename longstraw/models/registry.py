"""The one table of model families: transformers `model_type` -> (config class, model class)."""

from __future__ import annotations

import torch
from torch import nn

from . import dense, glm_moe_dsa, qwen3_5
from .config import ModelConfig

FAMILIES: dict[str, tuple[type[ModelConfig], type[nn.Module]]] = {
    **{t: (dense.DenseConfig, dense.DenseForCausalLM) for t in dense.MODEL_TYPES},
    **{t: (qwen3_5.Qwen35Config, qwen3_5.Qwen35ForCausalLM) for t in qwen3_5.MODEL_TYPES},
    **{t: (glm_moe_dsa.GlmMoeDsaConfig, glm_moe_dsa.GlmMoeDsaForCausalLM) for t in glm_moe_dsa.MODEL_TYPES},
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def config_from_hf(cfg: dict) -> ModelConfig:
    """The family config for a transformers config dict; unknown model_type -> error naming the supported ones."""
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        raise ValueError(f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return FAMILIES[mt][0].from_hf(cfg)


def build(cfg: dict) -> nn.Module:
    """The family's model for a config dict, parameters uninitialised (use `build_model` for a random one)."""
    family = config_from_hf(cfg)  # first: it names an unsupported model_type
    return FAMILIES[cfg["model_type"]][1](family)


def cast(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """model.to(dtype), except the tensors the family keeps in at least fp32 (router, indexer head weights)."""
    model.to(dtype=dtype)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(model.fp32_suffixes):
            t.data = t.data.to(torch.promote_types(dtype, torch.float32))
    return model


def build_model(hf_config: dict, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """A randomly initialised model from a transformers config dict (std 0.02 for matrices, as transformers)."""
    model = build(hf_config).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() >= 2:
                p.normal_(0.0, 0.02)
            # 1-D parameters (norm weights, A_log, dt_bias) keep their modules' own initialisation
    return cast(model, dtype)
