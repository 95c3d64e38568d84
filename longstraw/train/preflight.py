"""The checks `longstraw train` runs in the launching process, before any Prefect server, run lock, run directory
or torchrun rank starts: a wrong input then ends the command in a second with one line naming the problem and the
fix, instead of after a server start, behind a traceback, or as some rank's error that advises a resume.

`check_before_start` adds to `inputs.preflight` (which the flow itself still runs, for runs started from the UI)
what that one does not look at: the model directory's files, every dataset line (parsed, and within the model's
positions), a dry call of each reward, a writable run directory and the free disk a checkpoint needs. All of it is
cheap at 27B parameters and 2.1M-token prompts: no weights are read (the parameter count comes from a weightless
copy of the model), and the dataset is read one line at a time.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ..data import Example, JsonlIndex, load_tokenizer
from ..errors import UserError, os_error_line, permanent_os_error
from ..grpo.rewards import get_reward
from ..models.checkpoint import safetensors_files
from ..models.registry import build, config_from_hf
from .config import ENV_REWARD, TrainConfig
from .data import prompt_ids, step_example
from .inputs import preflight

_CHECKPOINT = "config.json + *.safetensors"


def check_before_start(cfg: TrainConfig) -> None:
    """Raise `UserError` (one line: the problem and the fix) when the run would fail on its inputs, its rewards or
    its disk; writes nothing (the dataset's line index aside, which the run writes anyway)."""
    _model_files(cfg)
    if cfg.dataset is not None and not Path(cfg.dataset).is_file():
        raise UserError(f"dataset {cfg.dataset} is not a file; give the path of a JSONL file of "
                        '{"prompt": ..., "answer": ...} lines, or fix the path')
    rewards = _rewards(cfg)
    try:
        preflight(cfg)  # tokenizer, vocab, LoRA targets, MoE replay; the first prompt's positions
    except (ValueError, FileNotFoundError) as e:
        raise UserError(_one_line(e)) from e
    mc = config_from_hf(cfg.model.hf_config())
    if cfg.dataset is not None:
        _dataset_positions(cfg, mc)
    _dry_rewards(cfg, rewards)
    existing = _existing_ancestor(Path(cfg.run_dir))
    _writable(cfg, existing)
    _disk(cfg, existing)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split("\n"))


# ---- 1. the model's files -----------------------------------------------------------------------------------

def _model_files(cfg: TrainConfig) -> None:
    path = cfg.model.path
    if path is None:  # a random model: its config is in the run config
        return
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"model.path {path} is not a directory; give the directory of an HF checkpoint "
                        f"({_CHECKPOINT}), or fix the path")
    if not (p / "config.json").is_file():
        raise UserError(f"model.path {path} has no config.json; give the directory of an HF checkpoint "
                        f"({_CHECKPOINT}), as transformers' save_pretrained writes it")
    try:
        safetensors_files(p)
    except (FileNotFoundError, ValueError, KeyError) as e:
        # an index naming absent shards: a download or copy cut short
        fix = "; copy all of the checkpoint's shards there" if "missing" in str(e) else ""
        raise UserError(f"model.path {path}: {_one_line(e)}{fix}") from e
    own_tokenizer = cfg.tokenizer not in ("byte", "builtin") and _same_dir(cfg.tokenizer, p)
    if own_tokenizer and not (p / "tokenizer.json").is_file():
        raise UserError(f"tokenizer {cfg.tokenizer} (the model's directory) has no tokenizer.json; copy the "
                        "tokenizer files (tokenizer.json, tokenizer_config.json) there, or set `tokenizer` to the "
                        "directory that holds them")


def _same_dir(tokenizer: str, model: Path) -> bool:
    t = Path(tokenizer)
    t = t.parent if t.name == "tokenizer.json" else t
    return t.resolve() == model.resolve()


# ---- 4. the rewards ------------------------------------------------------------------------------------------

def _rewards(cfg: TrainConfig) -> dict:
    """Each reward function, resolved before `preflight` resolves them, so that a missing module gets the advice
    the `longstraw` script needs: unlike `python -m`, it does not put the current directory on sys.path."""
    out = {}
    for name in cfg.rewards:
        if name == ENV_REWARD:  # the environment's, stored with the rollout
            continue
        try:
            out[name] = get_reward(name)
        except ValueError as e:
            line = _one_line(e)
            if isinstance(e.__cause__, ModuleNotFoundError):
                line += " (the `longstraw` command does not search the current directory)"
            raise UserError(line) from e
    return out


def _dry_rewards(cfg: TrainConfig, rewards: dict) -> None:
    """Call each reward once on the first example with its answer as the completion: a reward that raises on
    every answer would otherwise score 0.0 for the whole run with no more than a logged warning."""
    if not rewards:
        return
    ex = step_example(cfg, load_tokenizer(cfg.tokenizer), 0, 0)
    meta = ex.meta | {"answer": ex.answer}
    for name, fn in rewards.items():
        try:
            fn(dict(meta), ex.answer)
        except Exception as e:
            raise UserError(f"reward {name!r} raised {type(e).__name__} on the first example with its answer as "
                            f"the completion: {_one_line(e)}; fix the function (it is called as "
                            "fn(prompt_meta: dict, response_text: str) -> float | None)") from e


# ---- 3. every dataset line ------------------------------------------------------------------------------------

def _dataset_positions(cfg: TrainConfig, mc) -> None:
    """Every example fits the model's positions with max_new_tokens (`preflight` checks the first). Its parse
    errors (file, line, column) were raised when `preflight` indexed the file, which reads every line."""
    index = JsonlIndex(cfg.dataset)  # the index `preflight` just wrote: one seek per example
    tok = load_tokenizer(cfg.tokenizer)
    room = mc.max_positions - cfg.max_new_tokens
    # a token covers at least one byte (byte-level BPE, byte fallback, the byte tokenizer), so a prompt of fewer
    # bytes than the room left after the chat template needs no tokenizing
    template = len(prompt_ids(tok, Example(prompt="", answer="", meta={})))
    for i in range(len(index)):
        ex = index[i]
        if len(ex.prompt.encode()) + template <= room:
            continue
        n = len(prompt_ids(tok, ex))
        if n > room:
            where = f"{cfg.dataset}, line {index.lines[i]}"
            raise UserError(mc.positions_error(f"{where}: a prompt of {n:,} tokens (with the chat template) + "
                                               f"max_new_tokens {cfg.max_new_tokens}", n + cfg.max_new_tokens)
                            + "; or shorten that prompt, or lower max_new_tokens")


# ---- 5., 6. the run directory --------------------------------------------------------------------------------

def _existing_ancestor(path: Path) -> Path:
    """The run directory, or the nearest directory above it that exists (where its creation will write)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _probe(directory: Path) -> None:
    """Create and remove a file in `directory`: the one test of writability that holds for root, ACLs and
    read-only mounts alike."""
    probe = directory / f".longstraw-probe-{os.getpid()}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    os.unlink(probe)


def _writable(cfg: TrainConfig, existing: Path) -> None:
    if not existing.is_dir():
        raise UserError(f"run_dir {cfg.run_dir}: {existing} is a file, not a directory; give a run_dir under a "
                        "directory")
    try:
        _probe(existing)
    except OSError as e:
        fix = os_error_line(e) if permanent_os_error(e) else f"{e.strerror or e}: give a run_dir on a writable disk"
        raise UserError(f"run_dir {cfg.run_dir} cannot be written ({existing}): {fix}") from e


def checkpoint_bytes(cfg: TrainConfig) -> int:
    """About what one checkpoint writes (longstraw/train/checkpoint.py): the weights in the run's dtype, and the
    AdamW state (two moments, plus the fp32 master weights with mixed precision or offload) of what it trains;
    with LoRA the frozen base (written once, at update 0) and small adapters, counted as the base alone."""
    with torch.device("meta"):  # the parameter count without reading or allocating a weight
        params = sum(p.numel() for p in build(cfg.model.hf_config()).parameters())
    width = getattr(torch, cfg.dtype).itemsize
    weights = params * width
    if cfg.lora is not None:
        return weights
    master = cfg.optim.mixed_precision or cfg.optim.offload != "none"
    moments = 2 * params * (4 if master else width)
    return weights + moments + (params * 4 if master else 0)


def _disk(cfg: TrainConfig, existing: Path) -> None:
    need = checkpoint_bytes(cfg)
    free = shutil.disk_usage(existing).free
    if free < need:
        raise UserError(f"run_dir {cfg.run_dir}: a checkpoint needs about {_size(need)} ({need:,} bytes) but the "
                        f"disk holding {existing} has {_size(free)} ({free:,} bytes) free; free some space or give "
                        "a run_dir on a larger disk")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError
