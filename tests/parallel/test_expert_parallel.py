"""Expert parallelism (longstraw/parallel/experts.py) under ZeRO-3, against one process: the exact gradient equals
`naive`'s (fp64), every rank holds E / N experts and FSDP never gathers them, a rank that gets no rows still takes
part, uneven splits are refused, and a checkpoint written by expert-parallel ranks loads in one process."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import longstraw as ls
from longstraw.models.common.moe import Experts
from longstraw.parallel import SequenceParallel, full_tensor, local_shard, shard_model
from longstraw.parallel.experts import expert_modules
from longstraw.train import checkpoint as ck
from longstraw.train.config import OptimConfig
from longstraw.train.optim import build_optimizer, optimizer_step
from tests.conftest import GLM, flat_grad, rel_err, with_adapters
from tests.parallel.fsdp_gathers import watching_weight_gathers
from tests.parallel.launch import run_ranks
from tests.parallel.test_sequence_parallel import group

ADV = [0.7, -0.2, 1.3, 0.4]
CHUNK = 8
OPTIM = dict(lr=1e-2, weight_decay=0.1, grad_clip=0.5)


def _glm(lora: bool, skew: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    m = ls.build_model(GLM, dtype=torch.float64)
    if skew:  # every token picks experts 0-3: with 2 ranks, rank 1's experts get no rows
        for moe in (layer.mlp for layer in m.model.layers if hasattr(layer.mlp, "gate")):
            moe.gate.e_score_correction_bias[:4] = 100.0
    return with_adapters(m, ("q_b_proj", "o_proj")) if lora else m


def _responses():
    prompt, responses = group("glm_moe_dsa")
    return prompt, responses + responses[:1]


@contextmanager
def largest_weight_gather():
    """Within, the yielded list holds the element count of FSDP2's largest parameter all-gather output."""
    largest = [0]

    def seen(output: torch.Tensor) -> None:
        largest[0] = max(largest[0], output.numel())

    with watching_weight_gathers(seen):
        yield largest


def ep_rank(rank: int, world: int, lora: bool, skew: bool) -> dict[str, torch.Tensor]:
    """One exact ZeRO-3 step with the experts split over the ranks: its gradient, the experts this rank holds,
    the rows its experts received, and FSDP's largest all-gather."""
    sp = SequenceParallel()
    m = shard_model(_glm(lora, skew), 3, sp, expert_parallel=True)
    received, run = [], Experts._sorted

    def counted(self, rows, *args):  # what this rank's experts run on: the rows routed to them
        received.append(rows.shape[0])
        return run(self, rows, *args)

    Experts._sorted = counted
    prompt, responses = _responses()
    with largest_weight_gather() as largest:
        ls.grpo_backward(m, prompt, responses, ADV, mode="exact", parallel=sp,
                         engine=ls.EngineConfig(prompt_chunk=CHUNK))
    grads = [full_tensor(p.grad) if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)
             for p in m.parameters()]
    experts = expert_modules(m)
    return {"grad": torch.cat([g.flatten() for g in grads]), "largest_gather": torch.tensor(largest[0]),
            "local_experts": torch.tensor([local_shard(e.gate_up_proj).shape[0] for e in experts]),
            "sharded_experts": torch.tensor([e.ep is not None for e in experts]),
            "rows_routed": torch.tensor(sum(received))}


def _non_expert_unit(m: torch.nn.Module) -> int:
    """Elements of the largest FSDP unit with the experts left out: a decoder layer, or the root."""
    experts = {id(p) for e in expert_modules(m) for p in e.parameters()}
    layers = max(sum(p.numel() for p in layer.parameters() if id(p) not in experts) for layer in m.model.layers)
    root = sum(p.numel() for mod in (m.model.embed_tokens, m.model.norm, m.lm_head) for p in mod.parameters())
    return max(layers, root)


@pytest.mark.parametrize("world,lora,skew", [(2, False, False), (4, False, False), (2, True, False),
                                             (2, False, True)])
def test_expert_parallel_gradient_equals_one_process_naive(world, lora, skew):
    """fp64, every parameter's gradient (LoRA: the adapters' and the routers' through the routed tokens), with
    `skew` every token routed to rank 0's experts (rank 1 runs its experts on no rows, and must still join the
    all-to-alls of the forward and of the backward)."""
    m = _glm(lora, skew)
    prompt, responses = _responses()
    ls.grpo_backward(m, prompt, responses, ADV, mode="naive")
    want = flat_grad(m)
    ranks = run_ranks(world, ep_rank, lora, skew, timeout=180)
    experts = GLM["n_routed_experts"]
    moe_layers = GLM["num_hidden_layers"] - GLM["first_k_dense_replace"]
    slack = world * len(list(m.parameters()))  # FSDP pads each parameter's shard
    for r in ranks:
        assert rel_err(r["grad"], want) <= 1e-10
        assert r["local_experts"].tolist() == [experts // world] * moe_layers
        assert bool(r["sharded_experts"].all())
        assert 0 < int(r["largest_gather"]) <= _non_expert_unit(m) + slack  # 0: the hook missed FSDP's gathers
    if skew:
        assert int(ranks[0]["rows_routed"]) > 0 and int(ranks[1]["rows_routed"]) == 0
    else:
        assert all(int(r["rows_routed"]) > 0 for r in ranks)


def _adapted_experts() -> torch.nn.Module:
    return with_adapters(_glm(False, False), ("down_proj",))  # PEFT wraps the experts' fused down_proj too


def refused_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Experts that do not split over the ranks (3 ranks, 8 experts) or that carry LoRA adapters: refused when
    asked for, FSDP's units when left to `auto`."""
    out = {}
    for case, build in (("uneven", lambda: _glm(False, False)), ("adapted", _adapted_experts)):
        try:
            shard_model(build(), 3, SequenceParallel(), expert_parallel=True)
        except ValueError as e:
            out[f"{case}.error"] = torch.tensor(list(str(e).encode()), dtype=torch.uint8)
        auto = shard_model(build(), 3, SequenceParallel())
        out[f"{case}.sharded_experts"] = torch.tensor([e.ep is not None for e in expert_modules(auto)])
    return out


def test_uneven_or_adapted_experts_are_refused_or_left_to_fsdp():
    for r in run_ranks(3, refused_rank, timeout=120):
        assert "split evenly over the 3 ranks" in bytes(r["uneven.error"].tolist()).decode()
        assert "optim.expert_parallel: false" in bytes(r["adapted.error"].tolist()).decode()
        for case in ("uneven", "adapted"):
            assert not bool(r[f"{case}.sharded_experts"].any())


def checkpoint_rank(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    """One step and one AdamW update with expert parallelism, then a checkpoint: the weights every rank saw."""
    sp = SequenceParallel()
    cfg = OptimConfig(**OPTIM, zero_stage=3)
    m = shard_model(_glm(False, False), 3, sp, expert_parallel=True)
    opt = build_optimizer(m, cfg)
    prompt, responses = _responses()
    ls.grpo_backward(m, prompt, responses, ADV, mode="exact", parallel=sp, engine=ls.EngineConfig(prompt_chunk=CHUNK))
    optimizer_step(m, opt, cfg, 0, 2)
    ck.save_checkpoint(Path(root) / "update-000001", m, opt, update=1, step=0, extra={})
    return {n: full_tensor(p.detach()).clone() for n, p in m.named_parameters()}


def test_an_expert_parallel_checkpoint_loads_in_one_process(tmp_path):
    """The experts' shards are saved where FSDP's would be: one process loads the whole experts, and its weights
    equal those of a one-process update on the same gradient (to the checkpoint's dtype)."""
    m = _glm(False, False)
    opt = build_optimizer(m, OptimConfig(**OPTIM))
    prompt, responses = _responses()
    ls.grpo_backward(m, prompt, responses, ADV, mode="naive")
    optimizer_step(m, opt, OptimConfig(**OPTIM), 0, 2)
    ranks = run_ranks(2, checkpoint_rank, str(tmp_path), timeout=180)
    loaded, _, meta = ck.load_checkpoint(tmp_path / "update-000001", lambda x: build_optimizer(x, OptimConfig(**OPTIM)),
                                         restore_rng=False)
    assert meta["world_size"] == 2
    want = dict(m.named_parameters())
    for n, p in loaded.named_parameters():  # loaded in the checkpoint's dtype
        assert torch.equal(p.detach(), ranks[0][n].to(p.dtype)), n
        assert float((p.detach().double() - want[n].detach()).abs().max()) <= 1e-6, n
