"""HF checkpoint directories (config.json plus model.safetensors, or a sharded safetensors index): `load_model`
reads them, `write_weights` (or `write_state_dict`) writes them. Never pickle."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .config import with_rope_scaling
from .registry import build, cast

log = logging.getLogger("longstraw")


def read_config(path: str | Path) -> dict:
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"no config.json at {p}; pass an HF model directory (config.json + *.safetensors)")
    cfg = json.loads(f.read_text())
    if "model_type" not in cfg:
        raise ValueError(f"{f} has no model_type; is it a transformers config.json?")
    return cfg


def safetensors_files(path: str | Path) -> list[Path]:
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {missing[:3]}")
        return [p / s for s in shards]
    # a PEFT adapter beside the weights (a LoRA run's checkpoint) is not part of the model
    files = sorted(f for f in p.glob("*.safetensors") if f.name != "adapter_model.safetensors")
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {p}; convert .bin checkpoints with transformers' save_pretrained "
            "(LongStraw never unpickles weights)"
        )
    return files


def iter_tensors(path: str | Path, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, so peak memory stays near one tensor beyond the model."""
    for f in safetensors_files(path):
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name)
        except SafetensorError as e:  # truncated or not safetensors at all: say which file
            raise ValueError(f"{f} is not a readable safetensors file ({e}); it may be truncated: copy or "
                             f"download it again") from None


# checkpoint prefixes that hold no text-model weights (vision tower, multi-token-prediction heads)
IGNORED_PREFIXES = ("model.visual.", "mtp.")
RENAMED_PREFIXES = {"model.language_model.": "model."}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


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


def meta_model(path: str | Path, dtype: torch.dtype = torch.float32, rope_scaling: dict | None = None) -> nn.Module:
    """The model of an HF checkpoint directory on the meta device, in `dtype` (the family's fp32 tensors kept in
    fp32): its structure from config.json alone, no weights read and no memory taken. `rope_scaling`: as
    `load_model`'s."""
    with torch.device("meta"):
        model = build(with_rope_scaling(read_config(path), rope_scaling))
    return cast(model, dtype)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               rope_scaling: dict | None = None) -> nn.Module:
    """Load an HF checkpoint directory (config.json + *.safetensors, sharded or not). `rope_scaling` (e.g.
    {"rope_type": "yarn", "factor": 8.0}) extends the positions of the config.json without editing it
    (`models.config.with_rope_scaling`)."""
    cfg = with_rope_scaling(read_config(path), rope_scaling)
    with torch.device("meta"):
        model = build(cfg)
    saved = model.state_dict(keep_vars=True)  # without the non-persistent buffers (RoPE's, computed at build)
    expected = {**dict(model.named_parameters()), **{n: b for n, b in model.named_buffers() if n in saved}}
    tied = model.config.tie_word_embeddings
    keep = model.fp32_suffixes
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


def write_weights(model: nn.Module, directory: str | Path) -> None:
    """config.json + model.safetensors in `directory`: the layout `load_model` (and transformers) read."""
    write_state_dict(model.state_dict(), model.config, directory)


def write_state_dict(state: dict[str, torch.Tensor], config, directory: str | Path) -> None:
    """`write_weights` from a full state dict and the model's config: for weights the model does not hold whole
    on this process (FSDP: gathered to rank 0 by the checkpoint writer)."""
    directory = Path(directory)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config.raw, indent=2))
