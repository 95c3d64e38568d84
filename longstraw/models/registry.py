"""The one table of model families: transformers `model_type` -> (config class, model class, planner profile)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from . import dense, glm_moe_dsa, qwen3_5
from .config import ModelConfig
from .planner import FamilyPlanner


class Family(NamedTuple):
    config: type[ModelConfig]
    model: type[nn.Module]
    planner: FamilyPlanner | None  # what `longstraw plan` needs of it (models/planner.py); None: not plannable


FAMILIES: dict[str, Family] = {
    **{t: Family(dense.DenseConfig, dense.DenseForCausalLM, dense.PLANNER) for t in dense.MODEL_TYPES},
    **{t: Family(qwen3_5.Qwen35Config, qwen3_5.Qwen35ForCausalLM, qwen3_5.PLANNER) for t in qwen3_5.MODEL_TYPES},
    **{t: Family(glm_moe_dsa.GlmMoeDsaConfig, glm_moe_dsa.GlmMoeDsaForCausalLM, glm_moe_dsa.PLANNER)
       for t in glm_moe_dsa.MODEL_TYPES},
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def config_from_hf(cfg: dict) -> ModelConfig:
    """The family config for a transformers config dict; unknown model_type -> error naming the supported ones."""
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        raise ValueError(f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return FAMILIES[mt].config.from_hf(cfg)


def planner_profile(model_type: str) -> FamilyPlanner:
    """The planner profile of `model_type`'s family (models/planner.py); a family registered without one -> an
    error naming it and what to declare."""
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    family = FAMILIES[model_type]
    if family.planner is None:
        raise ValueError(
            f"the {family.config.__name__} family (model_type {model_type!r}) declares no planner profile, so "
            "`longstraw plan` cannot count it: subclass models/planner.py's FamilyPlanner in the family's package "
            "(its layer kinds, proxy configs and attention geometry; see models/dense/planner.py) and register it "
            "in models/registry.py's FAMILIES"
        )
    return family.planner


def build(cfg: dict) -> nn.Module:
    """The family's model for a config dict, parameters uninitialised (use `build_model` for a random one)."""
    family = config_from_hf(cfg)  # first: it names an unsupported model_type
    return FAMILIES[cfg["model_type"]].model(family)


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
