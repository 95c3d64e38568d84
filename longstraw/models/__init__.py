"""Model families. Each family maps a transformers `model_type` to an own PyTorch module with HF names."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .checkpoint import iter_tensors, read_config
from .config import DENSE_TYPES, dense_config_from_hf
from .dense import DenseForCausalLM

SUPPORTED_MODEL_TYPES = DENSE_TYPES


def build_model(hf_config: dict, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """A randomly initialised model from a transformers config dict (std 0.02, as transformers initialises)."""
    model = _build(hf_config).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    return model.to(dtype=dtype)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """Load an HF checkpoint directory (config.json + *.safetensors, sharded or not)."""
    cfg = read_config(path)
    with torch.device("meta"):
        model = _build(cfg)
    expected = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: dict[str, torch.Tensor] = {}
    for name, t in iter_tensors(path, device):
        if name not in expected:
            if tied and name == "lm_head.weight":
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg['model_type']} model")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(expected[name].shape)}")
        loaded[name] = t.to(dtype)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device)


def _build(cfg: dict) -> nn.Module:
    mt = cfg.get("model_type")
    if mt in DENSE_TYPES:
        return DenseForCausalLM(dense_config_from_hf(cfg))
    raise ValueError(f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
