"""LoRA adapters on LongStraw's own modules, by PEFT (`inject_adapter_in_model`), and their files in PEFT's format.

LongStraw's parameter names equal transformers', so PEFT's target names (`q_proj`, `v_proj`, `gate_proj`, ...)
mean the modules users expect, and an adapter saved here loads with `PeftModel.from_pretrained` on the
transformers model (`save_adapter`). PEFT freezes everything but the adapters: the optimizer holds adapter
parameters only, and in exact mode the prompt backward computes no gradient of any base weight, only the inputs'
and the adapters' (cheaper than full fine-tuning; `bench/grpo_step.py --lora`).

What PEFT cannot wrap here, and why:
- MLA's `kv_b_proj` (GLM-5): the absorbed attention reads its weight directly (never calls the module), so an
  adapter on it would be silently ignored. Its other projections (`q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`,
  `o_proj`) wrap.
- routed MoE experts: stored fused as parameters (`experts.gate_up_proj`, `experts.down_proj`, as transformers
  stores them), not modules; the shared experts and dense MLPs wrap. A `down_proj` target also reaches the
  experts' fused `down_proj` through PEFT's parameter wrapper; such a model is not expert-parallel
  (parallel/experts.py).
- Gated DeltaNet's `conv1d` (read directly) and the DSA indexer's `weights_proj` (its selection is not
  differentiated).
Adapter dropout is refused: exact mode recomputes prompt chunks and needs the same forward each time.

PEFT is imported on use (`pip install peft`, in the `lora` extra).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
UNWRAPPABLE = {
    "kv_b_proj": "MLA's absorbed attention reads kv_b_proj's weight directly, so an adapter there would be ignored",
    "conv1d": "Gated DeltaNet reads its conv1d weight directly",
    "weights_proj": "the DSA indexer's selection is not differentiated",
    "experts": "routed MoE experts are stored fused as parameters, not modules PEFT can wrap",
    "gate_up_proj": "routed MoE experts are stored fused as parameters, not modules PEFT can wrap",
}
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."  # PeftModel's key prefix for the wrapped model's names


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError("LoRA adapters need PEFT: pip install peft (or longstraw's `lora` extra)") from None
    return peft


def add_lora(model: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
             target_modules: Sequence[str] = DEFAULT_TARGETS) -> nn.Module:
    """Add LoRA adapters (rank `r`, scale alpha / r) to the linear modules named `target_modules` (name suffixes,
    as PEFT matches them), in place; every other parameter is frozen. Returns the model."""
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"LoRA rank r must be a positive integer, got {r!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be > 0, got {alpha!r}")
    if dropout:
        raise ValueError(f"LoRA dropout {dropout} is not supported: exact mode recomputes prompt chunks and needs "
                         "the same forward each time; set dropout: 0")
    if has_lora(model):
        raise ValueError("the model has LoRA adapters already; add them once")
    targets = list(target_modules)
    check_lora_targets(model, targets)
    peft = _peft()
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none")
    peft.inject_adapter_in_model(config, model)  # leaves its config on the model: what `lora_spec` reads
    return model


def check_lora_targets(model: nn.Module, targets: Sequence[str]) -> None:
    """ValueError unless every target names (a suffix of) a linear module of `model` that PEFT can adapt."""
    if not targets:
        raise ValueError("target_modules is empty; name the modules to adapt, e.g. [q_proj, v_proj]")
    for t in targets:
        if t in UNWRAPPABLE:
            raise ValueError(f"LoRA target {t!r} cannot be adapted: {UNWRAPPABLE[t]}")
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for t in targets:
        if not any(n == t or n.endswith("." + t) for n in linear):
            names = sorted({n.rsplit(".", 1)[-1] for n in linear} - set(UNWRAPPABLE))
            raise ValueError(f"LoRA target {t!r} matches no linear module of this {model.config.model_type} model; "
                             f"its linear modules: {', '.join(names)}")


def lora_spec(model: nn.Module) -> dict | None:
    """The adapters' settings as `add_lora` took them ({r, alpha, dropout, target_modules}: what a checkpoint
    records), or None for a model without adapters. Read from the `peft_config` that PEFT's
    `inject_adapter_in_model` sets on the model it adapts, so the model carries one record of them, PEFT's own."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    config = configs["default"]
    return {"r": config.r, "alpha": config.lora_alpha, "dropout": config.lora_dropout,
            "target_modules": sorted(config.target_modules)}


def has_lora(model: nn.Module) -> bool:
    return lora_spec(model) is not None


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _base_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


def _adapter_key(name: str) -> str:
    """Our parameter name -> PEFT's file key (adapter name dropped, PeftModel's prefix added)."""
    return _PEFT_PREFIX + name.replace(".default.", ".")


def base_state(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The base weights under their HF names (the adapters left out), of the model's state dict or of `state` (a
    full state dict gathered from sharded parameters)."""
    return {_base_name(n): t for n, t in (state or model.state_dict()).items() if not is_adapter(n)}


def adapter_state(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter weights under PEFT's file keys (of `state`, as for `base_state`)."""
    return {_adapter_key(n): t for n, t in (state or model.state_dict()).items() if is_adapter(n)}


def load_adapter_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Set the model's adapters from `adapter_state`'s keys; every adapter must be there, nothing else."""
    mine = {_adapter_key(n): p for n, p in model.named_parameters() if is_adapter(n)}
    if set(tensors) != set(mine):
        missing, extra = sorted(set(mine) - set(tensors)), sorted(set(tensors) - set(mine))
        raise ValueError(f"the adapter does not fit this model: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for key, p in mine.items():
            p.copy_(tensors[key])


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base weights with each adapter merged in (W + alpha / r * B A), under the HF names."""
    spec = lora_spec(model)
    scale = spec["alpha"] / spec["r"]
    params = dict(model.named_parameters())
    out = base_state(model)
    for name in params:
        if ".lora_A." in name:
            module = name.split(".lora_A.")[0]
            a, b = params[name], params[name.replace(".lora_A.", ".lora_B.")]
            w = f"{module}.weight"
            out[w] = (out[w].float() + scale * (b.float() @ a.float())).to(out[w].dtype)
    return out


def adapter_config(model: nn.Module, base_model: str | None) -> dict:
    """adapter_config.json as PEFT writes it for a causal LM."""
    spec = lora_spec(model)
    config = _peft().LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=0.0,
                                target_modules=spec["target_modules"], bias="none", task_type="CAUSAL_LM",
                                base_model_name_or_path=base_model)
    out = config.to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in out.items()}


def save_adapter(model: nn.Module, directory: str | Path, base_model: str | None = None,
                 state: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Write adapter_model.safetensors + adapter_config.json into `directory` (PEFT's layout); their names."""
    d = Path(directory)
    tensors = adapter_state(model, state)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(d / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    (d / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(model, base_model), indent=2, default=str))
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]

