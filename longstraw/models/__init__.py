"""Model families. Each family maps a transformers `model_type` to an own PyTorch module with HF names."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import logging

from .checkpoint import iter_tensors, read_config
from .config import DENSE_TYPES, QWEN3_5_TYPES, dense_config_from_hf, qwen3_5_config_from_hf
from .dense import DenseForCausalLM
from .qwen3_5 import Qwen35ForCausalLM

SUPPORTED_MODEL_TYPES = DENSE_TYPES + QWEN3_5_TYPES
log = logging.getLogger("longstraw")
# checkpoint prefixes that hold no text-model weights (vision tower, multi-token-prediction head)
IGNORED_PREFIXES = ("model.visual.", "mtp.")
RENAMED_PREFIXES = {"model.language_model.": "model."}


def config_from_hf(cfg: dict):
    """The family config for a transformers config dict; unknown model_type -> error naming the supported ones."""
    mt = cfg.get("model_type")
    if mt in DENSE_TYPES:
        return dense_config_from_hf(cfg)
    if mt in QWEN3_5_TYPES:
        return qwen3_5_config_from_hf(cfg)
    raise ValueError(f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


def _checkpoint_name(name: str) -> str | None:
    """Map a checkpoint key to our parameter name (None: not part of the text model)."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    for old, new in RENAMED_PREFIXES.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def build_model(hf_config: dict, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """A randomly initialised model from a transformers config dict (std 0.02, as transformers initialises)."""
    model = _build(hf_config).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() >= 2:
                p.normal_(0.0, 0.02)
            # 1-D parameters (norm weights, A_log, dt_bias) keep their modules' own initialisation
    return model.to(dtype=dtype)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """Load an HF checkpoint directory (config.json + *.safetensors, sharded or not)."""
    cfg = read_config(path)
    with torch.device("meta"):
        model = _build(cfg)
    expected = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: dict[str, torch.Tensor] = {}
    ignored = 0
    for key, t in iter_tensors(path, device):
        name = _checkpoint_name(key)
        if name is None:
            ignored += 1
            continue
        if name not in expected:
            if tied and name == "lm_head.weight":
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg['model_type']} model")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(expected[name].shape)}")
        loaded[name] = t.to(dtype)
    if ignored:
        log.info("ignored %d checkpoint tensors outside the text model (%s)", ignored, ", ".join(IGNORED_PREFIXES))
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device)


def _build(cfg: dict) -> nn.Module:
    fc = config_from_hf(cfg)
    return Qwen35ForCausalLM(fc) if fc.model_type in QWEN3_5_TYPES else DenseForCausalLM(fc)
