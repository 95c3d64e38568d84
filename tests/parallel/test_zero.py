"""The optimizer sharded over gloo ranks (ZeRO-1: torch's ZeroRedundancyOptimizer; ZeRO-2/3: FSDP2 via
`shard_model`) with the prefix state sharded too: the weights after two AdamW steps equal one process's.

Two checks. End to end (fp64): the sharded run against a one-process run of `naive` mode; AdamW divides by
sqrt(v) + eps, so in fp32 gradient elements near eps turn the gradients' rounding (different summation orders)
into weight differences of ~1e-4, and only fp64 can compare whole runs at 1e-9. The sharding itself (fp32): each
rank also steps an unsharded copy of the model with a plain AdamW on the same (gathered) gradient; the two must
agree to 1e-6."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import longstraw as ls
from longstraw.parallel import SequenceParallel, full_tensor, local_shard, shard_model
from longstraw.train.config import OptimConfig
from longstraw.train.optim import build_optimizer, optimizer_step
from tests.conftest import GLM, flat_grad, rel_err, tiny_model
from tests.parallel.fsdp_gathers import watching_weight_gathers
from tests.parallel.launch import run_ranks
from tests.parallel.test_sequence_parallel import ADV, CHUNK, PROMPTS, group, layout

ADV4 = ADV + [0.4]
OPTIM = dict(lr=1e-2, weight_decay=0.1, grad_clip=0.5)


def _build(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    if arch == "glm_moe_dsa":
        torch.manual_seed(0)
        return ls.build_model(GLM, dtype=dtype)
    return tiny_model(arch, dtype=dtype)


def _responses(arch: str):
    prompt, responses = group(arch)
    return prompt, responses + responses[:1]  # G = 4: splits over 2 data-parallel groups


def _sp(world: int, dp: int) -> SequenceParallel:
    if dp == 1:
        return SequenceParallel()
    from torch.distributed.device_mesh import init_device_mesh

    return SequenceParallel.from_mesh(init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "sp")))


def zero_rank(rank: int, world: int, arch: str, stage: int, dp: int, dtype: str, twin: bool) -> dict[str, torch.Tensor]:
    """Two sharded GRPO + AdamW steps; with `twin`, an unsharded copy stepped on the same gradients alongside."""
    dtype = getattr(torch, dtype)
    sp = _sp(world, dp)
    cfg = OptimConfig(**OPTIM, zero_stage=stage)
    m = _build(arch, dtype)
    if stage >= 2:
        shard_model(m, stage, sp)
    opt = build_optimizer(m, cfg)
    ref = _build(arch, dtype) if twin else None
    ref_opt = build_optimizer(ref, OptimConfig(**OPTIM)) if twin else None
    prompt, responses = _responses(arch)
    out = {}
    for update in range(2):
        ls.grpo_backward(m, prompt, responses, ADV4, engine=ls.EngineConfig(prompt_chunk=CHUNK), parallel=sp)
        if twin:
            for p, q in zip(m.parameters(), ref.parameters()):
                q.grad = full_tensor(p.grad).clone()
            out[f"ref_norm.{update}"] = torch.tensor(optimizer_step(ref, ref_opt, OptimConfig(**OPTIM), update, 2)["grad_norm"])
        out[f"norm.{update}"] = torch.tensor(optimizer_step(m, opt, cfg, update, 2)["grad_norm"])
    out |= {"weights": torch.cat([full_tensor(p.detach()).flatten() for p in m.parameters()]),
            "moments": torch.tensor(_moments(opt)), "params_here": torch.tensor(sum(local_shard(p).numel() for p in m.parameters()))}
    if twin:
        out["ref_weights"] = torch.cat([p.detach().flatten() for p in ref.parameters()])
        out["ref_moments"] = torch.tensor(_moments(ref_opt))
    return out


def _moments(opt: torch.optim.Optimizer) -> int:
    local = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer's own AdamW holds this rank's share
    return sum(local_shard(t).numel() for st in local.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))


def _check_shares(ranks: list[dict], params: int, moments: int, stage: int) -> None:
    """Each rank holds the moments (stage >= 1) and the weights (stage >= 2) of its share only (`moments`: one
    process's count; parameters that never had a gradient, e.g. unrouted experts, have none)."""
    for key, sharded, total in (("moments", stage >= 1, moments), ("params_here", stage >= 2, params)):
        if sharded:
            assert sum(int(r[key]) for r in ranks) == total
            assert all(int(r[key]) < 0.75 * total for r in ranks)
        else:
            assert all(int(r[key]) == total for r in ranks)


@pytest.mark.parametrize("stage,world,dp,arch", [(0, 2, 1, "qwen3_5_text"), (1, 2, 1, "qwen3_5_text"),
                                                 (2, 2, 1, "qwen3_5_text"), (3, 2, 1, "qwen3_5_text"),
                                                 (3, 4, 2, "qwen3_5_text"), (3, 2, 1, "glm_moe_dsa")])
def test_two_steps_equal_one_process_adamw(stage, world, dp, arch):
    """fp64, against `naive` on one process. Qwen3.5 (Gated DeltaNet + attention) and GLM-5 (MLA, which reads
    kv_b_proj.weight directly, DSA, fused MoE experts); (3, 4, 2) is ZeRO-3 over a 2 x 2 mesh: two
    sequence-parallel groups, each replaying half of the branches."""
    m = _build(arch, torch.float64)
    opt = build_optimizer(m, OptimConfig(**OPTIM))
    prompt, responses = _responses(arch)
    start = torch.cat([p.detach().flatten() for p in m.parameters()])
    for update in range(2):
        ls.grpo_backward(m, prompt, responses, ADV4, mode="naive", engine=ls.EngineConfig(prompt_chunk=CHUNK))
        optimizer_step(m, opt, OptimConfig(**OPTIM), update, 2)
    want = torch.cat([p.detach().flatten() for p in m.parameters()])
    assert rel_err(want, start) > 1e-3  # the steps moved the weights
    ranks = run_ranks(world, zero_rank, arch, stage, dp, "float64", False, timeout=150)
    for r in ranks:
        assert float((r["weights"] - want).abs().max()) <= 1e-9
    _check_shares(ranks, sum(p.numel() for p in m.parameters()), _moments(opt), stage)


@pytest.mark.parametrize("stage,world,dp,arch", [(1, 2, 1, "qwen3"), (2, 2, 1, "qwen3"), (3, 2, 1, "qwen3_5_text"),
                                                 (3, 4, 2, "qwen3")])
def test_sharded_adamw_equals_unsharded_on_the_same_gradients_fp32(stage, world, dp, arch):
    ranks = run_ranks(world, zero_rank, arch, stage, dp, "float32", True, timeout=150)
    for r in ranks:
        assert float((r["weights"] - r["ref_weights"]).abs().max()) <= 1e-6
        for update in range(2):
            assert float(r[f"norm.{update}"]) == pytest.approx(float(r[f"ref_norm.{update}"]), rel=1e-5)
        assert torch.equal(r["weights"], ranks[0]["weights"])
    assert rel_err(ranks[0]["weights"], torch.cat([p.detach().flatten() for p in _build(arch, torch.float32).parameters()])) > 1e-3
    _check_shares(ranks, ranks[0]["weights"].numel(), int(ranks[0]["ref_moments"]), stage)


def bad_stage_rank(rank: int, world: int, case: str) -> dict[str, torch.Tensor]:
    m = tiny_model("qwen3")
    try:
        if case == "unsharded":
            build_optimizer(m, OptimConfig(zero_stage=3))
        elif case == "mismatch":
            build_optimizer(shard_model(m, 2), OptimConfig(zero_stage=1))
        else:
            shard_model(m, 1)
    except ValueError as e:
        return {"error": torch.tensor(list(str(e).encode()), dtype=torch.uint8)}
    return {}


@pytest.mark.parametrize("case,message", [("unsharded", r"needs the model sharded first: longstraw\.parallel\.shard_model"),
                                          ("mismatch", "the model is sharded .* but optim.zero_stage is 1"),
                                          ("stage1", "stage 2 or 3, not 1")])
def test_zero_stage_and_model_must_agree(case, message):
    import re

    for r in run_ranks(2, bad_stage_rank, case, timeout=60):
        assert re.search(message, bytes(r["error"].tolist()).decode())


@contextmanager
def counting_weight_gathers() -> Iterator[list]:
    """Within, each of FSDP2's parameter all-gathers appends to the yielded list."""
    calls = []
    with watching_weight_gathers(lambda output: calls.append(1)):
        yield calls


def layer_major_rank(rank: int, world: int, arch: str) -> dict[str, torch.Tensor]:
    """ZeRO-3 exact capture with no kept graphs: its state rows and boundary states, and FSDP's all-gathers."""
    sp = SequenceParallel()
    m = shard_model(_build(arch, torch.float64), 3, sp)
    prompt, _ = group(arch)
    with counting_weight_gathers() as calls:
        state = ls.capture(m, prompt, ls.EngineConfig(prompt_chunk=CHUNK, prompt_graph_budget=0, boundary_every=1),
                           parallel=sp, exact=True)
    out = {f"state.{i}.{j}": t for i, layer in enumerate(state.layers) for j, t in enumerate(layer.tensors())}
    out |= {f"boundary.{c}.{i}.{j}": t for c, b in state.boundaries.items() for i, s in b.items()
            for j, t in enumerate(s.tensors())}
    return out | {"gathers": torch.tensor(len(calls)), "chunks": torch.tensor(len(state.chunks))}


@pytest.mark.parametrize("arch", ["qwen3_5_text", "glm_moe_dsa"])
def test_zero3_capture_gathers_each_layer_once(arch):
    """Under ZeRO-3 capture runs layer-major: one all-gather per layer (and one for the root), not one per layer
    per chunk, and the state and boundary states are one process's (chunk by chunk, unsharded)."""
    m = _build(arch, torch.float64)
    prompt, _ = group(arch)
    want = ls.capture(m, prompt, ls.EngineConfig(prompt_chunk=CHUNK, prompt_graph_budget=0, boundary_every=1),
                      exact=True)
    world = 2
    ranks = run_ranks(world, layer_major_rank, arch, timeout=150)
    _, positions = layout(PROMPTS[arch] - 1, world)
    layers = m.config.num_hidden_layers
    for rank, (r, pos) in enumerate(zip(ranks, positions)):
        assert int(r["chunks"]) > 4 and int(r["gathers"]) == layers + 1, int(r["gathers"])
        for i, layer in enumerate(want.layers):
            for j, whole in enumerate(layer.tensors()):
                mine = whole if layer.token_axis is None else whole.index_select(-2, pos)
                assert torch.allclose(r[f"state.{i}.{j}"], mine, rtol=1e-10, atol=1e-12), (i, j)
        kept = {c for c in want.boundaries if c % world == rank}  # every chunk's, kept by the ranks in turn
        assert {int(k.split(".")[1]) for k in r if k.startswith("boundary.")} == {c for c in kept if want.boundaries[c]}
        for c in kept:
            for i, s in want.boundaries[c].items():
                for j, t in enumerate(s.tensors()):
                    assert torch.allclose(r[f"boundary.{c}.{i}.{j}"], t, rtol=1e-10, atol=1e-12), (c, i, j)


def zero3_step_rank(rank: int, world: int, arch: str, chunk: int) -> dict[str, torch.Tensor]:
    """One exact ZeRO-3 step with every prompt chunk recomputed (layer-major by default): the gradient and the
    number of FSDP's all-gathers."""
    sp = SequenceParallel()
    m = shard_model(_build(arch, torch.float64), 3, sp)
    prompt, responses = group(arch)
    with counting_weight_gathers() as calls:
        ls.grpo_backward(m, prompt, responses, ADV, mode="exact", parallel=sp,
                         engine=ls.EngineConfig(prompt_chunk=chunk, prompt_graph_budget=0))
    grads = [full_tensor(p.grad) if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype) for p in m.parameters()]
    return {"grad": torch.cat([g.flatten() for g in grads]), "gathers": torch.tensor(len(calls))}


@pytest.mark.parametrize("arch", ["qwen3_5_text", "glm_moe_dsa"])
def test_zero3_exact_step_gathers_do_not_grow_with_chunks(arch):
    """Under ZeRO-3 capture and the prompt backward run layer-major: halving the chunk (twice the chunks) leaves
    the number of weight all-gathers of a step unchanged, and the gradient is naive's on one process."""
    m = _build(arch, torch.float64)
    prompt, responses = group(arch)
    ls.grpo_backward(m, prompt, responses, ADV, mode="naive")
    want = flat_grad(m)
    gathers = {}
    for chunk in (CHUNK, 2 * CHUNK):
        ranks = run_ranks(2, zero3_step_rank, arch, chunk, timeout=150)
        for r in ranks:
            assert rel_err(r["grad"], want) <= 1e-10
        gathers[chunk] = int(ranks[0]["gathers"])
    assert gathers[CHUNK] == gathers[2 * CHUNK], gathers
