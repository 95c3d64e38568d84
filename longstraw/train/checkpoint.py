"""Training checkpoints, sharded over the torch.distributed ranks: the weights as an HF checkpoint, each rank's
share of the AdamW state, the RNG state and the update counter.

A checkpoint directory (`update-NNNNNN/`):

    config.json, model.safetensors   the weights in HF layout (rank 0 writes them; `load_model` and transformers
                                     read them, so any checkpoint is also a model to start a new run from)
    trainer/optimizer/shard-0000R-model-00001-of-00001.safetensors
                                     the AdamW state rank R-1 held, written by torch.distributed.checkpoint (DCP)
                                     with its HF storage writer: safetensors whose header gives each tensor's offset
                                     in the whole (no pickled .metadata, which DCP's default writer would add);
                                     with optim.mixed_precision or offload (MasterAdamW) also the fp32 master
                                     weights, `<param>.master` (the export above: the bf16 weights)
    adapter_model.safetensors, adapter_config.json
                                     with LoRA: the adapter in PEFT's layout (`PeftModel.from_pretrained` on the
                                     transformers model reads it); the frozen base weights (config.json,
                                     model.safetensors) are then written once, at update 0, which later
                                     checkpoints name (`base_checkpoint`)
    trainer/rng.safetensors          rank 0's torch RNG
    trainer.json                     written last: format, counters, param groups, the optimizer state's keys with
                                     shapes and dtypes, which rank wrote which shard, the python RNG, the sha256 of
                                     every other file and `weights_version`

Why sharded: at 27B parameters on 8 ranks the fp32 moments are ~216 GB. Each rank writes the 1/8 it holds (27 GB)
in parallel, and no rank ever holds or writes the whole optimizer state; rank 0 writes the 54 GB bf16 export
(under FSDP gathered to its CPU first, the one full copy of the weights a save makes). DCP reshards on load, so a
checkpoint loads on any number of ranks under any ZeRO stage (2 ranks ZeRO-3 -> 1 process, and back). Under
ZeRO-2/3 the training worker reads the export on rank 0 alone and broadcasts each rank its shards (a `Loader`),
instead of 8 ranks each reading and holding the 54 GB.

All-or-nothing: rank 0 picks a temporary directory (`files.atomic_output`) that every rank writes into; it is
renamed into place only after every rank has hashed what it wrote and rank 0 has written trainer.json listing
all of it. A failure on any rank raises on every rank and leaves no directory.

Not done: asynchronous save (`dcp.async_save`; the ranks wait for their writes, 27 GB each at 27B / 8 ranks, and
read them back once to hash them); the export is one model.safetensors, so in `read_trainer` one rank hashes those
54 GB while the others hash their 27 GB shards; the ranks must share one filesystem. DCP exchanges its save and
load plans between ranks with torch's object collectives (in memory, between the ranks of one job); nothing on
disk is pickled.
"""

from __future__ import annotations

import json
import os
import random
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..files import atomic_output, digest, sha256_file
from ..lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, add_lora, base_state, has_lora, load_adapter_state,
                    lora_spec, merged_state, save_adapter)
from ..models import load_model
from ..models.checkpoint import write_state_dict
from ..parallel import is_sharded
from ..parallel.backend import collective_device
from ..parallel.objects import broadcast_json, gather_json
from .artifacts import load_tensors

FORMAT = "longstraw-checkpoint/2"
OLD_FORMATS = {"longstraw-checkpoint/1": "one process's whole optimizer state in trainer/optimizer.safetensors"}
OPTIMIZER = "trainer/optimizer"  # DCP's shard files, one per rank that held any optimizer state
RNG = "trainer/rng.safetensors"
WEIGHTS = ("config.json", "model.safetensors")
ADAPTER = (ADAPTER_WEIGHTS, ADAPTER_CONFIG)  # PEFT's files, with LoRA


# How a checkpoint's model is made: loader(read, weights_dir, lora) -> model, where read() loads the whole model
# (base weights and adapter), weights_dir holds config.json and the base weights, and lora is the adapter spec (or
# None). The loader shards the model for ZeRO-2/3; a sharded run calls read() on rank 0 only and builds the rest
# from weights_dir on the meta device.
Loader = Callable[[Callable[[], nn.Module], Path, "dict | None"], nn.Module]


# ---- the ranks ------------------------------------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _gather(value) -> list:
    return gather_json(value, device=collective_device()) if _distributed() else [value]


def _broadcast(value):
    return broadcast_json(value, device=collective_device()) if _distributed() else value


def _record(err: BaseException | None) -> dict | None:
    if err is None:
        return None
    if isinstance(err, OSError) and err.errno is not None:  # its errno: a full disk on any rank stays one
        return {"type": "OSError", "message": str(err), "errno": err.errno, "strerror": err.strerror,
                "filename": err.filename}
    return {"type": type(err).__name__, "message": str(err)}


_TYPES = {t.__name__: t for t in (ValueError, FileNotFoundError, OSError, KeyError, RuntimeError)}


def _rebuild(record: dict, suffix: str = "") -> Exception:
    if record.get("errno") is not None:  # OSError(errno, ...) is the errno's subclass (PermissionError, ...)
        return OSError(record["errno"], f"{record['strerror']}{suffix}", record["filename"])
    return _TYPES.get(record["type"], RuntimeError)(record["message"] + suffix)


def _raise_any(records: list[dict | None], own: BaseException | None) -> None:
    """Raise on every rank when any rank failed: its own error on a rank that has one, the first other's
    (same type, naming the rank) on the rest; so that no rank goes on to a collective the others skip."""
    if own is not None:
        raise own
    for r, rec in enumerate(records):
        if rec is not None:
            raise _rebuild(rec, f" (on rank {r})")


@contextmanager
def _dcp_errors(what: str) -> Iterator[None]:
    """DCP raises CheckpointException (a BaseException) on every rank when any failed; give each rank its own error
    back where it has one (a full disk stays an OSError), else the first failing rank's. Without a process group
    DCP runs as one process (no_dist), which it warns about each time; that is meant here."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            yield
    except CheckpointException as e:
        rank = _rank_world()[0]
        if rank in e.failures:
            raise e.failures[rank][0] from None
        r, (exc, _) = min(e.failures.items())
        raise _rebuild(_record(exc), f" (on rank {r}, {what})") from None


# ---- optimizer state --------------------------------------------------------------------------------------------------
def _local(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeroRedundancyOptimizer's own AdamW over its partition (ZeRO-1),
    else the optimizer itself (its state DTensors under FSDP)."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """{f"{parameter name}.{field}": tensor} of the state this rank holds (DTensors stay DTensors: DCP writes the
    local shard with its offsets; a tensor every rank holds alike is written once, by one of them)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in _local(optimizer).state.items():
        if id(p) not in names:
            raise ValueError("the optimizer holds state for a tensor that is not a parameter of the model; save the "
                             "model with the optimizer built over its parameters")
        for field, value in st.items():
            out[f"{names[id(p)]}.{field}"] = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    return out


def _spec(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}  # a DTensor's shape is the whole


class _ShardWriter(HuggingFaceStorageWriter):
    """DCP's safetensors writer, every rank its own file (`save_distributed`), recording what this rank wrote."""

    def __init__(self, path: str) -> None:
        super().__init__(path, save_distributed=True)
        self.written: list[str] = []

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        self.written = sorted({r.storage_data.relative_path for r in fut.wait()})
        return fut


def _full_weights(model: nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
    """The whole state dict on rank 0 (None elsewhere); under FSDP gathered from the shards to rank 0's CPU, one
    tensor at a time (a collective: every rank calls it)."""
    if is_sharded(model):
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return full if rank == 0 else None
    return model.state_dict() if rank == 0 else None


# ---- save -------------------------------------------------------------------------------------------------------------
def save_checkpoint(
    directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, update: int, step: int, extra: dict,
    weights_version: str | None = None, base: str | Path | None = None,
) -> Path:
    """Write the checkpoint of `update` (optimizer updates done so far) atomically at `directory`.

    A collective when torch.distributed is initialised (every rank calls it, with its share of the model and
    optimizer); no rank returns before the checkpoint is committed, and a failure on any rank raises on all.
    `weights_version`: the name of these weights (default: the content digest of the weight files' sha256).
    With LoRA adapters the checkpoint holds the adapter in PEFT's layout, and the frozen base weights only when
    `base` is None; else `base` names the checkpoint that holds them (a run writes them once, at update 0)."""
    final = Path(directory)
    rank, world = _rank_world()
    lora = has_lora(model)
    state = _optimizer_state(model, optimizer)
    specs = dict(sorted({k: v for part in _gather({k: _spec(t) for k, t in state.items()}) for k, v in part.items()}
                        .items()))
    state_dict = _full_weights(model, rank)  # with LoRA: base and adapter, split below
    reached_commit = False
    listed: list[str] = []
    err: BaseException | None = None
    try:
        with ExitStack() as stack:
            # rank 0: the temporary directory, the HF export and the RNG; then everyone learns where, or that it failed
            tmp_name = None
            if rank == 0:
                try:
                    tmp_name = stack.enter_context(atomic_output(final))
                    (Path(tmp_name) / "trainer").mkdir(parents=True)
                    if lora:
                        save_adapter(model, tmp_name, str(base or final), state=state_dict)
                        if base is None:  # the frozen base weights, once per run
                            write_state_dict(base_state(model, state_dict), model.config, tmp_name)
                    else:
                        write_state_dict(state_dict, model.config, tmp_name)
                    save_file({"torch": torch.get_rng_state()}, str(Path(tmp_name) / RNG))
                except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
                    err = e
            state_dict = None  # rank 0's full copy of the weights is written: free it
            got = _broadcast({"tmp": tmp_name, "error": _record(err)})
            _raise_any([got["error"]], err)
            tmp = Path(got["tmp"])
            # every rank: its optimizer state (fresh optimizers hold none, and nothing is written)
            writer = _ShardWriter(str(tmp / OPTIMIZER))
            if specs:
                with _dcp_errors("writing the optimizer state"):
                    dcp.save(state, storage_writer=writer, no_dist=not _distributed())
            mine: dict[str, str] = {}
            try:
                mine_weights = [n for n in (*WEIGHTS, *ADAPTER) if (tmp / n).is_file()]
                names = ([*mine_weights, RNG] if rank == 0 else []) + [f"{OPTIMIZER}/{n}" for n in writer.written]
                mine = {n: sha256_file(tmp / n) for n in names}  # hashed once, here; `read_trainer` trusts the stamp
            except Exception as e:  # noqa: BLE001
                err = e
            records = _gather({"files": mine, "error": _record(err)})
            _raise_any([r["error"] for r in records], err)
            files = dict(sorted((n, h) for r in records for n, h in r["files"].items()))
            listed = list(files)
            reached_commit = True
            if rank == 0:
                trainer = {
                    "format": FORMAT,
                    "update": update,
                    "step": step,
                    "world_size": world,
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
                    "optimizer_state": specs,
                    "optimizer_files": {n: r for r, rec in enumerate(records) for n in rec["files"]
                                        if n.startswith(OPTIMIZER + "/")},
                    "python_rng": _jsonable(random.getstate()),
                    # the weights' content hash from the checksums just taken, not another pass over 54 GB of tensors
                    "weights_version": weights_version or digest({n: h for n, h in files.items()
                                                                  if n in (*WEIGHTS, *ADAPTER)}),
                    # relative: a run directory moved elsewhere still finds its base weights
                    **({"lora": lora_spec(model),
                        "base_checkpoint": None if base is None else os.path.relpath(base, final)} if lora else {}),
                    **extra,
                    "files": files,
                }
                (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1))  # last: it lists the others
        # rank 0 has left atomic_output: committed (renamed into place), or the exception below
    except Exception as e:
        if not reached_commit:
            raise  # raised on every rank at the same point
        err = e
    outcome = _broadcast({"error": _record(err if rank == 0 else None)})
    _raise_any([outcome["error"]], err)
    try:  # these bytes were hashed as written
        _VERIFIED[final.resolve()] = _stamp(final, [*listed, "trainer.json"])
    except OSError:
        pass
    return final


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


# ---- verify -----------------------------------------------------------------------------------------------------------
# Checkpoints this process has verified, by the (size, mtime) of each file: a 27B checkpoint is 54 GB of weights
# and 216 GB of moments to sha256, so a worker hashes it once, not once per stage that reads it. A file rewritten
# since changes its stamp and is hashed again.
_VERIFIED: dict[Path, tuple] = {}


def _stamp(d: Path, names) -> tuple:
    return tuple((n, (st := (d / n).stat()).st_size, st.st_mtime_ns) for n in sorted(names))


def _read_meta(d: Path) -> dict:
    meta_path = d / "trainer.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{d} is not a committed checkpoint (no trainer.json)")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as e:
        raise ValueError(f"checkpoint {d}: trainer.json is not JSON ({e}); resume from an earlier checkpoint by "
                         f"deleting this directory") from None
    fmt = meta.get("format")
    if fmt in OLD_FORMATS:
        raise ValueError(f"{d}: checkpoint format {fmt!r} ({OLD_FORMATS[fmt]}) is not read by this version of "
                         f"LongStraw, which reads {FORMAT} (the optimizer state sharded over the ranks). Its weights "
                         f"are an HF checkpoint: start a new run from them (model.path: {d}), or resume with the "
                         f"version that wrote it")
    if fmt != FORMAT:
        raise ValueError(f"{d}: unknown checkpoint format {fmt!r}, expected {FORMAT}")
    return meta


def read_trainer(directory: str | Path) -> dict:
    """The checkpoint's trainer.json after checking every file against its sha256 (once per process).

    A collective when torch.distributed is initialised: rank r of N hashes files r, r + N, ..., so the 270 GB of a
    27B checkpoint are hashed by all ranks at once, and an error is raised on every rank alike."""
    d = Path(directory)
    rank, world = _rank_world()
    meta, stamp, problem = None, None, None
    try:
        meta = _read_meta(d)
        stamp = _stamp(d, [*meta["files"], "trainer.json"])
    except FileNotFoundError as e:
        problem = e if meta is None else ValueError(
            f"checkpoint {d}: {Path(e.filename).name} is missing; resume from an earlier checkpoint by deleting this "
            f"directory")
    except ValueError as e:
        problem = e
    key = d.resolve()
    records = _gather({"error": _record(problem), "cached": problem is None and _VERIFIED.get(key) == stamp})
    first = next((r for r, rec in enumerate(records) if rec["error"]), None)
    if first is not None:  # the first failing rank's error, word for word, on every rank
        if first == rank:
            raise problem
        raise _rebuild(records[first]["error"])
    if all(rec["cached"] for rec in records):
        return meta
    names = list(meta["files"])
    bad = []
    for i in range(rank, len(names), world):
        try:
            ok = sha256_file(d / names[i]) == meta["files"][names[i]]
        except OSError:
            ok = False
        if not ok:
            bad.append(i)
    bad = sorted(i for part in _gather(bad) for i in part)
    if bad:
        more = f" (and {len(bad) - 1} more files)" if len(bad) > 1 else ""
        raise ValueError(f"checkpoint {d}: {names[bad[0]]} does not match its sha256 (corrupted){more}; resume from an "
                         f"earlier checkpoint by deleting this directory")
    _VERIFIED[key] = stamp
    return meta


# ---- load -------------------------------------------------------------------------------------------------------------
def load_checkpoint(
    directory: str | Path, optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer],
    dtype: torch.dtype = torch.float32, restore_rng: bool = True, *,
    device: str | torch.device = "cpu", loader: Loader | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    """(model, optimizer with its state, trainer.json) of a verified checkpoint; optionally restores the RNGs
    (rank 0's at save, on every rank).

    A collective when torch.distributed is initialised. By default every rank reads the HF export; a `loader`
    decides instead who reads, and shards the model for ZeRO-2/3 (see `Loader`), before
    `optimizer_factory(model)`; then each rank reads exactly the optimizer state its optimizer holds, from
    whichever shard files hold it (DCP reshards: any world size, any stage)."""
    d = Path(directory)
    meta = read_trainer(d)
    lora = meta.get("lora")
    weights_dir = d / meta["base_checkpoint"] if lora and meta["base_checkpoint"] else d
    if weights_dir != d:  # LoRA: the frozen base weights are in the checkpoint named (verified by every rank together)
        read_trainer(weights_dir)

    def read() -> nn.Module:  # the (base) weights, then the adapter
        model = load_model(weights_dir, dtype=dtype, device=device)
        if lora is not None:
            add_lora(model, **lora)
            load_adapter_state(model, load_tensors(d / ADAPTER_WEIGHTS))
        return model

    model = read() if loader is None else loader(read, weights_dir, lora)
    optimizer = optimizer_factory(model)
    _load_optimizer(d, model, optimizer, meta)
    if restore_rng:
        torch.set_rng_state(load_tensors(d / RNG)["torch"])
        random.setstate(_tuples(meta["python_rng"]))
    return model, optimizer, meta


def _load_optimizer(d: Path, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict) -> None:
    """Templates for the state this rank's optimizer holds (moments shaped like their parameter, a DTensor under
    FSDP; `step` 0-dim), filled by DCP from the shards, installed with the saved param groups."""
    local = _local(optimizer)
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    saved: dict[str, dict[str, dict]] = {}
    for key, spec in meta["optimizer_state"].items():
        pname, _, field = key.rpartition(".")
        if field == "master" and not getattr(local, "holds_master", False):
            continue  # fp32 master weights (optim.mixed_precision / offload); this optimizer steps the weights
        if pname not in params:
            raise ValueError(f"checkpoint {d} holds optimizer state for {pname!r}, which the model has no parameter "
                             f"of; load it with the model it was saved with")
        saved.setdefault(pname, {})[field] = spec
    index = {id(p): i for i, p in enumerate(p for g in local.param_groups for p in g["params"])}
    templates: dict[str, torch.Tensor] = {}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for g in local.param_groups:
        for p in g["params"]:
            name = names[id(p)]
            for field, spec in saved.get(name, {}).items():
                dt = getattr(torch, spec["dtype"])
                if spec["shape"] == list(p.shape):
                    t = torch.zeros_like(p.detach(), dtype=dt)  # a DTensor of p's placements under FSDP
                elif spec["shape"] == []:
                    t = torch.zeros((), dtype=dt)
                else:
                    raise ValueError(f"checkpoint {d}: optimizer state {name}.{field} has shape {spec['shape']}, the "
                                     f"parameter {list(p.shape)}")
                templates[f"{name}.{field}"] = state.setdefault(index[id(p)], {})[field] = t
    if meta["optimizer_state"]:  # every rank, even one that holds none of it: DCP plans its reads collectively
        with _dcp_errors("reading the optimizer state"):
            dcp.load(templates, storage_reader=HuggingFaceStorageReader(str(d / OPTIMIZER)),
                     no_dist=not _distributed())
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint {d} has {len(meta['param_groups'])} optimizer param groups, the optimizer "
                         f"{len(optimizer.param_groups)}")
    for groups in {id(optimizer): optimizer.param_groups, id(local): local.param_groups}.values():
        for g, hyper in zip(groups, meta["param_groups"]):
            g.update({k: _tuples(v) for k, v in hyper.items()})
    local.load_state_dict({"state": state, "param_groups": [{**g, "params": [index[id(p)] for p in g["params"]]}
                                                            for g in local.param_groups]})


def latest_checkpoint(checkpoints: Path) -> Path | None:
    """The committed checkpoint with the highest update number (temporary and .old directories are ignored)."""
    if not checkpoints.is_dir():
        return None
    done = sorted(p for p in checkpoints.glob("update-*") if p.name[7:].isdigit() and (p / "trainer.json").is_file())
    return done[-1] if done else None


def export_checkpoint(directory: str | Path, out: str | Path, merge: bool = False) -> Path:
    """A checkpoint's weights as an HF checkpoint directory at `out` (written atomically): the weights; with LoRA
    the base weights plus the adapter in PEFT's layout, or with `merge` the adapter merged into them (W + s B A).
    One process (it reads the whole model)."""
    d = Path(directory)
    meta = read_trainer(d)
    lora = "lora" in meta
    base = d / meta["base_checkpoint"] if meta.get("base_checkpoint") else d
    model = load_model(base)
    if lora:
        model = add_lora(model, **meta["lora"])
        load_adapter_state(model, load_tensors(d / ADAPTER_WEIGHTS))
    with atomic_output(Path(out)) as tmp:
        Path(tmp).mkdir()
        write_state_dict(merged_state(model) if lora and merge else base_state(model) if lora
                         else model.state_dict(), model.config, tmp)
        if lora and not merge:
            save_adapter(model, tmp, str(Path(out).resolve()))
    return Path(out)
