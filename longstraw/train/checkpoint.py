"""Training checkpoints: weights (an HF checkpoint directory), optimizer state, RNG state and the update counter.

A checkpoint is a directory written under a temporary name and renamed into place, so a crash leaves either the
whole checkpoint or none. `trainer.json` is written last inside it and lists the sha256 of every other file;
`load_checkpoint` verifies them before anything is used.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..files import atomic_output, digest, file_checksums, sha256_file
from ..models import load_model, write_weights
from .artifacts import load_tensors

FORMAT = "longstraw-checkpoint/1"


def _optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in optimizer.state.items():
        for key, value in st.items():
            out[f"{names[id(p)]}.{key}"] = torch.as_tensor(value).detach().cpu()
    return out


def save_checkpoint(
    directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, update: int, step: int, extra: dict
) -> Path:
    """Write the checkpoint of `update` (optimizer updates done so far) atomically at `directory`."""
    final = Path(directory)
    with atomic_output(final) as tmp_dir:
        tmp = Path(tmp_dir)
        tmp.mkdir()
        write_weights(model, tmp)
        # optimizer and RNG state beside, not among, the weights: loaders read every *.safetensors at the top
        (tmp / "trainer").mkdir()
        save_file(_optimizer_tensors(model, optimizer), str(tmp / "trainer" / "optimizer.safetensors"))
        save_file({"torch": torch.get_rng_state()}, str(tmp / "trainer" / "rng.safetensors"))
        trainer = {
            "format": FORMAT,
            "update": update,
            "step": step,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "python_rng": _jsonable(random.getstate()),
            "files": (files := file_checksums(tmp)),
            # the weights' content hash from the checksums just taken, not another pass over 54 GB of tensors
            "weights_version": digest({n: h for n, h in files.items() if "/" not in n}),
            **extra,
        }
        (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1))  # last: it lists the others
    _VERIFIED[final.resolve()] = _stamp(final, [*files, "trainer.json"])  # these bytes were hashed as written
    return final


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


# Checkpoints this process has verified, by the (size, mtime) of each file: a 27B checkpoint is 54 GB of sha256
# (~55 s on one core), so a worker hashes it once, not once per stage that reads it. A file rewritten since
# changes its stamp and is hashed again.
_VERIFIED: dict[Path, tuple] = {}


def _stamp(d: Path, names) -> tuple:
    return tuple((n, (st := (d / n).stat()).st_size, st.st_mtime_ns) for n in sorted(names))


def read_trainer(directory: str | Path) -> dict:
    """The checkpoint's trainer.json after checking every file against its sha256 (once per process)."""
    d = Path(directory)
    meta_path = d / "trainer.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{d} is not a committed checkpoint (no trainer.json)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{d}: unknown checkpoint format {meta.get('format')!r}, expected {FORMAT}")
    key = d.resolve()
    try:
        stamp = _stamp(d, [*meta["files"], "trainer.json"])
    except FileNotFoundError as e:
        raise ValueError(f"checkpoint {d}: {Path(e.filename).name} is missing; resume from an earlier checkpoint by "
                         f"deleting this directory") from None
    if _VERIFIED.get(key) == stamp:
        return meta
    for name, expected in meta["files"].items():
        if sha256_file(d / name) != expected:
            raise ValueError(f"checkpoint {d}: {name} does not match its sha256 (corrupted); resume from an earlier "
                             f"checkpoint by deleting this directory")
    _VERIFIED[key] = stamp
    return meta


def load_checkpoint(
    directory: str | Path, optimizer_factory, dtype: torch.dtype = torch.float32, restore_rng: bool = True
) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    """(model, optimizer with its state, trainer.json) of a verified checkpoint; optionally restores the RNGs."""
    d = Path(directory)
    meta = read_trainer(d)
    model = load_model(d, dtype=dtype)
    optimizer = optimizer_factory(model)
    names = dict(model.named_parameters())
    tensors = load_tensors(d / "trainer" / "optimizer.safetensors")
    state: dict[int, dict] = {}
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    for key, value in tensors.items():
        pname, _, field = key.rpartition(".")
        state.setdefault(index[id(names[pname])], {})[field] = value
    groups = [{**g, "params": [index[id(p)] for p in og["params"]]}
              for g, og in zip(meta["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    if restore_rng:
        torch.set_rng_state(load_tensors(d / "trainer" / "rng.safetensors")["torch"])
        random.setstate(_tuples(meta["python_rng"]))
    return model, optimizer, meta


def latest_checkpoint(checkpoints: Path) -> Path | None:
    """The committed checkpoint with the highest update number (temporary and .old directories are ignored)."""
    if not checkpoints.is_dir():
        return None
    done = sorted(p for p in checkpoints.glob("update-*") if p.name[7:].isdigit() and (p / "trainer.json").is_file())
    return done[-1] if done else None
