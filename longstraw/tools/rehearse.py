"""`longstraw plan --rehearse`: the real step code at full size under fake tensors, beside the planner's figure.

Each rehearsed rank is one run of torch's fake process group (`init_process_group("fake")`: collectives return
at once) of N ranks, in which every tensor is a `FakeTensor` (shapes and dtypes, no memory) on the CPU device,
standing for the GPU (fake CUDA tensors would still need CUDA for FSDP's streams and the device mesh; the ops the
CPU path takes save what the GPU's do, but for the delta rule, below): the model at its real widths (ZeRO-3:
sharded by FSDP2 as the engine shards it), the rank's prefix-state
shard and dState shard of the whole prompt, the boundary states it keeps, its replayed branches, the exact prompt
backward, and the optimizer step. `LiveBytes` adds up the storages alive on the device at every op and keeps
the peak.

What it leaves out, to run in minutes:
- capture: its state is allocated whole instead (capture runs without autograd; the planner counts it the same);
- the prompt backward runs its last chunks only (`last_chunks`, 2 by default; the last has the most prefix rows);
  all chunks of one rank are alike in size;
- host values: fake tensors have none, so `HostValues` answers for them (a scalar read is 0 or 1.0, a
  comparison is true) and the group's agreement checks (which exchange host values) pass;
- the Gated DeltaNet recurrence runs as a stand-in with flash-linear-attention's saved tensors (the kernel does
  not run on fake tensors); the optimizer step with an offloaded optimizer runs on the host, which is not counted;
- MoE routing (which expert a token picks is a value): routing is taken as balanced, each rank receiving as many
  (token, expert) rows as it sends (expert parallelism), and every row runs through one expert's weights, which
  saves what its own expert would;
- DSA's selection on a split prompt scores two key blocks of the prefix, not all (each block's scores are the
  same transient), and keeps k candidates;
- the layer-major prompt order (ZeRO-3's `auto` on GLM-5): a plan that walks the prompt layer by layer is refused
  (`--prompt-order chunks` plans the chunk order, which the rehearsal runs).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..engine.chunks import empty_state
from ..engine.config import EngineConfig
from ..engine.capture import new_dstate
from ..engine.branches import Branches
from ..engine.prompt import prompt_backward
from ..engine.replay import replay
from ..grpo import GRPOConfig
from ..models.config import with_rope_scaling
from ..models.registry import build
from ..lora import add_lora
from ..models.common.moe import Experts
from ..ops import attention, gated_delta, sparse_attention, split_sparse_attention
from ..parallel import experts as experts_mod
from ..parallel import SequenceParallel, local_shard, shard_model
from ..state import boundary_states
from .activations import FLA_CHUNK


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages on `device` that ops created and that are still referenced; `peak` their most.
    A storage resized in place (FSDP frees and refills its gathered parameters so) counts its new size."""

    def __init__(self, device: str = "cuda") -> None:
        super().__init__()
        self.device, self.live, self.now, self.peak = device, {}, 0, 0
        self._resize = None

    def __enter__(self):
        resize, live = torch.UntypedStorage.resize_, self

        def resized(storage, size):
            out = resize(storage, size)
            key = id(storage)
            if key in live.live:
                live.now += storage.nbytes() - live.live[key]
                live.live[key] = storage.nbytes()
                live.peak = max(live.peak, live.now)
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = resized
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def add(self, t: torch.Tensor) -> None:
        # a DTensor wraps its local shard, which the ops under it create (and this mode sees) on their own
        if t.device.type != self.device or isinstance(t, DTensor):
            return
        storage = t.untyped_storage()
        self._register(storage, storage.nbytes())

    def ignore(self, t: torch.Tensor) -> None:
        """Leave `t`'s storage out: a measure of what a step allocates does not count the weights it reads."""
        self._register(t.untyped_storage(), 0)

    def _register(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Count `storage` as `nbytes` from now until it is freed (once: a storage seen before keeps its count)."""
        key = id(storage)
        if key in self.live:
            return
        self.live[key] = nbytes
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._drop, key)

    def _drop(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out


class HostValues(TorchDispatchMode):
    """Answers what fake tensors cannot: a scalar read is 0 for integers, 1.0 for floats (a step count, a norm),
    False for bool; `torch.equal` is true."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return False if dtype == torch.bool else (1.0 if dtype.is_floating_point else 0)
        if func is torch.ops.aten.equal.default:
            return True
        return func(*args, **(kwargs or {}))


class RehearsalGroup(SequenceParallel):
    """A sequence-parallel group over the fake process group whose agreement checks pass (they exchange host
    values, which fake tensors lack)."""

    def check_agree(self, what: str, settings: dict) -> None:
        pass

    def check_same(self, ids: torch.Tensor, what: str) -> None:
        pass

    def agree_min(self, value: int) -> int:
        return value


class _KernelShaped(torch.autograd.Function):
    """The gated delta rule's shapes, saving what flash-linear-attention's chunk kernel saves (fla/ops/
    gated_delta_rule/chunk.py): the normalised q, k and their fp32 norm factors at the key heads, v, the fp32
    gate, beta and A at the value heads; its backward holds the per-chunk states h and their gradient (bf16, one
    per 64 tokens) while it runs."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state):
        b, t, hv, dv = v.shape
        normed = [torch.empty_like(q), torch.empty_like(k)]
        factors = [v.new_empty(b, t, heads, dtype=torch.float32) for heads in (q.shape[2], k.shape[2], hv)]
        # the kernel's input guard copies a strided v (a view into the layer's projection) before saving it
        ctx.save_for_backward(*normed, v.contiguous(), *factors, beta, v.new_empty(b, t, hv, FLA_CHUNK))
        ctx.shapes = (q.shape, k.shape, g.shape, None if initial_state is None else initial_state.shape)
        return torch.empty_like(v), v.new_empty(b, hv, k.shape[-1], dv, dtype=torch.float32)

    @staticmethod
    def backward(ctx, do, dfinal):
        _, _, v, *_, beta, _ = ctx.saved_tensors
        (qs, ks, gs, init), (b, t, hv, dv) = ctx.shapes, v.shape
        states = [v.new_empty(b, -(-t // FLA_CHUNK), hv, ks[-1], dv) for _ in range(2)]  # h and dh
        grads = (v.new_empty(qs), v.new_empty(ks), torch.empty_like(v), v.new_empty(gs, dtype=torch.float32),
                 torch.empty_like(beta), None if init is None else v.new_empty(init, dtype=torch.float32))
        del states
        return grads


def _kernel_delta_rule(q, k, v, g, beta, initial_state=None, *args, **kw):
    """`ops.gated_delta.chunk_gated_delta_rule`'s stand-in in a rehearsal (o, final state)."""
    return _KernelShaped.apply(q, k, v, g, beta, initial_state)


def _one_expert(self, rows: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
                ) -> torch.Tensor:
    """`Experts._sorted`'s stand-in: every row through one expert's weights, which saves what the experts save
    for the same rows (their ids, and so the blocks, are values fake tensors lack)."""
    gate, up = F.linear(rows, gate_up[0]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down[0])


def _balanced_route(rows: torch.Tensor, experts: torch.Tensor, ep, run) -> torch.Tensor:
    """`parallel.experts.route`'s stand-in: routing balanced over the ranks, so a rank receives as many rows as it
    sends; the received rows and the returned outputs are new buffers, as the all-to-alls' are."""
    return run(rows.clone(), experts).clone()


def _two_blocks_topk(score_blocks, k: int):
    """`topk_candidates`' stand-in: the first two key blocks scored and merged (every block's scores are the same
    transient; at 2.1M tokens a layer has hundreds), then k candidates, as a long prefix yields."""
    run = sparse_attention.topk_candidates(itertools.islice(score_blocks, 2), k)
    if run is None:
        return None
    vals, pos = run
    return vals.new_empty(*vals.shape[:-1], k), pos.new_empty(*pos.shape[:-1], k)


@contextmanager
def _stand_ins(kernels: bool) -> Iterator[None]:
    """What the rehearsal runs in place of value-sized or merely long code: with `kernels`, the GPU delta-rule
    kernel's shapes and the GPU's key rows per block of a prefix gradient; the experts' routing, and DSA's
    selection over two key blocks."""
    saved = (gated_delta.chunk_gated_delta_rule, experts_mod.route, Experts._sorted,
             split_sparse_attention.topk_candidates, attention.PREFIX_GRAD_ROWS_CPU)
    if kernels:  # the fake tensors sit on the CPU, standing for the GPU's
        gated_delta.chunk_gated_delta_rule = _kernel_delta_rule
        # the prefix gradient in the GPU's blocks of key rows: 4x the CPU's, a quarter of the ops to rehearse
        attention.PREFIX_GRAD_ROWS_CPU = attention.PREFIX_GRAD_ROWS
    experts_mod.route, Experts._sorted = _balanced_route, _one_expert
    split_sparse_attention.topk_candidates = _two_blocks_topk
    try:
        yield
    finally:
        (gated_delta.chunk_gated_delta_rule, experts_mod.route, Experts._sorted,
         split_sparse_attention.topk_candidates, attention.PREFIX_GRAD_ROWS_CPU) = saved


def rehearse(hf_config: dict, tokens: int, gpus: int, plan: dict, *, ranks: list[int] | None = None,
             responses: int = 8, response_tokens: int = 1024, last_chunks: int = 2,
             rope_scaling: dict | None = None, kernels: bool = True, lora: dict | None = None) -> dict:
    """The rehearsal of `ranks` (default: the first and the last, whose blocks sit at the two ends of every
    chunk) with the plan's settings: each one's peak device bytes, and the largest beside the planner's figure."""
    ranks = sorted({0, gpus - 1}) if ranks is None else ranks
    out = {r: rehearse_rank(hf_config, tokens, gpus, r, plan=plan, responses=responses,
                            response_tokens=response_tokens, last_chunks=last_chunks, rope_scaling=rope_scaling,
                            kernels=kernels, lora=lora) for r in ranks}
    peak = max(o["peak_bytes"] for o in out.values())
    return {"ranks": out, "peak_bytes": peak, "planned_bytes": plan["exact_bytes"],
            "ratio": plan["exact_bytes"] / peak, "last_chunks": last_chunks}


def format_rehearsal(r: dict) -> str:
    lines = [f"rehearsal (the step's code under fake tensors; a fake process group; the prompt backward's last "
             f"{r['last_chunks']} chunks, capture allocated whole):"]
    for rank, o in r["ranks"].items():
        phases = ", ".join(f"{k} {v / 1e9:,.2f}" for k, v in o["phases"].items())
        lines.append(f"  rank {rank}: peak {o['peak_bytes'] / 1e9:,.2f} GB (running peak after each phase, GB: "
                     f"{phases})")
    lines.append(f"  planner {r['planned_bytes'] / 1e9:,.2f} GB per rank = {r['ratio']:.2f} x the rehearsal's peak")
    return "\n".join(lines)


def rehearse_rank(hf_config: dict, tokens: int, gpus: int, rank: int, *, plan: dict, responses: int = 8,
                  response_tokens: int = 1024, last_chunks: int = 2, rope_scaling: dict | None = None,
                  kernels: bool = True, lora: dict | None = None) -> dict:
    """One rank's step under fake tensors with the plan's settings (chunk, checkpointing, ZeRO, precision,
    offload); returns its peak device bytes and the running peak after each phase. `kernels`: the delta rule
    saves what the GPU kernel saves (else the torch form runs, as on CPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hf_config = with_rope_scaling(hf_config, rope_scaling)
    if plan["sp"] != gpus:
        raise ValueError("--rehearse runs one sequence-parallel group of all the GPUs (drop --sp)")
    if plan["prompt_order"] != "chunks":
        raise ValueError("--rehearse runs the prompt chunk by chunk; this plan walks it layer by layer: plan it with "
                         "--prompt-order chunks to rehearse it")
    if plan["zero"] == 1:
        raise ValueError("--rehearse runs ZeRO 0, 2 and 3 (ZeRO-1's share of the optimizer is not rehearsed)")
    dist.init_process_group("fake", rank=rank, world_size=gpus, store=FakeStore())
    try:
        with _stand_ins(kernels):
            return _rehearse(hf_config, tokens, plan, responses, response_tokens, last_chunks, FakeTensorMode,
                             lora)
    finally:
        dist.destroy_process_group()


def _rehearse(hf_config: dict, tokens: int, plan: dict, responses: int, response_tokens: int, last_chunks: int,
              fake_mode, lora: dict | None) -> dict:
    mixed = plan["precision"] == "bf16-mixed"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if plan["precision"] == "fp32" else torch.bfloat16)
    try:
        with torch.device("meta"):
            model = build(hf_config)
    finally:
        torch.set_default_dtype(default)
    if lora:  # on the meta device too; PEFT keeps the adapters fp32 beside bf16 weights
        add_lora(model, r=lora["r"], target_modules=lora["target_modules"])
    live, phases = LiveBytes("cpu"), {}
    mesh = None
    if plan["zero"] >= 2:  # built outside the fake mode: the mesh computes its coordinates from real tensors
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh("cpu", torch.arange(dist.get_world_size()))
    engine = EngineConfig(prompt_chunk=plan["chunk"], prompt_graph_budget=0, boundary_every=plan["boundary_every"],
                          prompt_order="chunks", checkpoint_layers=plan["checkpoint_layers"],
                          head_chunk=plan["head_chunk"])
    branch = [torch.zeros(response_tokens, dtype=torch.long) for _ in range(responses)]
    branches = Branches.group(branch, [0.0] * responses, GRPOConfig(), vocab_size=model.config.vocab_size)
    group = RehearsalGroup()
    if plan["zero"] >= 2:  # on the meta device, so that only this rank's shards are ever allocated
        shard_model(model, plan["zero"], group, mesh=mesh, mixed_precision=mixed,
                    expert_parallel=plan.get("expert_parallel"))
    with fake_mode(allow_non_fake_inputs=True), HostValues(), live:
        model = model.to_empty(device="cpu")
        for e in experts_mod.expert_modules(model):  # DTensors not FSDP's: their local storage is made under DTensor's dispatch
            for p in e.parameters():
                live.add(local_shard(p))
        optimizer = _optimizer(model, mixed) if plan["offload"] == "none" else None
        phases["model"] = live.now
        prompt = torch.zeros(tokens, dtype=torch.long)
        state = empty_state(model, prompt, engine.prompt_chunk, group)
        state.boundary_every = engine.boundary_every
        mine = range(0, len(state.chunks), engine.boundary_every)
        mine = [i for i in mine if group.boundary_owner(i, engine.boundary_every) == group.rank]
        for i in mine:
            state.boundaries[i] = {j: b.map(torch.empty_like) for j, b in boundary_states(state.layers).items()}
        dstate = new_dstate(state)
        phases["state"] = live.now
        replay(model, state, branches, GRPOConfig(), dstate, engine=engine, parallel=group)
        phases["replay"] = live.peak
        prompt_backward(model, state, dstate, engine=engine, parallel=group, last_chunks=last_chunks)
        phases["prompt backward"] = live.peak
        if optimizer is not None:
            opt, pairs = optimizer
            for p, master in pairs:  # the bf16 gradient shard cast into the master's (MasterAdamW)
                if p.grad is not None:  # none where no loss reaches (DSA's indexer)
                    master.grad = local_shard(p.grad).to(master.dtype)
            opt.step()
        phases["optimizer"] = live.peak
    return {"peak_bytes": live.peak, "phases": phases}


def _optimizer(model: torch.nn.Module, mixed: bool):
    """AdamW over this rank's share of the trainable parameters, its state made up front as a run holds it from
    the first step: with `mixed`, an fp32 master copy of each shard (`optim.mixed_precision`); the two moments."""
    pairs = []
    for p in model.parameters():
        if p.requires_grad:
            local = local_shard(p).detach()
            pairs.append((p, torch.nn.Parameter(local.float() if mixed else local)))
    opt = torch.optim.AdamW([m for _, m in pairs], foreach=False)
    for _, m in pairs:
        opt.state[m] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m), "exp_avg_sq": torch.zeros_like(m)}
    return opt, pairs
