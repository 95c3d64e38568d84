"""Mixed precision (`optim.mixed_precision`): bf16 weights and compute, fp32 master weights and AdamW moments,
gradients reduced in fp32.

- ZeRO-0, one process: the masters are what an fp32 model stepped by torch's AdamW from the same weights on the
  bf16 model's gradients (cast to fp32) holds, and the bf16 weights are their rounding (an independent reference).
- 2 gloo ranks: ZeRO-3 (FSDP2's bf16 shards reduce-scattered in fp32, each rank the masters of its shards) and
  ZeRO-1 (each rank the masters of its partition) give one process's masters.
- Checkpoints save the fp32 master (the HF export stays bf16) and a resume steps on from it; on 2 ranks under
  ZeRO-3 too.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import longstraw.train.checkpoint as ck
from longstraw.parallel import SequenceParallel, shard_model
from longstraw.train.config import OptimConfig, TrainConfig
from longstraw.train.optim import MasterAdamW, build_optimizer, optimizer_step
from longstraw.train.worker import Worker
from tests.conftest import tiny_model
from tests.parallel.launch import run_ranks
from tests.train.optim_cases import OPTIM, UPDATES, engine_rank, loss_of, masters, mixed_rank, run_updates, weights

MIXED = OptimConfig(**OPTIM, mixed_precision=True)


def _reference_step(ref: torch.nn.Module, ref_opt: torch.optim.Optimizer, grads: list[torch.Tensor], update: int):
    """fp32 model, torch AdamW, the given fp32 gradients, global-norm clipping as configured (constant lr)."""
    for q, g in zip(ref.parameters(), grads):
        q.grad = g
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), OPTIM["grad_clip"])
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def one_process() -> dict[str, torch.Tensor]:
    """ZeRO-0 mixed precision on one process, with an independent fp32 reference stepped alongside."""
    model = tiny_model(dtype=torch.bfloat16)
    ref = copy.deepcopy(model).float()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=OPTIM["lr"], weight_decay=OPTIM["weight_decay"])
    pure = copy.deepcopy(model)  # bf16 weights and bf16 AdamW: no master
    pure_cfg = OptimConfig(**OPTIM)
    pure_opt = build_optimizer(pure, pure_cfg)
    opt = build_optimizer(model, MIXED)
    assert isinstance(opt, MasterAdamW)
    start = weights(model)
    for update in range(UPDATES):
        loss_of(model, update).backward()
        grads = [p.grad.float() for p in model.parameters()]  # the bf16 gradients, cast
        optimizer_step(model, opt, MIXED, update, UPDATES)
        _reference_step(ref, ref_opt, grads, update)
        loss_of(pure, update).backward()
        optimizer_step(pure, pure_opt, pure_cfg, update, UPDATES)
    return {"start": start, "weights": weights(model), "masters": masters(model, opt),
            "ref": torch.cat([p.detach().flatten() for p in ref.parameters()]),
            "ref_bf16": torch.cat([p.detach().to(torch.bfloat16).float().flatten() for p in ref.parameters()]),
            "pure": weights(pure)}


def test_bf16_weights_with_fp32_master_give_the_fp32_master_update(one_process):
    r = one_process
    diff = float((r["masters"] - r["ref"]).abs().max())
    print(f"mixed precision ZeRO-0: max |master - fp32 reference| = {diff:.3g}")
    assert diff <= 1e-6
    assert torch.equal(r["weights"], r["ref_bf16"])  # the bf16 weights: the master rounded, once per step
    assert float((r["weights"] - r["start"]).abs().max()) > 1e-3  # the updates moved the weights
    # the master keeps what bf16 rounds away: pure bf16 AdamW (no master) ends elsewhere
    assert float((r["masters"] - r["weights"]).abs().max()) > 0
    assert float((r["pure"] - r["ref_bf16"]).abs().max()) > 0


@pytest.mark.parametrize("stage", [3, 1])
def test_two_ranks_give_one_process_masters(stage, one_process):
    """ZeRO-3: FSDP2 gathers the bf16 shards and reduce-scatters the gradients in fp32, each rank steps the fp32
    masters of its shards; ZeRO-1: bf16 parameters, each rank the masters of its partition, broadcast after the
    step."""
    ranks = run_ranks(2, mixed_rank, stage, timeout=300)
    for r in ranks:
        diff = float((r["masters"] - one_process["masters"]).abs().max())
        print(f"mixed precision ZeRO-{stage} on 2 ranks: max |master - one process| = {diff:.3g}")
        assert diff <= 1e-6
        # the bf16 weights: the masters rounded (a master within 1.2e-7 of one process's may round the other way)
        assert bool(((r["weights"] - one_process["weights"]).abs() <= one_process["weights"].abs() * 2 ** -7).all())
        assert bool(r["bf16_params"])  # the engine computes with bf16 parameters at every stage


def test_mixed_precision_needs_bf16(tmp_path):
    with pytest.raises(ValueError, match="set dtype: bfloat16"):
        TrainConfig(model={"path": str(tmp_path)}, optim={"mixed_precision": True})
    cfg = TrainConfig(model={"path": str(tmp_path)}, dtype="bfloat16", optim={"mixed_precision": True})
    assert cfg.optim.mixed_precision
    with pytest.raises(ValueError, match="fp32 masters of bf16 weights"):
        build_optimizer(tiny_model(), MIXED)  # an fp32 model at ZeRO-0


def _export_dtypes(d: Path) -> set[str]:
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_checkpoint_keeps_the_fp32_master(offload, tmp_path):
    if offload != "none":
        pytest.importorskip("deepspeed", reason="optim.offload needs DeepSpeed (make install)")
    cfg = OptimConfig(**OPTIM, mixed_precision=True, offload=offload)
    model = tiny_model(dtype=torch.bfloat16)
    opt = build_optimizer(model, cfg)
    run_updates(model, opt, cfg, 2)
    saved = masters(model, opt)
    assert float((saved - weights(model)).abs().max()) > 0  # the master holds more than the bf16 export
    d = ck.save_checkpoint(tmp_path / "update-000002", model, opt, update=2, step=1, extra={})
    meta = json.loads((d / "trainer.json").read_text())
    master_keys = [k for k in meta["optimizer_state"] if k.endswith(".master")]
    assert len(master_keys) == sum(1 for _ in model.parameters())
    assert {meta["optimizer_state"][k]["dtype"] for k in master_keys} == {"float32"}
    assert _export_dtypes(d) == {"BF16"}
    m2, opt2, _ = ck.load_checkpoint(d, lambda m: build_optimizer(m, cfg), dtype=torch.bfloat16)
    assert torch.equal(masters(m2, opt2), saved)
    assert torch.equal(weights(m2), weights(model))
    s1, s2 = opt.state, opt2.state
    for p, q in zip(model.parameters(), m2.parameters()):
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1[p][field], s2[q][field]), field
    for m, o in ((model, opt), (m2, opt2)):  # one more update each: the resumed run continues exactly
        loss_of(m, 2).backward()
        optimizer_step(m, o, cfg, 2, UPDATES)
    # bitwise with torch's AdamW; DeepSpeed's CPU Adam computes beta^t by pow() in a new optimizer, by repeated
    # products in the one that ran on: last-bit differences in the bias correction
    diff = float((masters(m2, opt2) - masters(model, opt)).abs().max())
    print(f"checkpoint resume, mixed precision, offload {offload}: max |master - continued| = {diff:.3g}")
    assert diff <= (0.0 if offload == "none" else 1e-6)
    # a run without mixed precision reads the checkpoint too (its weights: the bf16 export; the master skipped)
    m3, opt3, _ = ck.load_checkpoint(d, lambda m: build_optimizer(m, OptimConfig(**OPTIM)), dtype=torch.bfloat16)
    assert not isinstance(opt3, MasterAdamW) and "master" not in next(iter(opt3.state.values()))


def test_a_checkpoint_without_master_starts_the_master_from_the_weights(tmp_path):
    model = tiny_model(dtype=torch.bfloat16)
    plain = OptimConfig(**OPTIM)
    opt = build_optimizer(model, plain)
    run_updates(model, opt, plain, 1)
    d = ck.save_checkpoint(tmp_path / "update-000001", model, opt, update=1, step=0, extra={})
    m2, opt2, _ = ck.load_checkpoint(d, lambda m: build_optimizer(m, MIXED), dtype=torch.bfloat16)
    assert torch.equal(masters(m2, opt2), weights(model))
    for p, q in zip(model.parameters(), m2.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"].float(), opt2.state[q]["exp_avg"])


def fsdp_checkpoint_rank(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    """ZeRO-3 mixed precision: 2 updates, save, load on the same 2 ranks (the bf16 export, the fp32 masters from
    the optimizer state), one more update on both."""
    cfg = OptimConfig(**OPTIM, zero_stage=3, mixed_precision=True)
    sp = SequenceParallel()
    m = shard_model(tiny_model(dtype=torch.bfloat16), 3, sp, mixed_precision=True)
    opt = build_optimizer(m, cfg)
    run_updates(m, opt, cfg, 2)
    d = ck.save_checkpoint(Path(root) / "update-000002", m, opt, update=2, step=1, extra={})
    out = {"saved": masters(m, opt), "bf16_weights": weights(m)}

    def loader(read, *_):
        return shard_model(read(), 3, sp, mixed_precision=True)

    m2, opt2, _ = ck.load_checkpoint(d, lambda model: build_optimizer(model, cfg), dtype=torch.bfloat16, loader=loader)
    out["loaded"] = masters(m2, opt2)
    out["loaded_params"] = weights(m2)
    for model, o, tag in ((m, opt, "cont"), (m2, opt2, "resumed")):
        loss_of(model, 2).backward()
        optimizer_step(model, o, cfg, 2, UPDATES)
        out[tag] = masters(model, o)
    if rank == 0:
        out["export_bf16"] = torch.tensor(_export_dtypes(d) == {"BF16"})
    return out


def test_fsdp_checkpoint_keeps_the_fp32_master_on_two_ranks(tmp_path):
    ranks = run_ranks(2, fsdp_checkpoint_rank, str(tmp_path), timeout=300)
    for r in ranks:
        assert float((r["saved"] - r["bf16_weights"]).abs().max()) > 0
        assert torch.equal(r["loaded"], r["saved"]) and torch.equal(r["loaded_params"], r["bf16_weights"])
        assert torch.equal(r["resumed"], r["cont"])
    assert bool(ranks[0]["export_bf16"])


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_worker_steps_and_resumes_the_fp32_master(offload, tmp_path):
    """The training worker with dtype bfloat16 + mixed precision (and offload): the optimizer op steps the masters,
    commits them with the checkpoint, and a fresh worker (a resumed job) holds the same masters and bf16 weights."""
    if offload != "none":
        pytest.importorskip("deepspeed", reason="optim.offload needs DeepSpeed (make install)")
    from tests.train.test_train_inputs import make_cfg
    from tests.train.test_worker import replay, step_group

    cfg = make_cfg(tmp_path, dtype="bfloat16", optim={"lr": 1e-3, "mixed_precision": True, "offload": offload})
    w, init, state, roll, rew = step_group(cfg)
    assert isinstance(w.optim, MasterAdamW) and next(w.model.parameters()).dtype == torch.bfloat16
    before = masters(w.model, w.optim)
    replay(w, state, roll, rew, ([0, 1, 2, 3],))
    w.prompt(w.weights_version, state, 0, 0, 0)
    out = w.optimizer(init["weights_version"], update=0, step=0, record={})
    after = masters(w.model, w.optim)
    assert out["skipped"] == 0.0 and float((after - before).abs().max()) > 0
    assert float((after - weights(w.model)).abs().max()) > 0  # finer than the bf16 weights
    assert _export_dtypes(Path(out["checkpoint"])) == {"BF16"}
    fresh = Worker(cfg)
    assert fresh.start()["update"] == 1
    assert torch.equal(masters(fresh.model, fresh.optim), after)
    assert torch.equal(weights(fresh.model), weights(w.model))


@pytest.mark.parametrize("arch,offload", [("qwen3_5_text", "none"), ("glm_moe_dsa", "none"), ("qwen3", "cpu")])
def test_zero3_mixed_precision_under_the_engine(arch, offload):
    """The engine's exact GRPO step on 2 ranks under ZeRO-3 with mixed precision (bf16 shards, each rank's share
    of the gradient reduce-scattered in fp32; GLM-5's fp32 router and indexer head as units of their own): the
    sharded masters equal an unsharded ZeRO-0 mixed-precision step on the same gradients, and the ranks agree;
    with offload cpu the sharded masters are stepped on the host by DeepSpeed's CPU Adam."""
    if offload != "none":
        pytest.importorskip("deepspeed", reason="optim.offload needs DeepSpeed (make install)")
    ranks = run_ranks(2, engine_rank, arch, offload, timeout=300)
    for r in ranks:
        diff = float((r["masters"] - r["twin"]).abs().max())
        print(f"ZeRO-3 mixed under the engine ({arch}, offload {offload}): max |master - unsharded twin| = "
              f"{diff:.3g}")
        assert diff <= 1e-6
        assert bool(r["bf16_params"])
    assert torch.equal(ranks[0]["masters"], ranks[1]["masters"])
