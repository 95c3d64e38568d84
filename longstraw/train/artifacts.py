"""Small stage artefacts (rollouts, rewards, gradients): written atomically, read back only if the checksum agrees.

Tensors go to safetensors (never pickle), small records to JSON. Every writer returns the file's sha256, which
the pipeline passes on with the path; a reader given that sha256 refuses a file whose content differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic(path: Path, write) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        digest = sha256_file(tmp)
        os.replace(tmp, path)  # readers see the old file or the whole new one, never a part
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return digest


def verify(path: str | Path, sha256: str | None) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"artefact {path} is missing; re-run the stage that writes it")
    if sha256 is not None and sha256_file(path) != sha256:
        raise ValueError(f"artefact {path} does not match its recorded sha256 (corrupted or overwritten); delete it "
                         f"and re-run the stage that writes it")
    return path


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> str:
    data = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return _atomic(Path(path), lambda tmp: save_file(data, tmp))


def load_tensors(path: str | Path, sha256: str | None = None) -> dict[str, torch.Tensor]:
    return load_file(str(verify(path, sha256)))


def save_json(path: str | Path, obj) -> str:
    text = json.dumps(obj, indent=1)
    return _atomic(Path(path), lambda tmp: Path(tmp).write_text(text))


def load_json(path: str | Path, sha256: str | None = None):
    return json.loads(verify(path, sha256).read_text())
