"""Shared by tests/train/test_offload.py and test_mixed_precision.py: a tiny model's loss, three optimizer updates,
and the rank functions run on 2 gloo ranks (tests.parallel.launch.run_ranks; spawned processes import them from
here)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longstraw.parallel import SequenceParallel, full_tensor, local_shard, shard_model
from longstraw.train.config import OptimConfig
from longstraw.train.optim import MasterAdamW, build_optimizer, optimizer_step
from tests.conftest import tiny_model

OPTIM = dict(lr=1e-3, weight_decay=0.1, grad_clip=0.5)  # lr 1e-2 turns the kernels' last-bit differences into 1.5e-6 by update 3 (weight-dependent gradients)
UPDATES = 3
IDS = (torch.arange(2 * 12).reshape(2, 12) * 7 + 3) % 97  # tiny vocab 97


def loss_of(model: torch.nn.Module, update: int) -> torch.Tensor:
    """Next-token cross entropy of a fixed batch (shifted by the update, so each step's gradient differs)."""
    ids = (IDS + update) % 97
    logits = model(ids)[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([full_tensor(p.detach()).float().flatten() for p in model.parameters()])


def masters(model: torch.nn.Module, opt: MasterAdamW) -> torch.Tensor:
    """The fp32 master weights, whole, in the model's parameter order (a collective under FSDP / ZeRO-1)."""
    state = opt.state
    out = []
    for p in model.parameters():
        m = state[p]["master"] if p in state else None
        if opt.cfg.zero_stage == 1:  # each rank holds its partition: the owner sends it
            t = (m if m is not None else torch.zeros(p.shape)).clone()
            torch.distributed.broadcast(t, src=opt.owner[id(p)])
            out.append(t.flatten())
        else:
            out.append(full_tensor(m).flatten())
    return torch.cat(out)


def run_updates(model: torch.nn.Module, opt, cfg: OptimConfig, updates: int = UPDATES) -> list[float]:
    norms = []
    for update in range(updates):
        loss_of(model, update).backward()
        norms.append(optimizer_step(model, opt, cfg, update, updates)["grad_norm"])
    return norms


# The device each backend's collectives take tensors on, written here apart from the library's rule
# (longstraw.train.device): NCCL fails on a host tensor, which gloo, standing in for it on CPU, would accept.
BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


def device_checked_all_reduce(reductions: list[str]):
    """torch.distributed.all_reduce, asserting that the tensor is on the device its group's backend takes, and
    recording the backend of each call in `reductions`."""
    real = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        backend = str(dist.get_backend(group))
        assert tensor.device.type == BACKEND_DEVICE[backend], \
            f"all_reduce of a {tensor.device.type} tensor over {backend} (which takes {BACKEND_DEVICE[backend]})"
        reductions.append(backend)
        return real(tensor, *args, **kwargs)

    return all_reduce


def offload_rank(rank: int, world: int, stage: int, offload: str, nvme_root: str) -> dict[str, torch.Tensor]:
    """`UPDATES` updates of a tiny fp32 model with the optimizer offloaded, sharded by `stage` over the gloo ranks
    (every rank computes the whole batch's loss: the same gradient everywhere, FSDP dividing its sum by 2). Every
    all_reduce is checked to run on its backend's device (the clip norm of host gradients among them)."""
    reductions: list[str] = []
    dist.all_reduce = device_checked_all_reduce(reductions)  # this spawned rank's own module: nothing to restore
    kw = dict(nvme_path=f"{nvme_root}/rank{rank}") if offload == "nvme" else {}
    cfg = OptimConfig(**OPTIM, zero_stage=stage, offload=offload, **kw)
    m = tiny_model()
    if stage >= 2:
        shard_model(m, stage, SequenceParallel())
    opt = build_optimizer(m, cfg)
    norms = run_updates(m, opt, cfg)
    held = sum(local_shard(t).numel() for st in opt.state.values() for k, t in st.items() if k == "exp_avg")
    on_host = all(local_shard(t).device.type == "cpu" for st in opt.state.values() for t in st.values())
    return {"weights": weights(m), "norms": torch.tensor(norms, dtype=torch.float64),
            "moments_held": torch.tensor(held), "on_host": torch.tensor(on_host),
            "reductions": torch.tensor(len(reductions))}


def mixed_rank(rank: int, world: int, stage: int) -> dict[str, torch.Tensor]:
    """Mixed precision over 2 gloo ranks: ZeRO-3 (FSDP2: bf16 shards, gradients reduce-scattered in fp32, each rank
    the fp32 masters of its shards) or ZeRO-1 (bf16 parameters, each rank the fp32 masters of its partition). Every
    rank computes the whole batch, so the gradient is one process's: FSDP's fp32 sum of the two equal bf16
    gradients, divided by 2, is exact."""
    cfg = OptimConfig(**OPTIM, zero_stage=stage, mixed_precision=True)
    m = tiny_model(dtype=torch.bfloat16)
    if stage >= 2:
        shard_model(m, stage, SequenceParallel(), mixed_precision=True)
    opt = build_optimizer(m, cfg)
    norms = run_updates(m, opt, cfg)
    return {"masters": masters(m, opt), "weights": weights(m), "norms": torch.tensor(norms, dtype=torch.float64),
            "bf16_params": torch.tensor(all(p.dtype == torch.bfloat16 for p in m.parameters()))}


def _bf16_model(arch: str) -> torch.nn.Module:
    if arch == "glm_moe_dsa":
        import longstraw as ls
        from tests.conftest import GLM

        torch.manual_seed(0)
        return ls.build_model(GLM, dtype=torch.bfloat16)
    return tiny_model(arch, dtype=torch.bfloat16)


def engine_rank(rank: int, world: int, arch: str, offload: str = "none") -> dict[str, torch.Tensor]:
    """Two exact GRPO steps (the engine's split schedule: each rank its share of the gradient) under ZeRO-3 with
    mixed precision; alongside, an unsharded bf16 twin with ZeRO-0 mixed precision stepped on the same (gathered)
    gradients. With `offload` cpu the sharded run's masters and moments are on the host (DeepSpeed's CPU Adam)."""
    import longstraw as ls
    from tests.parallel.test_sequence_parallel import ADV, CHUNK, group

    cfg = OptimConfig(**OPTIM, zero_stage=3, mixed_precision=True, offload=offload)
    sp = SequenceParallel()
    m = shard_model(_bf16_model(arch), 3, sp, mixed_precision=True)
    opt = build_optimizer(m, cfg, sp)
    twin = _bf16_model(arch)
    twin_cfg = OptimConfig(**OPTIM, mixed_precision=True)
    twin_opt = build_optimizer(twin, twin_cfg)
    prompt, responses = group(arch)
    for update in range(2):
        ls.grpo_backward(m, prompt, responses, ADV, engine=ls.EngineConfig(prompt_chunk=CHUNK), parallel=sp)
        for p, q in zip(m.parameters(), twin.parameters()):
            q.grad = None if p.grad is None else full_tensor(p.grad).clone()
        optimizer_step(twin, twin_opt, twin_cfg, update, 2)
        optimizer_step(m, opt, cfg, update, 2)
    keep = tuple(m.fp32_suffixes)  # GLM-5's router and indexer head stay fp32, as in a bf16 model
    dtypes_ok = all(p.dtype == (torch.float32 if keep and n.endswith(keep) else torch.bfloat16)
                    for n, p in m.named_parameters())
    return {"masters": masters(m, opt), "twin": masters(twin, twin_opt), "bf16_params": torch.tensor(dtypes_ok)}
