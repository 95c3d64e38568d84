"""ZeRO-2 / ZeRO-3 for the engine: the model's parameters and gradients sharded by torch's FSDP2 (`fully_shard`).

`shard_model(model, stage, parallel)` makes every decoder layer one FSDP unit and the rest (embeddings, final
norm, LM head) the root unit, over all ranks. Each rank then holds 1/N of every parameter and of its gradient,
and AdamW (a plain `torch.optim.AdamW` over the sharded parameters) keeps 1/N of the moments: ZeRO-3. Stage 2
keeps a unit's parameters gathered from its forward to its backward (`reshard_after_forward=False`, ZeRO-2's
trade: fewer all-gathers, the whole model resident while a forward's graph is alive).

Why FSDP2 and not DeepSpeed's ZeRO engine:
- The unit is the decoder layer. Its parameters are gathered for the layer's whole forward, so the mixers may
  read child weights directly (MLA's absorbed `kv_b_proj.weight`, Gated DeltaNet's `conv1d.weight`, the fused MoE
  experts). DeepSpeed ZeRO-3 gathers a parameter only around the forward of the module that owns it, and each of
  those reads would need `register_external_parameter`.
- Capture calls methods other than `forward` (`emit_states`, a layer's `capture` / `emit_state`), replay the
  model's `token_logprobs` (the chunked LM head, recomputed in the backward), and `register_fsdp_forward_method`
  gathers for them too. DeepSpeed's engine wraps `forward` only.
- Exact mode runs one autograd backward per branch batch and one per prompt chunk in a step, from the emitted
  state as well as from the loss. FSDP2 reduce-scatters after each, into the sharded gradient. DeepSpeed's engine
  expects one `engine.backward(loss)` per micro-step.
- It is torch itself: no extension to compile, the same code on gloo (CPU tests) and NCCL.

Gradients: the replays and the prompt backward give each rank its own share of the gradient (its branches, its
blocks of the chunks; sequence.py), and the data-parallel groups their own branches': they run under
`gradient_replicas(model, 1, ...)`, and FSDP's sum over all N ranks leaves the one-process gradient, sharded.
Outside them the divide factor is C, for a backward that every rank of a group would run alike. `grpo_backward`
sees an FSDP model and leaves the data-parallel sum to FSDP.

Lockstep: FSDP all-gathers a layer's parameters over all N ranks at each of its forwards, so every rank must run
the same forwards in the same order. The engine does: every rank of a group runs its block of every chunk, and
the groups replay equally many branch batches (`SequenceParallel.branches` splits G evenly).

At 27B / 8 ranks, ZeRO-3 holds 1/8 of the bf16 weights, fp32 gradients and moments per rank (`longstraw plan
--zero 3`), but each use of a layer gathers it: walked chunk by chunk, a prompt of P tokens in chunks of c would
move 2 P / c times the weight bytes per rank through all-gathers in the exact prompt backward. Capture and the
prompt backward therefore walk the prompt layer by layer under ZeRO-3 (engine/prompt_by_layer.py), each layer
held gathered over all chunks (`gathered_once`) and its gradient reduced once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from .experts import experts_divide, set_experts_divide, shard_experts
from .sequence import ONE_RANK, SequenceGroup

STAGES = (2, 3)
LAYER_METHODS = ("capture", "emit_state")  # what capture calls on a layer instead of forward
MODEL_METHODS = ("emit_states", "emit_states_by_layer", "embed", "token_logprobs")

# The capture methods return the emitted state's tensors, some of them views (a transposed K/V). The engine
# never writes into them in place, which is what FSDP warns about.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def local_shard(t: Tensor) -> Tensor:
    """This rank's part of a sharded (FSDP) tensor; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: Tensor) -> Tensor:
    """The whole of a sharded tensor on every rank (a collective: all ranks must call it); others as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def is_sharded(model: nn.Module) -> bool:
    """Whether `shard_model` (FSDP) manages the model's parameters and gradients."""
    return isinstance(model, FSDPModule)


def shard_model(model: nn.Module, stage: int, parallel: SequenceGroup = ONE_RANK,
                mesh: DeviceMesh | None = None, mixed_precision: bool = False,
                expert_parallel: bool | None = None) -> nn.Module:
    """Shard `model` in place for ZeRO `stage` 2 or 3 over all ranks (or `mesh`, 1-D) and return it.

    Call it after the weights are loaded and before `build_optimizer`; every rank passes the same model.
    `parallel` is the sequence-parallel group the engine will run with (its size C sets the gradient division).

    `mixed_precision` (`optim.mixed_precision`): the model's bf16 parameters are sharded as they are (the engine
    computes with them, and takes its state dtype from them), and FSDP2 reduce-scatters their gradients in fp32
    (`MixedPrecisionPolicy(reduce_dtype=float32)`) before storing the shard's; the fp32 master weights are the
    optimizer's (`longstraw.train.optim.MasterAdamW`). The modules holding the parameters the family keeps in fp32
    (`fp32_suffixes`: GLM-5's router and indexer head) become units of their own (one dtype per unit).

    `expert_parallel` (None: whenever the model has fused experts that split evenly over the ranks): each rank
    keeps its E / N whole experts, which FSDP never gathers; tokens go to them (parallel/experts.py).
    """
    if stage not in STAGES:
        raise ValueError(f"shard_model shards for ZeRO stage 2 or 3, not {stage}; stage 1 is the optimizer alone "
                         f"(optim.zero_stage: 1) and needs no sharded model")
    if not dist.is_initialized():
        raise RuntimeError("shard_model needs torch.distributed.init_process_group() first (torchrun)")
    if is_sharded(model):
        raise ValueError("the model is sharded already; shard it once, before building the optimizer")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no .model.layers; shard_model knows the decoder models of "
                        f"longstraw.models")
    if mesh is None:
        p = next(model.parameters())
        mesh = init_device_mesh(p.device.type, (dist.get_world_size(),))
    reshard = stage == 3
    if expert_parallel is None:
        expert_parallel = experts_divide(model)
    policy = {"ignored_params": shard_experts(model, mesh)} if expert_parallel else {}
    if mixed_precision:
        # inputs and parameters stay as they are (bf16 compute, as in a bf16 model); only the reduction is fp32
        policy["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
        keep = tuple(getattr(model, "fp32_suffixes", ()))
        owners = {name.rpartition(".")[0] for name, _ in model.named_parameters() if keep and name.endswith(keep)}
        for name in sorted(owners):
            fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=reshard, **policy)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, **policy)
        layer.reshards_after_forward = reshard  # what `gathered_once` restores
        for method in LAYER_METHODS:
            register_fsdp_forward_method(layer, method)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **policy)
    model.reshards_after_forward = reshard
    for method in MODEL_METHODS:
        register_fsdp_forward_method(model, method)
    replicas = parallel.size
    gloo = dist.get_backend() == "gloo"  # gloo has no pre-multiplied sum: FSDP then sums and scales apart
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(replicas))
            module.set_force_sum_reduction_for_comms(gloo)
    set_experts_divide(model, float(replicas))
    return model


def gathers_per_use(model: nn.Module) -> bool:
    """Whether the model is sharded for ZeRO-3 (each use of a layer gathers its weights)."""
    return any(getattr(m, "reshards_after_forward", False) for m in model.modules())


@contextmanager
def gathered_once(module: nn.Module, backward: bool = False) -> Iterator[Callable[[], None]]:
    """Within, a ZeRO-3 unit's parameters stay gathered across its forwards (and with `backward`, its backwards):
    one all-gather and one reshard for all of them (the layer-major order runs every chunk through a layer in
    between). With `backward` the gradients accumulate unreduced until the backward after the call of what this
    yields: that one reduce-scatters them all. Any other module as it is."""
    if not getattr(module, "reshards_after_forward", False):
        yield lambda: None
        return
    module.unshard()
    module.set_reshard_after_forward(False, recurse=False)
    if backward:
        module.set_reshard_after_backward(False, recurse=False)
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield lambda: module.set_requires_gradient_sync(True, recurse=False)
    finally:
        module.set_reshard_after_forward(True, recurse=False)
        if backward:
            module.set_reshard_after_backward(True, recurse=False)
            module.set_requires_gradient_sync(True, recurse=False)
        module.reshard()


@contextmanager
def gradient_replicas(model: nn.Module, replicas: int, then: int) -> Iterator[None]:
    """Within: FSDP divides the gradients it sums over all ranks by `replicas` (how many ranks computed each
    one), and by `then` after. The replays' gradients are the same on the C ranks of a sequence-parallel group;
    a split prompt backward's are every rank's own share."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_gradient_divide_factor(float(replicas))
    set_experts_divide(model, float(replicas))
    try:
        yield
    finally:
        for m in units:
            m.set_gradient_divide_factor(float(then))
        set_experts_divide(model, float(then))


def shard_from_rank0(skeleton: nn.Module, full: dict[str, Tensor] | None, stage: int,
                     parallel: SequenceGroup, device: torch.device, mixed_precision: bool = False,
                     expert_parallel: bool | None = None) -> nn.Module:
    """A ZeRO-2/3 model whose weights only rank 0 has read. Every rank passes `skeleton`, the same model on the
    meta device; rank 0 passes `full`, the whole state dict (None elsewhere). The skeleton is sharded, given
    storage for its shards on `device`, and each rank's shards are filled from rank 0's tensors, broadcast one at a
    time. A collective: every rank calls it, after agreeing that rank 0's read succeeded.

    Why: at 27B on 8 ranks, every rank loading the whole HF export onto its GPU before sharding would put 54 GB
    on each GPU and read the files 8 times. Here only rank 0 reads them, and every other rank holds its 1/N
    (6.75 GB) plus one whole tensor in flight, the largest being the embedding (2.5 GB for Qwen3.5-27B). Over
    gloo on one CPU box the broadcast is slower than 8 reads from the page cache (bench/sharded_load.py)."""
    if any(not p.is_meta for p in skeleton.parameters()):
        raise ValueError("shard_from_rank0 takes the model built on the meta device (longstraw.models.meta_model)")
    if getattr(getattr(skeleton, "config", None), "tie_word_embeddings", False):
        raise ValueError("tied word embeddings: materialising the skeleton would untie them; load the whole model "
                         "on every rank and use shard_model")
    if (full is not None) != (dist.get_rank() == 0):
        raise ValueError("rank 0, and only rank 0, passes the full state dict")
    shard_model(skeleton, stage, parallel, init_device_mesh(device.type, (dist.get_world_size(),)), mixed_precision,
                expert_parallel)
    skeleton.to_empty(device=device)
    set_model_state_dict(skeleton, full or {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True))
    return skeleton
