"""The optimizer step: one function for one process and for N ranks (ZeRO-1: torch's ZeroRedundancyOptimizer;
ZeRO-2/3: FSDP2, longstraw/parallel/fsdp.py)."""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..parallel import full_tensor, is_sharded, local_shard
from .config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the model's trainable parameters, sharded over the torch.distributed ranks by `zero_stage`:

    1  ZeRO-1: each rank keeps and updates the moments of 1/N of the parameters and broadcasts its updated share
       (the gradients must be the same on every rank, as `grpo_backward(parallel=...)` leaves them);
    2, 3  the model is sharded by `longstraw.parallel.shard_model` first (FSDP2): its parameters are the ranks'
       shards, so a plain AdamW over them keeps 1/N of the moments and updates 1/N of the weights.
    """
    if cfg.zero_stage and not dist.is_initialized():
        raise ValueError(f"optim.zero_stage {cfg.zero_stage} shards over torch.distributed ranks; initialise the "
                         "process group first (torchrun), or use zero_stage 0 on one process")
    if cfg.zero_stage in (2, 3) and not is_sharded(model):
        raise ValueError(f"optim.zero_stage {cfg.zero_stage} needs the model sharded first: "
                         f"longstraw.parallel.shard_model(model, {cfg.zero_stage}, parallel)")
    if cfg.zero_stage in (0, 1) and is_sharded(model):
        raise ValueError(f"the model is sharded (FSDP, ZeRO-2/3) but optim.zero_stage is {cfg.zero_stage}; "
                         "set it to the stage the model was sharded for")
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.zero_stage == 1:
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kw)
    return torch.optim.AdamW(params, **kw)


def lr_at(update: int, total: int, cfg: OptimConfig) -> float:
    """Learning rate of update number `update` (0-based) of `total`: linear warm-up, then the decay schedule."""
    if update < cfg.warmup_updates:
        return cfg.lr * (update + 1) / cfg.warmup_updates
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(total - cfg.warmup_updates, 1)
    t = min((update - cfg.warmup_updates) / span, 1.0)
    shape = 1.0 - t if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * t))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape)


def optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, cfg: OptimConfig, update: int, total: int
) -> dict[str, float]:
    """Clip the global grad norm, set this update's lr, step, clear the gradients. Returns grad_norm, lr and
    skipped (1.0 when the gradient norm was not finite: the update is skipped, weights and moments untouched).

    Raises FloatingPointError when the step itself made a weight non-finite; the caller must not commit these
    weights (the pipeline keeps the previous checkpoint)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if len(missing) == len(params):
        raise RuntimeError("optimizer_step: no parameter has a gradient; run the replay/backward stages first")
    max_norm = cfg.grad_clip if cfg.grad_clip is not None else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = float(full_tensor(norm))  # sharded (FSDP): the global norm
    lr = lr_at(update, total, cfg)
    if not math.isfinite(norm):  # every rank sees the same global norm, so all skip together
        optimizer.zero_grad(set_to_none=True)
        warnings.warn(f"update {update}: gradient norm is {norm}; skipped the update, the weights stay as they "
                      "were (check the rewards and log-probs, or lower optim.lr)", stacklevel=2)
        return {"grad_norm": norm, "lr": lr, "skipped": 1.0}
    for g in optimizer.param_groups:
        g["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(local_shard(p)).all())]
    if is_sharded(model):  # each rank checks its own shards; all must raise together
        count = torch.tensor([len(bad)], device=local_shard(params[0]).device)
        dist.all_reduce(count)
        bad = bad or ([] if int(count) == 0 else ["(on another rank)"])
    if bad:
        raise FloatingPointError(f"update {update} made {len(bad)} weights non-finite (first: {bad[0]}) from a finite "
                                 f"gradient (norm {norm:.3g}) at lr {lr:g}; lower optim.lr")
    return {"grad_norm": norm, "lr": lr, "skipped": 0.0}
