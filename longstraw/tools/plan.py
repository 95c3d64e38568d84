"""`longstraw plan`: bytes per rank of one exact (or detached) GRPO step on N GPUs, from config.json alone, for
the GPU path, and the prompt chunk and per-layer checkpointing that fit (searched, unless given).

Per rank, for sequence-parallel groups of C ranks (N / C of them, splitting the branches):
- model state (`model_state_bytes`, train/precision.py): weights, gradients, fp32 master weights and AdamW
  moments by precision (`bf16-mixed`: bf16 weights and compute, fp32 master and moments; `bf16`; `fp32`), ZeRO
  stage and optimizer offload (the master and moments on the host);
- the prefix-state shard (the per-token rows of T / C tokens, plus the fixed-size states, which every rank
  holds), in exact mode the dState shard of the same layout and the boundary states of the rank's own chunks;
- under ZeRO-3, the layer-major prompt backward's checkpoints (engine/prompt_by_layer.py), when they fit a
  quarter of the GPU as the engine's `prompt_order: auto` requires, and FSDP's gathered units: the largest layer
  and the one prefetched after it, and the root (embedding and LM head);
- the largest of three peaks of work (tools/activations.py: saved bytes per token of each layer kind,
  measured on proxies, the GPU kernels' tensors where they differ from the CPU path):
  - a prompt chunk's (a rank's block of it; every graph recomputed, `prompt_graph_budget: 0`): its layers'
    activations (with `checkpoint_layers`, every layer's input and one layer's), the whole chunk's queries that
    each attention layer gathers and keeps, and in the backward of an attention layer the gradient of the
    rank's prefix rows of that layer (and DSA's candidates: chunk x top-k, and its backward's fp32 gradients of
    every gathered query);
  - a branch's: its activations the same way, and the LM head's logits of `head_chunk` positions (fp32 logits,
    their log-softmax and its gradient);
  - FSDP's reduction of the largest unit's gradient (ZeRO-3: the root, embedding and LM head, on large
    vocabularies): its unsharded bf16 gradient and the fp32 copy reduce-scattered.
- with expert parallelism (MoE under ZeRO-2/3, parallel/experts.py) the gathered units leave the experts out
  (each rank keeps its E / N whole), and a MoE layer's all-to-all buffers are added: the rows a rank sends and
  receives (tokens x top-k, there and back), for balanced routing (a rank whose experts are favoured gets more).
The rehearsal (`--rehearse`, tools/rehearse.py) runs the step's code at full size under fake tensors to check it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..engine import EngineConfig
from ..engine.policy import GRAPH_SHARE, Costs, layer_major_bytes, resolve
from ..engine.routing import prompt_moe_layers
from ..models.common.moe import MoE, expert_id_dtype
from ..lora import check_lora_targets
from ..models.config import with_rope_scaling
from ..models.planner import AttentionGeometry, HeadAttention, LatentSparseAttention
from ..models.registry import build, config_from_hf, planner_profile
from ..ops.attention import grad_rows
from ..ops.sparse_attention import SCORE_BYTES
from ..parallel.experts import expert_modules, experts_divide
from ..train.precision import Offload, Precision, optimizer_bytes
from .activations import ActivationProfile, LayerKind, activation_profile
from .state_size import state_size

CHUNKS = (512, 1024, 2048, 4096, 8192, 16384)  # the prompt chunks the search tries
LOGIT_BYTES = 4 + 4 + 4 + 2  # per logit of a head chunk: fp32 logits, log-softmax, its gradient; bf16 logits


def model_state_bytes(params: int, adapters: int, zero: int, ranks: int, precision: Precision = "bf16-mixed",
                      offload: Offload = "none") -> dict[str, float]:
    """Bytes per rank of weights, gradients and optimizer state: "device", and "host" (what optimizer offload
    keeps in host memory or on NVMe), as `train/precision.py`'s `optimizer_bytes` counts the trainable ones. With
    LoRA (`adapters` > 0) the fp32 adapters are trained and the base weights frozen (bf16 unless fp32; ZeRO-3
    shards them)."""
    if not adapters:
        opt = optimizer_bytes(params, precision, offload, zero, ranks)
        return {"device": opt["device"], "host": opt["host"] + opt["nvme"]}
    opt = optimizer_bytes(adapters, "fp32", offload, zero, ranks)
    frozen = (4 if precision == "fp32" else 2) * params / (ranks if zero >= 3 else 1)
    return {"device": opt["device"] + frozen, "host": opt["host"] + opt["nvme"]}


def adapter_parameters(hf_config: dict, r: int, target_modules: list[str]) -> int:
    """Parameters of LoRA adapters of rank r on the named linear modules: r x (in + out) each."""
    with torch.device("meta"):
        model = build(hf_config)
    check_lora_targets(model, target_modules)
    return sum(r * (m.in_features + m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and any(n == t or n.endswith("." + t) for t in target_modules))


def flat_profile(hf_config: dict, bytes_per_token: int) -> ActivationProfile:
    """A profile of `bytes_per_token` for the whole model, spread evenly over its layers (`--activation-kb`)."""
    cfg = config_from_hf(hf_config)
    layers = cfg.num_hidden_layers
    return ActivationProfile((LayerKind("layer", layers, -(-bytes_per_token // layers)),), layers,
                             cfg.hidden_size * 2, 0)


def _attention_extras(meta, tokens_per_rank: float, width: int, ranks: int, device: str = "cuda"
                      ) -> dict[str, float]:
    """Per attention layer: the bytes per chunk token of the queries every rank gathers (and its split
    attention keeps, over `ranks` ranks), the bytes of the prefix rows' gradient of the largest such layer (in its
    backward), DSA's candidates per token (top-k positions and scores), the buffers of the attention's backward
    per gathered query and per own query (the model's dtype is `width` bytes), how many layers attend, and in how
    many query tiles a recomputed attention layer runs (per-layer checkpointing: the query terms are one tile's)."""
    cfg = meta.config
    states = meta.empty_state(1, torch.float32 if width == 4 else torch.bfloat16, "meta")
    rows = [s.bytes_per_token for s in states if s.token_axis is not None]
    tiles = max(layer.query_tile_count for layer in meta.decoder_layers)
    query, candidates, backward, own_backward, scores = _query_bytes(planner_profile(cfg.model_type).attention(cfg),
                                                                     width, ranks)
    # the prefix rows' gradient comes out `grad_rows` rows at a time on `device` (ops/attention.py); DSA's goes
    # into its sink by selected row, counted alike (an upper bound)
    prefix_grad = max(rows, default=0) * min(tokens_per_rank, grad_rows(device))
    return {"query": query, "prefix_grad": prefix_grad, "candidates": candidates,
            "query_backward": backward, "own_query_backward": own_backward, "index_scores": scores,
            "layers": len(rows), "query_tiles": tiles}


def _query_bytes(geometry: AttentionGeometry, width: int, ranks: int) -> tuple[int, int, int, int, int]:
    """(gathered query, candidates, backward per gathered query, backward per own query, index scores) in bytes,
    as `_attention_extras` counts them, for an attention layer of `geometry` (the family's planner profile)."""
    if isinstance(geometry, LatentSparseAttention):
        row = geometry.latent_dim + geometry.rope_dim
        query = geometry.heads * row * 2 + geometry.index_heads * geometry.index_head_dim * 2
        # ops/split_sparse_attention.py's backward: every gathered query's output gradient (the values' width, in
        # the model's dtype); per own query, its fp32 gradient and, a slice of positions at a time, the fp32
        # shares it sends and receives (a slice of every rank's queries is about the rank's own count)
        backward = geometry.heads * geometry.latent_dim * width
        own_backward = 3 * geometry.heads * row * 4
        # the selection's per-head index scores of one key block (ops/sparse_attention.key_block), two alive
        return query, geometry.top_k * 12, backward, own_backward, 2 * SCORE_BYTES
    if isinstance(geometry, HeadAttention):
        q_row = geometry.heads * geometry.head_dim * width
        # the attention's backward (ops/attention.py, ops/split_attention.py), about five query-sized buffers: dO
        # made contiguous, the own part's dq, a row block's dq and their sum, the copies that fold rows to the
        # prefix's heads; split over ranks, also every rank's gathered output gradients and outputs
        backward = q_row * (5 + (2 if ranks > 1 else 0))
        return q_row if ranks > 1 else 0, 0, backward, 0, 0  # one rank gathers no queries
    raise ValueError(f"attention geometry {type(geometry).__name__} has no byte count in the planner: add it to "
                     "tools/plan.py's _query_bytes (models/planner.py lists the geometries)")


def expert_parallel_default(meta, zero: int, gpus: int, asked: bool | None) -> bool:
    """Whether the step runs expert-parallel: as asked, else (as `shard_model`) whenever the model has fused
    experts under ZeRO-2/3 and they split evenly over the GPUs."""
    fits = zero >= 2 and experts_divide(meta, gpus)
    if asked and not fits:
        raise ValueError("--expert-parallel on needs a MoE model under --zero 2 or 3 whose experts split evenly "
                         f"over the {gpus} GPUs")
    return fits if asked is None else asked


def _all_to_all_bytes(meta, width: int) -> float:
    """Bytes per token of one MoE layer's expert-parallel buffers: each (token, expert) row sent and received,
    there and back."""
    moe = [m for m in meta.modules() if isinstance(m, MoE)]
    if not moe:
        return 0.0
    return 4 * moe[0].gate.top_k * meta.config.hidden_size * width


def _fsdp_transients(meta, zero: int, precision: Precision, frozen: bool, experts_local: bool = False
                     ) -> tuple[float, float]:
    """ZeRO-2/3 (FSDP): (the bf16 copies of the units gathered at once: the largest layer and the next one it
    prefetches, and the root (embedding and LM head); the reduction of the largest unit's gradient: its unsharded
    gradient and, with bf16-mixed, the fp32 copy FSDP reduce-scatters; none for `frozen` weights (LoRA: the
    adapters' is small)). `experts_local`: expert parallelism, the experts in no unit."""
    if zero < 2:
        return 0.0, 0.0
    width = 4 if precision == "fp32" else 2
    left_out = {id(p) for e in expert_modules(meta) for p in e.parameters()} if experts_local else set()
    largest = max(sum(p.numel() for p in layer.parameters() if id(p) not in left_out) for layer in meta.model.layers)
    root = sum(p.numel() for m in (meta.model.embed_tokens, meta.lm_head) for p in m.parameters(recurse=False))
    reduce = width + (4 if precision == "bf16-mixed" else 0)
    return width * (2 * largest + root), 0.0 if frozen else reduce * max(largest, root)


@dataclass(frozen=True)
class Workload:
    """What one step computes: a prompt of `tokens`, `responses` answers of `response_tokens` each; with `lora`
    ({r, target_modules}) the adapters are trained, the base weights frozen; `rope_scaling` (as `load_model`'s)
    extends the model's positions ("fits" needs them to cover prompt + response: `positions_accepted`);
    `routing_replay` (`moe_routing_replay`): each rank keeps its prompt tokens' recorded experts with the state."""

    tokens: int
    responses: int = 8
    response_tokens: int = 1024
    lora: dict | None = None
    rope_scaling: dict | None = None
    routing_replay: bool = False


@dataclass(frozen=True)
class Cluster:
    """Where it runs: `gpus` GPUs of `gpu_mem_gb` GB in sequence-parallel groups of `sp` (None: all of them), under
    ZeRO stage `zero`, in `precision`, with optimizer `offload`; `expert_parallel` (None: as `shard_model`
    decides) keeps a MoE model's experts whole on their ranks."""

    gpus: int
    gpu_mem_gb: float
    zero: int = 1
    sp: int | None = None
    precision: Precision = "bf16-mixed"
    offload: Offload = "none"
    expert_parallel: bool | None = None


@dataclass(frozen=True)
class EngineChoice:
    """The engine settings the plan takes as given (None: searched): the prompt chunk, per-layer checkpointing,
    `prompt_order` as `EngineConfig.prompt_order` (auto: layer by layer under ZeRO-3 when its checkpoints fit a
    quarter of the GPU), the LM head's chunk; and the activations: `profile` (tools/activations.py; measured when
    None) or `activation_bytes` (a flat figure per token)."""

    chunk: int | None = None
    checkpoint_layers: bool | None = None
    prompt_order: str = "auto"
    head_chunk: int | None = None
    profile: ActivationProfile | None = None
    activation_bytes: int | None = None


def plan(hf_config: dict, work: Workload, cluster: Cluster, engine: EngineChoice = EngineChoice()) -> dict:
    """Per-rank bytes of exact and detached mode of `work` on `cluster`, for the prompt chunk and per-layer
    checkpointing `engine` gives, or else the ones the search picks: of those that fit, first those leaving a
    tenth of the GPU, then without checkpointing (one forward less), then the largest chunk (fewer steps and
    weight gathers); when none fits, the smallest footprint."""
    tokens, gpus, zero, precision = work.tokens, cluster.gpus, cluster.zero, cluster.precision
    lora, prompt_order = work.lora, engine.prompt_order
    if prompt_order not in ("auto", "chunks", "layers"):
        raise ValueError(f"prompt order {prompt_order!r}: auto, chunks or layers")
    hf_config = with_rope_scaling(hf_config, work.rope_scaling)
    c = cluster.sp or gpus
    if gpus % c or c < 1:
        raise ValueError(f"--sp {c} must divide --gpus {gpus}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero {zero}: ZeRO stages are 0, 1, 2, 3")
    profile = engine.profile
    if profile is None:
        profile = flat_profile(hf_config, engine.activation_bytes) if engine.activation_bytes else \
            activation_profile(hf_config, _lora_args(lora))
    chunks = [engine.chunk] if engine.chunk else [x for x in CHUNKS if x >= c]
    ckpts = [engine.checkpoint_layers] if engine.checkpoint_layers is not None else [False, True]
    with torch.device("meta"):
        meta = build(hf_config)
    size = state_size(hf_config, tokens, "fp32" if precision == "fp32" else "bf16")  # the model's dtype
    adapters = adapter_parameters(hf_config, lora["r"], lora["target_modules"]) if lora else 0
    params = sum(p.numel() for p in meta.parameters())
    ep = expert_parallel_default(meta, zero, gpus, cluster.expert_parallel)
    # what no (chunk, checkpointing) pair changes, counted once
    fixed = {"params": params, "adapters": adapters,
             "model_state": model_state_bytes(params, adapters, zero, gpus, precision, cluster.offload),
             "attn": _attention_extras(meta, tokens / c, 4 if precision == "fp32" else 2, c,
                                       "cuda" if profile.gpu else "cpu"),
             "fsdp": _fsdp_transients(meta, zero, precision, frozen=adapters > 0, experts_local=ep),
             "expert_parallel": ep,
             "all_to_all": _all_to_all_bytes(meta, 4 if precision == "fp32" else 2) if ep else 0.0,
             "routing": routing_bytes_per_token(meta) * tokens / c if work.routing_replay else 0.0}
    # under ZeRO-3 the engine's `auto` order is searched against the chunk order, which holds no layer-major
    # checkpoints
    orders = ["auto", "chunks"] if prompt_order == "auto" and zero == 3 else [prompt_order]
    options = [_plan_one(meta, size, fixed, work, cluster,
                         replace(engine, chunk=x, checkpoint_layers=k, prompt_order=o, profile=profile))
               for o in orders for k in ckpts for x in chunks]
    fitting = [r for r in options if r["exact_fits"]]
    if fitting:  # comfortably (a tenth of the GPU left for the allocator, CUDA and NCCL) before barely
        best = min(fitting, key=lambda r: (r["exact_bytes"] > 0.9 * r["gpu_bytes"], r["prompt_order_setting"] != "auto",
                                           r["checkpoint_layers"], -r["chunk"]))
    else:
        best = min(options, key=lambda r: r["exact_bytes"])
    return {**best, "searched": len(chunks) * len(ckpts) > 1}


def _plan_one(meta, size: dict, fixed: dict, work: Workload, cluster: Cluster, engine: EngineChoice) -> dict:
    """The plan of one (chunk, checkpointing, prompt order) choice, all given in `engine` with its activation
    profile; `size` is `state_size`'s report (its chunk count redone), `fixed` what plan() counted once for all."""
    tokens, responses, response_tokens = work.tokens, work.responses, work.response_tokens
    gpus, gpu_mem_gb, zero, precision, offload = (cluster.gpus, cluster.gpu_mem_gb, cluster.zero, cluster.precision,
                                                  cluster.offload)
    c = cluster.sp or gpus
    chunk, ckpt, order, profile = engine.chunk, engine.checkpoint_layers, engine.prompt_order, engine.profile
    size = {**size, "prompt_chunks": -(-tokens // chunk)}
    params, adapters, model_state, attn = fixed["params"], fixed["adapters"], fixed["model_state"], fixed["attn"]
    gathered, reduction = fixed["fsdp"]
    rows = size["bytes_per_token"] * tokens / c
    state = rows + size["fixed_bytes"] + fixed["routing"]
    dstate = (size["bytes_per_token"] - size["bytes_per_token_nograd"]) * tokens / c + size["fixed_bytes"]
    budget = gpu_mem_gb * 1e9
    # the engine's own policy (engine/policy.py) on these estimates: every prompt graph recomputed
    costs = Costs(chunk_tokens=(chunk,) * size["prompt_chunks"], ranks=c, fixed_bytes=int(size["fixed_bytes"]),
                  layer_major_bytes=layer_major_bytes(meta.config.num_hidden_layers, tokens / c,
                                                      meta.config.hidden_size * 2, int(size["fixed_bytes"]),
                                                      size["prompt_chunks"]),
                  layer_major_auto=zero == 3, activation_bytes_per_token=lambda: int(profile.per_token(False)),
                  checkpointed_bytes_per_token=int(profile.per_token(True)), vocab_size=meta.config.vocab_size)
    policy = resolve(EngineConfig(prompt_chunk=chunk, checkpoint_layers=ckpt, prompt_order=order,
                                  prompt_graph_budget=0, head_chunk=engine.head_chunk), costs, int(budget), exact=True)
    mine = costs.rank_chunks  # each rank keeps the boundaries of its own chunks
    every = policy.boundary_every
    boundaries = size["fixed_bytes"] * (math.ceil(mine / every) + (every if every > 1 else 0))
    # the layer-major prompt backward (engine/prompt_by_layer.py; auto: under ZeRO-3, when it fits a quarter of
    # the GPU): layers / k + k hidden states of the rank's tokens, one group's fixed-size states per chunk; it
    # runs one layer at a time (no whole-chunk graph)
    checkpoints = costs.layer_major_bytes
    by_layer = checkpoints if policy.prompt_order == "layers" else 0.0
    block = math.ceil(chunk / c)  # a rank runs its block of each chunk only
    held = 1 if ckpt or by_layer else attn["layers"]  # attention layers whose gathered queries are alive at once
    chunk_act = profile.per_token(ckpt or bool(by_layer)) * block
    # a recomputed attention layer gathers and backpropagates one query tile's queries at a time
    tiles = attn["query_tiles"] if ckpt or by_layer else 1
    chunk_peak = chunk_act + (held * attn["query"] + attn["query_backward"]) * chunk / tiles + \
        attn["prefix_grad"] + attn["candidates"] * chunk + attn["own_query_backward"] * block + \
        attn["index_scores"] + fixed["all_to_all"] * block
    vocab = meta.config.vocab_size
    head = min(policy.head_chunk, response_tokens)
    branch_act = profile.per_token(ckpt) * response_tokens  # one branch at a time (branch_batch 1)
    tiles = attn["query_tiles"] if ckpt else 1
    branch_peak = branch_act + head * vocab * LOGIT_BYTES + \
        (held * attn["query"] + attn["query_backward"]) * response_tokens * c / tiles + \
        attn["own_query_backward"] * response_tokens + attn["index_scores"] + fixed["all_to_all"] * response_tokens
    common = model_state["device"] + state
    # the gathered units live while layers run; FSDP reshards them before it reduces the last unit's gradient
    exact = common + dstate + boundaries + by_layer + max(chunk_peak + gathered, branch_peak + gathered, reduction)
    detached = common + max(branch_peak + gathered, reduction)  # its capture runs without autograd
    per_rank = {"weights, gradients, optimizer": model_state["device"], "FSDP gathered units": gathered,
                "state shard": state - fixed["routing"],
                **({"MoE routing (replay)": fixed["routing"]} if fixed["routing"] else {}),
                "dState shard": dstate, "boundary states": boundaries, "layer-major checkpoints": by_layer,
                "one chunk's activations": chunk_act, "chunk backward transients": chunk_peak - chunk_act,
                "one branch's activations": branch_act, "LM head chunk + queries": branch_peak - branch_act,
                "gradient reduction (FSDP)": reduction}
    return {
        "model_type": size["model_type"], "parameters": params, "adapter_parameters": adapters, "tokens": tokens,
        "gpus": gpus, "sp": c, "dp": gpus // c, "zero": zero, "chunk": chunk, "checkpoint_layers": ckpt,
        "expert_parallel": fixed["expert_parallel"],
        "precision": precision, "offload": offload, "host_bytes": model_state["host"], "head_chunk": head,
        "boundary_every": every, "branches_per_group": max(1, responses // (gpus // c)),
        "activation_bytes_per_token": profile.whole, "checkpointed_bytes_per_token": profile.per_token(True),
        "gpu_bytes": budget, "per_rank": per_rank,
        "prompt_order": "layers" if by_layer else "chunks", "prompt_order_setting": order,
        "layer_major_bytes": checkpoints,
        "exact_bytes": exact, "detached_bytes": detached, "exact_fits": exact <= budget,
        "detached_fits": detached <= budget, **_positions(meta.config, tokens + response_tokens),
    }


def routing_bytes_per_token(meta) -> int:
    """Bytes of one prompt token's recorded experts under MoE routing replay (engine/routing.py): top-k ids in every
    MoE layer but the last decoder layer, in the narrowest integer dtype (GLM-5: 8 x 1 byte x 74 layers)."""
    routers = prompt_moe_layers(meta)
    return sum(r.top_k * torch.empty((), dtype=expert_id_dtype(r.experts)).element_size() for r in routers.values())


def _positions(model_cfg, positions: int) -> dict:
    """Prompt + response positions against what the model accepts (the engine's check)."""
    ok = positions <= model_cfg.max_positions
    return {"positions": positions, "max_positions": model_cfg.max_positions, "positions_accepted": ok,
            "rope_scaling_needed": None if ok else model_cfg.scaling_for(positions)}


def smallest_fit(hf_config: dict, work: Workload, cluster: Cluster, engine: EngineChoice, mode: str) -> int | None:
    """The fewest GPUs (all in one sequence-parallel group: `cluster`'s count and `sp` are not used) on which
    `mode` fits, up to 4096. Expert parallelism asked for is taken where the experts split over the GPUs (as
    `auto`)."""
    if cluster.expert_parallel:
        cluster = replace(cluster, expert_parallel=None)
    if engine.profile is None:
        act = engine.activation_bytes
        engine = replace(engine, activation_bytes=None, profile=flat_profile(
            with_rope_scaling(hf_config, work.rope_scaling), act) if act else
            activation_profile(hf_config, _lora_args(work.lora)))
    for n in [2**i for i in range(13)]:
        if plan(hf_config, work, replace(cluster, gpus=n, sp=None), engine)[f"{mode}_fits"]:
            return n
    return None


def _lora_args(lora: dict | None) -> dict | None:
    return None if lora is None else {"r": lora["r"], "target_modules": lora["target_modules"]}


def format_plan(r: dict, fit_exact: int | None, fit_detached: int | None) -> str:
    gb = lambda b: f"{b / 1e9:10.2f} GB"  # noqa: E731
    lines = [f"{r['model_type']}: {r['parameters'] / 1e9:.2f}B parameters, {r['tokens']:,} tokens, {r['gpus']} GPUs "
             f"x {r['gpu_bytes'] / 1e9:.0f} GB, sequence-parallel groups of {r['sp']} (x{r['dp']}), ZeRO-{r['zero']}, "
             f"{r['precision']}" + (" (bf16 weights, fp32 master)" if r["precision"] == "bf16-mixed" else "") +
             (f", optimizer offload: {r['offload']}" if r["offload"] != "none" else "") +
             (f", LoRA: {r['adapter_parameters'] / 1e6:,.1f}M adapter parameters" if r["adapter_parameters"] else "") +
             (", expert-parallel (each rank keeps its experts whole)" if r.get("expert_parallel") else ""),
             f"{'searched' if r.get('searched') else 'given'}: prompt chunk {r['chunk']:,}, per-layer checkpointing "
             f"{'on' if r['checkpoint_layers'] else 'off'}, LM head in chunks of {r['head_chunk']:,} positions",
             f"activations {r['activation_bytes_per_token'] / 1e3:,.1f} KB per token, "
             f"{r['checkpointed_bytes_per_token'] / 1e3:,.1f} KB checkpointed (proxies of each layer kind; GPU "
             "kernels' saved tensors)", "per rank:"]
    for name, b in r["per_rank"].items():
        lines.append(f"  {name:<28}{gb(b)}")
    if r["host_bytes"]:
        lines.append(f"  {'host (offloaded optimizer)':<28}{gb(r['host_bytes'])}")
    ok = r.get("positions_accepted", True)
    if "positions" in r:
        lines.append(f"positions: {r['positions']:,} (prompt + response) " + (
            f"<= {r['max_positions']:,} accepted" if ok else f"> {r['max_positions']:,} accepted: capture would "
            f"refuse this prompt; add --rope-scaling {r['rope_scaling_needed']}"))
    for mode in ("exact", "detached"):
        verdict = ("fits" if ok else "capture would refuse the prompt (positions), though it fits in memory") \
            if r[f"{mode}_fits"] else "does NOT fit"
        spare = f", {(r['gpu_bytes'] - r[f'{mode}_bytes']) / 1e9:,.1f} GB to spare" if r[f"{mode}_fits"] and ok else ""
        lines.append(f"{mode:<9} mode: {gb(r[f'{mode}_bytes'])} per rank: {verdict}{spare}")
    for mode, n in (("exact", fit_exact), ("detached", fit_detached)):
        lines.append(f"smallest N for {mode}: {n if n else 'more than 4096'} GPUs (ZeRO-{r['zero']}, one group)")
    if r["boundary_every"] > 1:
        lines.append(f"boundary states: those of 1 in {r['boundary_every']} chunks kept, the others regenerated "
                     "(one more no-grad prompt forward)")
    if r["zero"] == 3:
        lines.append(f"prompt order: {r['prompt_order']} (layer by layer each layer is gathered once per pass, for "
                     f"{r['layer_major_bytes'] / 1e9:,.2f} GB of checkpoints; auto takes it when they fit a quarter "
                     "of the GPU)" + ("; set engine.prompt_order: chunks" if r.get("prompt_order_setting") ==
                                      "chunks" and r["layer_major_bytes"] <= r["gpu_bytes"] / GRAPH_SHARE else ""))
    return "\n".join(lines)
