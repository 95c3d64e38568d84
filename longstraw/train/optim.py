"""The optimizer step: one function for one process and for N ranks (ZeRO-1: torch's ZeroRedundancyOptimizer;
ZeRO-2/3: FSDP2, longstraw/parallel/fsdp.py), with fp32 master weights (`optim.mixed_precision`) and the master and
moments on the host (`optim.offload`, DeepSpeed's CPU Adam) when asked: `MasterAdamW`."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from ..parallel import ONE_RANK, SequenceGroup, full_tensor, is_sharded, local_shard
from ..parallel.backend import sum_over_ranks
from .config import OptimConfig
from .offload import FileTensors, cpu_adam
from .transfer import HostMirror


def build_optimizer(model: nn.Module, cfg: OptimConfig, parallel: SequenceGroup = ONE_RANK) -> torch.optim.Optimizer:
    """AdamW over the model's trainable parameters, sharded over the torch.distributed ranks by `zero_stage`:

    1  ZeRO-1: each rank keeps and updates the moments of 1/N of the parameters and broadcasts its updated share
       (the gradients must be the same on every rank, as `grpo_backward(parallel=...)` leaves them);
    2, 3  the model is sharded by `longstraw.parallel.shard_model` first (FSDP2): its parameters are the ranks'
       shards, so a plain AdamW over them keeps 1/N of the moments and updates 1/N of the weights.

    With `mixed_precision` or `offload` it is a `MasterAdamW` (fp32 master weights and moments, on the device or the
    host), which also sums ZeRO-0/1's gradients over the data-parallel groups of `parallel`, in fp32.
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
    if cfg.mixed_precision or cfg.offload != "none":
        return MasterAdamW(model, cfg, parallel)
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.zero_stage == 1:
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kw)
    return torch.optim.AdamW(params, **kw)


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def partition(sizes: list[int], ranks: int) -> list[int]:
    """The owner rank of each of `sizes` (ZeRO-1): the largest first, each to the rank holding the fewest elements
    so far (ties: the lowest rank), as ZeroRedundancyOptimizer partitions."""
    owner, load = [0] * len(sizes), [0] * ranks
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class MasterAdamW:
    """AdamW over fp32 master copies of the model's trainable parameters, the model keeping its own dtype (bf16 with
    `optim.mixed_precision`); the master and the moments live on the device (torch.optim.AdamW), on the host
    (`offload: cpu`, DeepSpeed's CPU Adam) or in memory-mapped files (`offload: nvme`, the same CPU Adam).

    Each step (`optimizer_step`) casts every parameter's gradient to fp32 into its master's `grad` (ZeRO-0/1: summed
    over the data-parallel groups in fp32 first, so the caller skips `reduce_gradients`) and frees the parameter's;
    clips by the global norm of the fp32 master gradients, steps, and copies the masters back into the parameters
    (rounding to bf16 once per step). The engine sees parameters with `.grad` as before.

    ZeRO-1: rank r keeps master and moments of the parameters `partition` gives it and broadcasts their updated
    weights. ZeRO-2/3: the model's parameters are FSDP2's bf16 shards (their gradients reduce-scattered in fp32,
    `shard_model(mixed_precision=True)`); the master is an fp32 copy of this rank's shard. ZeRO-0: every rank keeps
    all of it. A parameter that is fp32 already (GLM-5's router, or every one without mixed precision) and stays
    on its device is its own master.

    For checkpoints it looks like a torch optimizer: `param_groups` (this rank's parameters), `state` keyed by the
    model's parameters with fields exp_avg, exp_avg_sq, step (as torch's AdamW) and `master` (fp32, a DTensor of the
    parameter's placement under FSDP), and `load_state_dict`."""

    holds_master = True  # checkpoint.py: the state has a `master` field to save and restore
    reduces_gradients = True  # ZeRO-0/1: the data-parallel gradient sum is the optimizer's (fp32)

    def __init__(self, model: nn.Module, cfg: OptimConfig, parallel: SequenceGroup = ONE_RANK) -> None:
        self.cfg, self.parallel = cfg, parallel
        self.sharded = is_sharded(model)
        self.rank, self.world = _rank_world()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameter")
        self.params = [p for _, p in named]
        dtypes = {p.dtype for p in self.params}
        if cfg.mixed_precision and torch.bfloat16 not in dtypes:
            raise ValueError(f"optim.mixed_precision keeps fp32 masters of bf16 weights; the model's trainable "
                             f"parameters are {sorted(map(str, dtypes))} (build it with dtype bfloat16; under "
                             "ZeRO-2/3 shard it with shard_model(..., mixed_precision=True))")
        owners = (partition([p.numel() for p in self.params], self.world) if cfg.zero_stage == 1
                  else [self.rank] * len(self.params))
        self.owner = {id(p): r for p, r in zip(self.params, owners)}
        self.owned = [p for p in self.params if self.owner[id(p)] == self.rank]
        self.where = cfg.offload
        self.files = FileTensors(cfg.nvme_path, self.rank) if cfg.offload == "nvme" else None
        self.master: dict[int, torch.Tensor] = {}
        self.aliased: set[int] = set()
        # offload: the owned parameters' masters (and gradients) are views of one flat host buffer each, filled and
        # emptied chunk by chunk (transfer.py), the masters here from the parameters
        self.mirror: HostMirror | None = None
        if self.where != "none" and self.owned:
            make = (lambda numel: self.files.new((numel,))) if self.files is not None else None
            self.mirror = HostMirror(self._locals(), make)
            self.mirror.to_host(self._locals(), into=self.mirror.values)
            self.master = {id(p): m for p, m in zip(self.owned, self.mirror.value_views)}
        for p in self.owned if self.where == "none" else ():
            local = local_shard(p.detach())
            if local.dtype == torch.float32:
                self.master[id(p)] = local  # the parameter (or its FSDP shard) is its own fp32 master
                self.aliased.add(id(p))
            else:
                self.master[id(p)] = local.to(torch.float32, copy=True)
        self.param_groups = [{"params": self.owned, "lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps,
                              "weight_decay": cfg.weight_decay}]
        masters = [self.master[id(p)] for p in self.owned]
        kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
        if self.where == "none":
            self.inner = torch.optim.AdamW(masters, **kw) if masters else None
        else:
            self.inner = cpu_adam(masters, **kw) if masters else None
        if self.files is not None:  # the moments in files too (CPU Adam would make them in memory at its first step)
            for m in masters:
                self.inner.state[m] = {"step": 0, "exp_avg": self.files.new(m.shape),
                                       "exp_avg_sq": self.files.new(m.shape)}
        self.step_count: dict[int, int] = {}  # updates each master has had

    def _locals(self) -> list[torch.Tensor]:
        """This rank's part of each owned parameter (the tensors the weights are copied back into)."""
        return [local_shard(p.detach()) for p in self.owned]

    # ---- the torch-optimizer face checkpoints use ---------------------------------------------------------------
    def _view(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`t` (this rank's part of `p`'s state) as checkpoints save it: a DTensor placed as `p` under FSDP."""
        if isinstance(p, DTensor):
            return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        return t

    @property
    def state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        out = {}
        for p in self.owned:
            m = self.master[id(p)]
            entry = {"master": self._view(m, p)}
            st = self.inner.state.get(m, {}) if self.inner is not None else {}
            if "exp_avg" in st and self.step_count.get(id(p), 0) > 0:
                entry |= {"step": torch.tensor(float(self.step_count[id(p)])),
                          "exp_avg": self._view(st["exp_avg"], p), "exp_avg_sq": self._view(st["exp_avg_sq"], p)}
            out[p] = entry
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore this rank's masters and moments ({"state": {index in param_groups' order: fields}}); a parameter
        without a saved `master` (a checkpoint of a run without one) takes its master from its current weights."""
        for g, saved in zip(self.param_groups, state_dict.get("param_groups", [])):
            g.update({k: v for k, v in saved.items() if k != "params"})
        state = state_dict.get("state", {})
        with torch.no_grad():
            for i, p in enumerate(self.owned):
                m, entry = self.master[id(p)], state.get(i, {})
                src = entry.get("master")
                m.copy_(local_shard(src) if src is not None else local_shard(p.detach()))
                if "exp_avg" in entry:
                    step = int(float(entry["step"])) if "step" in entry else 1
                    self.step_count[id(p)] = step
                    self._set_moments(m, local_shard(entry["exp_avg"]), local_shard(entry["exp_avg_sq"]), step)
                if id(p) not in self.aliased and self.mirror is None:
                    local_shard(p.detach()).copy_(m)
            if self.mirror is not None:
                self.mirror.to_device(self._locals())

    def _set_moments(self, m: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int) -> None:
        old = self.inner.state.get(m, {})

        def place(t: torch.Tensor, field: str) -> torch.Tensor:
            if field in old:  # e.g. the files of offload nvme
                return old[field].copy_(t)
            return t.to(m.device, torch.float32, copy=True)

        if self.where == "none":  # torch's AdamW: a float32 0-dim step
            self.inner.state[m] = {"step": torch.tensor(float(step)), "exp_avg": place(exp_avg, "exp_avg"),
                                   "exp_avg_sq": place(exp_avg_sq, "exp_avg_sq")}
        else:  # DeepSpeed's CPU Adam: an int step
            self.inner.state[m] = {"step": step, "exp_avg": place(exp_avg, "exp_avg"),
                                   "exp_avg_sq": place(exp_avg_sq, "exp_avg_sq")}

    def state_dict(self) -> dict:
        index = {id(p): i for i, p in enumerate(self.owned)}
        return {"state": {index[id(p)]: st for p, st in self.state.items()},
                "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                  "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for m in self.master.values():
            m.grad = None

    # ---- the step ---------------------------------------------------------------------------------------------------
    def _device_grads(self) -> Iterator[torch.Tensor | None]:
        """Each owned parameter's gradient (its local shard) on the device, in order, None where it has none
        (ZeRO-0/1: summed over the data-parallel groups in fp32, on every rank alike); frees the parameters'.
        Run it to its end: the sums of the parameters a rank does not own are collectives too."""
        dp_sum = not self.sharded
        for p in self.params:
            g = p.grad
            owned = self.owner[id(p)] == self.rank
            if g is None:
                if owned:
                    yield None
                continue
            p.grad = None
            g = local_shard(g)
            if dp_sum:
                g = g.to(torch.float32, copy=True)
                self.parallel.dp_sum_(g)  # a collective on every rank, owned or not
            if owned:
                yield g

    def master_grads(self) -> list[torch.Tensor]:
        """Each parameter's gradient as fp32 into its master's `grad` and the parameter's freed; the masters that
        have one. Offload: into one flat host buffer, chunk by chunk (`HostMirror.to_host`, cast on the device)."""
        if self.mirror is not None:
            present = self.mirror.to_host(self._device_grads())
            for p, has, g in zip(self.owned, present, self.mirror.grad_views):
                self.master[id(p)].grad = g if has else None
        else:
            grads = self._device_grads()
            for p, g in zip(self.owned, grads):
                m = self.master[id(p)]
                m.grad = None if g is None else g.to(m.device, torch.float32)
            for _ in grads:  # the sums of the parameters after the last owned one
                pass
        return [self.master[id(p)] for p in self.owned if self.master[id(p)].grad is not None]

    def _norm_reduced(self) -> bool:
        """Whether the ranks hold disjoint parts of the master gradients (ZeRO-1 partition, FSDP shards)."""
        return self.world > 1 and self.cfg.zero_stage >= 1

    def global_norm(self, grads: list[torch.Tensor]) -> float:
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if not self._norm_reduced():
            return float(norm)
        sq = norm.to(torch.float64).square().reshape(1)
        sum_over_ranks(sq)  # host gradients (offload) under NCCL: reduced on the GPU
        return float(sq.sqrt())

    def step(self, lr: float) -> None:
        """AdamW on the masters that have a gradient, then the weights back into the parameters (ZeRO-1: from
        their owners)."""
        if self.inner is not None:
            for g in self.inner.param_groups:
                g.update(lr=lr, **{k: self.param_groups[0][k] for k in ("betas", "eps", "weight_decay")})
                g["betas"] = tuple(g["betas"])
            self.inner.step()
        with torch.no_grad():
            for p in self.owned:
                m = self.master[id(p)]
                if m.grad is not None:
                    self.step_count[id(p)] = self.step_count.get(id(p), 0) + 1
                if id(p) not in self.aliased and self.mirror is None:
                    local_shard(p.detach()).copy_(m)
            if self.mirror is not None:
                self.mirror.to_device(self._locals())  # chunk by chunk, cast on the device
            if self.cfg.zero_stage == 1 and self.world > 1:
                for p in self.params:
                    dist.broadcast(p.detach(), src=self.owner[id(p)])

    def bad_masters(self) -> list[torch.Tensor]:
        return [p for p in self.owned if not bool(torch.isfinite(self.master[id(p)]).all())]


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
    With a `MasterAdamW` the norm, the clipping and the checks act on the fp32 master gradients and weights.

    Raises FloatingPointError when the step itself made a weight non-finite; the caller must not commit these
    weights (the pipeline keeps the previous checkpoint)."""
    if isinstance(optimizer, MasterAdamW):
        return _master_step(model, optimizer, cfg, update, total)
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
        _warn_skipped(update, norm)
        return {"grad_norm": norm, "lr": lr, "skipped": 1.0}
    for g in optimizer.param_groups:
        g["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(local_shard(p)).all())]
    if is_sharded(model):  # each rank checks its own shards; all must raise together
        count = sum_over_ranks(torch.tensor([len(bad)]))
        bad = bad or ([] if int(count) == 0 else ["(on another rank)"])
    _raise_bad(bad, update, norm, lr)
    return {"grad_norm": norm, "lr": lr, "skipped": 0.0}


def _warn_skipped(update: int, norm: float) -> None:
    warnings.warn(f"update {update}: gradient norm is {norm}; skipped the update, the weights stay as they "
                  "were (check the rewards and log-probs, or lower optim.lr)", stacklevel=3)


def _raise_bad(bad: list[str], update: int, norm: float, lr: float) -> None:
    if bad:
        raise FloatingPointError(f"update {update} made {len(bad)} weights non-finite (first: {bad[0]}) from a finite "
                                 f"gradient (norm {norm:.3g}) at lr {lr:g}; lower optim.lr")


def _master_step(model: nn.Module, opt: MasterAdamW, cfg: OptimConfig, update: int, total: int) -> dict[str, float]:
    if all(p.grad is None for p in opt.params):
        # every rank sees the same (ZeRO-0/1 gradients are alike; FSDP gives every rank a shard of each)
        raise RuntimeError("optimizer_step: no parameter has a gradient; run the replay/backward stages first")
    masters = opt.master_grads()
    norm = opt.global_norm([m.grad for m in masters])
    lr = lr_at(update, total, cfg)
    if not math.isfinite(norm):
        opt.zero_grad(set_to_none=True)
        _warn_skipped(update, norm)
        return {"grad_norm": norm, "lr": lr, "skipped": 1.0}
    if cfg.grad_clip is not None and masters:  # as clip_grad_norm_: scale by min(1, clip / (norm + 1e-6))
        total = torch.tensor(norm, dtype=torch.float32, device=masters[0].device)
        torch.nn.utils.clip_grads_with_norm_(masters, cfg.grad_clip, total)
    opt.step(lr)
    opt.zero_grad(set_to_none=True)
    names = {id(p): n for n, p in model.named_parameters()}
    bad = [names[id(p)] for p in opt.bad_masters()]
    if opt.world > 1 and opt.cfg.zero_stage >= 1:  # each rank checks its own masters; all must raise together
        count = sum_over_ranks(torch.tensor([len(bad)]))
        bad = bad or ([] if int(count) == 0 else ["(on another rank)"])
    _raise_bad(bad, update, norm, lr)
    return {"grad_norm": norm, "lr": lr, "skipped": 0.0}
