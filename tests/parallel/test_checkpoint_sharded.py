"""Sharded training checkpoints on 2 gloo ranks (longstraw/train/checkpoint.py): each rank writes the AdamW state it
holds through torch.distributed.checkpoint, rank 0 the HF export; a checkpoint loads back bitwise, on 2 ranks, on
one process and from one process, and a corrupted shard or a failed write is an error on every rank."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, distribute_tensor

import longstraw.train.checkpoint as ck
from longstraw.parallel import SequenceParallel, full_tensor, local_shard, shard_model
from longstraw.train.config import OptimConfig
from longstraw.train.optim import build_optimizer, optimizer_step
from tests.conftest import tiny_model
from tests.parallel.launch import run_ranks

OPTIM = dict(lr=1e-2, weight_decay=0.1, grad_clip=0.5)
MOMENTS = ("exp_avg", "exp_avg_sq")
UPDATES = 3


def _grads(model: torch.nn.Module, update: int) -> None:
    """A fixed gradient per parameter and update (the whole tensor's, sharded like the parameter under FSDP)."""
    for i, p in enumerate(model.parameters()):
        g = torch.sin(torch.arange(p.numel(), dtype=torch.float32) * (update + 1) + i).reshape(p.shape)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else g


def _model(stage: int) -> torch.nn.Module:
    m = tiny_model()
    return shard_model(m, 3, SequenceParallel()) if stage == 3 else m


def _held(model, opt) -> dict[str, torch.Tensor]:
    """The optimizer state this rank holds, {name.field: tensor} (DTensors under FSDP)."""
    names = {id(p): n for n, p in model.named_parameters()}
    local = getattr(opt, "optim", opt)
    return {f"{names[id(p)]}.{k}": v for p, st in local.state.items() for k, v in st.items()}


def _weights(model, tag: str) -> dict[str, torch.Tensor]:
    return {f"{tag}.w.{n}": full_tensor(p.detach()).clone() for n, p in model.named_parameters()}


def _state(model, opt, tag: str) -> dict[str, torch.Tensor]:
    return {f"{tag}.s.{k}": local_shard(v).clone() for k, v in _held(model, opt).items()}


def _check_own_file(rank: int, world: int, stage: int, d: Path, model, opt) -> None:
    """Rank `rank`'s shard file holds what this rank holds and nothing else: its ZeRO-1 partition whole, or (ZeRO-3)
    its FSDP shard of every moment at its offset, and some of the replicated `step`s."""
    meta = json.loads((d / "trainer.json").read_text())
    mine = [f for f, r in meta["optimizer_files"].items() if r == rank]
    assert len(mine) == 1, meta["optimizer_files"]
    held = _held(model, opt)
    with safe_open(str(d / mine[0]), framework="pt") as f:
        keys = set(f.keys())
        offsets = {k: v["saved_offsets"] for k, v in json.loads(f.metadata()["DCP_SHARDING_INFO"]).items()}
        stored = {k: f.get_tensor(k) for k in keys}
    if stage == 1:
        assert keys == set(held) and keys
        for k in keys:
            assert torch.equal(stored[k], held[k]), k
    if stage == 3:
        moments = {k for k in held if k.rpartition(".")[2] in MOMENTS}
        assert moments <= keys and keys - moments <= {k for k in held if k.endswith(".step")}
        for k in moments:
            n0 = held[k].shape[0]
            assert offsets[k] == [min(rank * math.ceil(n0 / world), n0)] + [0] * (held[k].dim() - 1), k
            assert torch.equal(stored[k], local_shard(held[k])), k


def roundtrip_rank(rank: int, world: int, stage: int, root: str) -> dict[str, torch.Tensor]:
    """Two AdamW steps, save, load into a new model and optimizer, then one more step on both."""
    cfg = OptimConfig(**OPTIM, zero_stage=stage)
    m = _model(stage)
    opt = build_optimizer(m, cfg)
    for update in range(2):
        _grads(m, update)
        optimizer_step(m, opt, cfg, update, UPDATES)
    d = ck.save_checkpoint(Path(root) / "update-000002", m, opt, update=2, step=1, extra={})
    out = _weights(m, "saved") | _state(m, opt, "saved")
    if stage == 3:
        out |= {f"full.{k}": full_tensor(v).clone() for k, v in _held(m, opt).items()}
    _check_own_file(rank, world, stage, d, m, opt)
    loader = (lambda read, *_: shard_model(read(), 3, SequenceParallel())) if stage == 3 else None
    m2, opt2, meta = ck.load_checkpoint(d, lambda model: build_optimizer(model, cfg), loader=loader)
    assert meta["update"] == 2 and meta["world_size"] == world
    out |= _weights(m2, "loaded") | _state(m2, opt2, "loaded")
    for model, o, tag in ((m, opt, "cont"), (m2, opt2, "resumed")):
        _grads(model, 2)
        optimizer_step(model, o, cfg, 2, UPDATES)
        out |= _weights(model, tag) | _state(model, o, tag)
    return out


def _part(r: dict, tag: str) -> dict[str, torch.Tensor]:
    return {k[len(tag) + 1:]: v for k, v in r.items() if k.startswith(tag + ".")}


def _assert_same(a: dict, b: dict) -> None:
    assert a and a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """run(stage) -> (checkpoint directory, the ranks' results); each stage runs once per module."""
    done = {}

    def get(stage: int):
        if stage not in done:
            root = tmp_path_factory.mktemp(f"zero{stage}")
            done[stage] = (root / "update-000002", run_ranks(2, roundtrip_rank, stage, str(root), timeout=120))
        return done[stage]

    return get


def _shards(d: Path) -> dict[str, dict[str, list]]:
    """{shard file: {key: shape}} of a checkpoint's optimizer files."""
    out = {}
    for f in sorted((d / ck.OPTIMIZER).iterdir()):
        with safe_open(str(f), framework="pt") as h:
            out[f.name] = {k: h.get_slice(k).get_shape() for k in h.keys()}
    return out


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_save_load_on_two_ranks_is_bitwise_and_each_rank_writes_its_share(run, stage):
    d, ranks = run(stage)
    for r in ranks:
        _assert_same(_part(r, "saved.w"), _part(r, "loaded.w"))
        _assert_same(_part(r, "saved.s"), _part(r, "loaded.s"))
        _assert_same(_part(r, "cont.w"), _part(r, "resumed.w"))
        _assert_same(_part(r, "cont.s"), _part(r, "resumed.s"))
        assert not torch.equal(r["cont.w.lm_head.weight"], r["saved.w.lm_head.weight"])  # the third step moved it
    meta = json.loads((d / "trainer.json").read_text())
    shards = _shards(d)
    assert sorted(meta["optimizer_files"].values()) == [0, 1] and len(shards) == 2  # one file per rank
    params = sum(p.numel() for p in tiny_model().parameters())
    moment_elems = [sum(math.prod(s) for k, s in keys.items() if k.rpartition(".")[2] in MOMENTS)
                    for keys in shards.values()]
    assert sum(moment_elems) == 2 * params  # every moment element stored once, none twice
    assert all(0 < e < 0.75 * 2 * params for e in moment_elems)  # each rank wrote a share, not the whole
    all_keys = [k for keys in shards.values() for k in keys]
    assert set(all_keys) == set(meta["optimizer_state"])
    if stage in (0, 1):  # whole tensors, each in one file (stage 0: DCP keeps one of the replicated copies)
        assert len(all_keys) == len(set(all_keys))


def test_a_two_rank_zero3_checkpoint_loads_in_one_process_and_in_transformers(run):
    d, ranks = run(3)
    model, opt, meta = ck.load_checkpoint(d, lambda m: build_optimizer(m, OptimConfig(**OPTIM)), restore_rng=False)
    assert meta["world_size"] == 2
    held = _held(model, opt)
    full = _part(ranks[0], "full")
    assert len(held) == 3 * len(list(model.parameters()))
    _assert_same({k: v for k, v in held.items()}, {k: full[k] for k in held})
    weights = {n: p.detach() for n, p in model.named_parameters()}
    _assert_same(weights, _part(ranks[0], "saved.w"))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    _assert_same({n: p.detach() for n, p in hf.named_parameters()}, weights)


def load_rank(rank: int, world: int, clean: str, corrupt: str, saves: str) -> dict[str, torch.Tensor]:
    """Load a one-process checkpoint under ZeRO-3 (its moments, gathered); then a corrupted one, and a save whose
    optimizer write fails on rank 1 (the error each rank raised)."""
    loader = lambda read, *_: shard_model(read(), 3, SequenceParallel())  # noqa: E731
    factory = lambda model: build_optimizer(model, OptimConfig(**OPTIM, zero_stage=3))  # noqa: E731
    m, opt, _ = ck.load_checkpoint(clean, factory, loader=loader)
    out = {f"full.{k}": full_tensor(v) for k, v in _held(m, opt).items()}
    try:
        ck.load_checkpoint(corrupt, factory, loader=loader)
    except ValueError as e:
        out["load_error"] = torch.tensor(list(str(e).encode()), dtype=torch.uint8)
    if rank == 1:
        def disk_full(self, plan, planner):
            raise OSError("disk full")

        ck._ShardWriter.write_data = disk_full
    try:
        ck.save_checkpoint(Path(saves) / "update-000003", m, opt, update=3, step=2, extra={})
    except OSError as e:
        out["save_error"] = torch.tensor(list(str(e).encode()), dtype=torch.uint8)
    return out


def _text(t: torch.Tensor) -> str:
    return bytes(t.tolist()).decode()


def test_an_error_on_one_rank_is_an_error_on_every_rank_and_one_process_loads_on_two(run, tmp_path):
    d, _ = run(3)
    corrupt = tmp_path / "update-000002"
    shutil.copytree(d, corrupt)
    meta = json.loads((corrupt / "trainer.json").read_text())
    victim = next(f for f, r in meta["optimizer_files"].items() if r == 1)
    data = bytearray((corrupt / victim).read_bytes())
    data[-5] ^= 0x01
    (corrupt / victim).write_bytes(bytes(data))
    # the other way round too: one process, ZeRO-0, loaded on two ranks under ZeRO-3
    model = tiny_model()
    opt = build_optimizer(model, OptimConfig(**OPTIM))
    for update in range(2):
        _grads(model, update)
        optimizer_step(model, opt, OptimConfig(**OPTIM), update, UPDATES)
    clean = ck.save_checkpoint(tmp_path / "one" / "update-000002", model, opt, update=2, step=1, extra={})
    saves = tmp_path / "saves"
    saves.mkdir()
    ranks = run_ranks(2, load_rank, str(clean), str(corrupt), str(saves), timeout=120)
    for r in ranks:
        _assert_same(_part(r, "full"), {k: v for k, v in _held(model, opt).items()})
    loads = [_text(r["load_error"]) for r in ranks]
    assert loads[0] == loads[1] and f"{victim} does not match its sha256" in loads[0]
    assert [_text(r["save_error"]) for r in ranks] == ["disk full (on rank 1, writing the optimizer state)",
                                                       "disk full"]
    assert list(saves.iterdir()) == []  # no checkpoint, no temporary directory
