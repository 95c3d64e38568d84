"""Expert parallelism: each rank keeps E / N whole experts of every MoE layer and never gathers the others; the
tokens travel to their experts instead (two all-to-alls per MoE layer and pass).

Why: under ZeRO-3 FSDP gathers a unit's whole parameters for each use, and a GLM-5 MoE layer's experts are 9.7B
parameters (19.4 GB in bf16, twice with the prefetch) against 0.2B for the rest of the layer. The experts'
layout is the one FSDP would give them (a `DTensor` sharded on dim 0, the expert axis, over the same ranks), so
loading (`set_model_state_dict`), checkpoints (DCP), gradient clipping and the optimizers see them as they see
FSDP's shards; only the forward differs: FSDP's units leave them out (`ignored_params`), and `Experts` routes its
(token, expert) rows to the owner rank, runs its experts there on the local tensors, and routes the results back.

The gradient of a rank's experts is the sum over every rank's tokens (the all-to-all's backward brings it home),
so there is nothing to reduce. It is divided as FSDP divides its sums (`gradient_replicas`: ranks of a
sequence-parallel group that replay the same branches each send the same rows): `divide`.

Lockstep: every rank calls every MoE layer's forward (and backward) as FSDP already requires, with zero rows where
it has no tokens; the all-to-all's split sizes come from the routing, so each layer waits for the host once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


@dataclass
class ExpertGroup:
    """The ranks that share one MoE layer's experts: this rank owns experts [rank * local, (rank + 1) * local)."""

    group: dist.ProcessGroup
    rank: int
    size: int
    local: int
    divide: float = 1.0  # what the experts' gradients are divided by (FSDP's gradient divide factor)

    def weights(self, module: nn.Module) -> tuple[Tensor, Tensor]:
        return local_weights(module)

    def route(self, rows: Tensor, experts: Tensor, run) -> Tensor:
        return route(rows, experts, self, run)


class FusedExperts(nn.Module):
    """What a module of fused experts subclasses to be found and made expert-parallel here (models/common/moe.py's
    `Experts` does): parallel/ sits below the models and names none of their classes.

    Its parameters: gate_up_proj [E, 2I, H], down_proj [E, H, I]; `ep` is None, or its `ExpertGroup` once
    `shard_experts` has split them."""

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    ep: ExpertGroup | None


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The model's fused-experts modules (those that can be expert-parallel)."""
    return [m for m in model.modules() if isinstance(m, FusedExperts)]


def _adapted(model: nn.Module) -> bool:
    """Whether PEFT wraps any fused-experts module (a LoRA target that names `down_proj` also names the experts'
    fused parameter): its adapters hold every expert's rows, which this layout does not split."""
    wrapped = {id(m.base_layer) for m in model.modules() if isinstance(getattr(m, "base_layer", None), nn.Module)}
    return any(id(m) in wrapped for m in expert_modules(model))


def experts_divide(model: nn.Module, ranks: int | None = None) -> bool:
    """Whether `model` has fused experts without adapters whose count splits evenly over `ranks` (default: the
    torch.distributed world) (expert parallelism's `auto`)."""
    ranks = dist.get_world_size() if ranks is None else ranks
    experts = expert_modules(model)
    return bool(experts) and not _adapted(model) and all(m.gate_up_proj.shape[0] % ranks == 0 for m in experts)


def shard_experts(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Make every fused-experts module of `model` expert-parallel over the 1-D `mesh`: its parameters become
    DTensors sharded on the expert axis (this rank's slice of the weights it holds; meta stays meta), and its
    forward routes tokens (`ExpertGroup`). Returns the parameters, for FSDP to leave alone."""
    n, rank = mesh.size(), mesh.get_local_rank()
    if _adapted(model):
        raise ValueError("LoRA adapters on the routed experts (a target named down_proj or gate_up_proj wraps them "
                         "too) are not expert-parallel; set optim.expert_parallel: false (FSDP then gathers the "
                         "experts), or leave the experts' projections out of lora.target_modules")
    owned: set[nn.Parameter] = set()
    for module in expert_modules(model):
        experts = module.gate_up_proj.shape[0]
        if experts % n:
            raise ValueError(f"expert parallelism needs the experts ({experts}) to split evenly over the {n} "
                             f"ranks; use a rank count that divides {experts}, or optim.expert_parallel: false")
        local = experts // n
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(module, name)
            mine = p.detach()[rank * local:(rank + 1) * local].clone()
            shard = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            setattr(module, name, nn.Parameter(shard, requires_grad=p.requires_grad))
            owned.add(getattr(module, name))
        module.ep = ExpertGroup(mesh.get_group(), rank, n, local)
    return owned


def set_experts_divide(model: nn.Module, factor: float) -> None:
    """Divide the expert-parallel gradients by `factor` from now on (as FSDP's `set_gradient_divide_factor`)."""
    for module in expert_modules(model):
        if module.ep is not None:
            module.ep.divide = factor


class _DivideGrad(torch.autograd.Function):
    """Identity forward; the gradient divided by the group's `divide` as it is when the backward runs (as FSDP
    reads its factor when it reduces), for the experts' weights only, not the tokens'."""

    @staticmethod
    def forward(ctx, t: Tensor, ep: ExpertGroup) -> Tensor:
        ctx.ep = ep
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:
        return g / ctx.ep.divide if ctx.ep.divide != 1.0 else g, None


def local_weights(module: nn.Module) -> tuple[Tensor, Tensor]:
    """(gate_up_proj, down_proj) of this rank's experts as plain tensors, gradients divided as FSDP's."""
    ep: ExpertGroup = module.ep
    out = []
    for p in (module.gate_up_proj, module.down_proj):
        t = p.to_local() if isinstance(p, DTensor) else p
        out.append(_DivideGrad.apply(t, ep) if t.requires_grad else t)
    return out[0], out[1]


def route(rows: Tensor, experts: Tensor, ep: ExpertGroup, run) -> Tensor:
    """The experts' outputs for `rows` [M, hidden] (each a (token, expert) pair; `experts` [M] their global expert
    ids, sorted): rows go to the rank owning their expert, `run(rows, local ids)` computes them there (ids sorted),
    and the results come back in the order of `rows`. A collective of the expert group, differentiable in `rows`."""
    if torch.is_grad_enabled() and not rows.requires_grad:
        # every rank's backward must reach both all-to-alls, also where no trainable weight came before the rows
        rows = rows.detach().requires_grad_()
    send = torch.bincount(experts // ep.local, minlength=ep.size)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep.group)
    send_n, recv_n = send.tolist(), recv.tolist()
    # waited at once: the engine's saved-tensor hooks read storages, which the async wrapper has none of
    got = wait_tensor(all_to_all_single_autograd(rows.contiguous(), recv_n, send_n, ep.group))
    ids = experts.new_empty(sum(recv_n))
    dist.all_to_all_single(ids, experts.contiguous(), recv_n, send_n, group=ep.group)
    # each source's rows come sorted by expert; the owner's experts want all of one expert's rows together
    ids, order = (ids - ep.rank * ep.local).sort(stable=True)
    out = run(got[order], ids)[order.argsort()]
    return wait_tensor(all_to_all_single_autograd(out.contiguous(), send_n, recv_n, ep.group))
