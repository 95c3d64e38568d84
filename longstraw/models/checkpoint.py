"""Read HF checkpoint directories: config.json plus model.safetensors or a sharded safetensors index."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


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
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {p}; convert .bin checkpoints with transformers' save_pretrained "
            "(LongStraw never unpickles weights)"
        )
    return files


def iter_tensors(path: str | Path, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, so peak memory stays near one tensor beyond the model."""
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt", device=str(device)) as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)
