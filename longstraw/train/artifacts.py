"""Small stage artefacts (rewards, reference log-probs, gradients): written atomically, read back only if the
checksum agrees.

Tensors go to safetensors (never pickle), small records to JSON. Every writer returns the file's sha256, which
the pipeline passes on with the path; a reader given that sha256 refuses a file whose content differs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..files import atomic_output, sha256_file, verify_file


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> str:
    data = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    with atomic_output(path) as tmp:
        save_file(data, tmp)
    return sha256_file(path)


def load_tensors(path: str | Path, sha256: str | None = None) -> dict[str, torch.Tensor]:
    return load_file(str(verify_file(path, sha256)))


def save_json(path: str | Path, obj) -> str:
    text = json.dumps(obj, indent=1)
    with atomic_output(path) as tmp:
        Path(tmp).write_text(text)
    return sha256_file(path)


def load_json(path: str | Path, sha256: str | None = None):
    return json.loads(verify_file(path, sha256).read_text())
