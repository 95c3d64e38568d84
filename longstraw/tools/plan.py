"""`longstraw plan`: bytes per rank of one exact (or detached) GRPO step on N GPUs, from config.json alone.

Per rank, for sequence-parallel groups of C ranks (N / C of them, splitting the branches):
- parameters, gradients and optimizer state under ZeRO stage z (mixed precision as DeepSpeed counts it: bf16
  weights and gradients, fp32 master weights and AdamW moments = 12 bytes per parameter);
- the prefix-state shard (the per-token rows of T / C tokens, plus the fixed-size states, which every rank
  holds), in exact mode the dState shard of the same layout and the boundary states of the rank's own chunks;
- under ZeRO-3, the layer-major prompt backward's checkpoints (engine/prompt_by_layer.py), when they fit a
  quarter of the GPU as the engine's `prompt_order: auto` requires;
- one prompt chunk's autograd activations (a rank's block of it: the split schedule), measured on proxies of one
  and two layers of each layer kind (`engine/budget.py`), with all prompt-chunk graphs recomputed
  (`prompt_graph_budget: 0`).

The engine runs every stage: 0, 1 (`optim.zero_stage: 1`, torch's ZeroRedundancyOptimizer), 2 and 3 (FSDP2,
`longstraw.parallel.shard_model`). Boundary states follow the engine's rule: all of a rank's if they take at
most an eighth of the GPU, else every k-th with k = ceil(sqrt(chunks per rank)), plus up to k regenerated.
"""

from __future__ import annotations

import math

import torch

from ..engine import EngineConfig, activation_bytes_per_token, boundary_interval
from ..engine.chunks import checkpoint_every
from ..lora import add_lora, check_lora_targets
from ..models.config import with_rope_scaling
from ..models.registry import build, build_model, config_from_hf
from .state_size import state_size

def _proxies(hf_config: dict) -> list[tuple[int, dict, bool]]:
    """(how many layers, a config of one such layer, whether the last layer is one) for each distinct layer kind;
    small vocab, MoE cut to the experts a token uses (what a token's activations depend on)."""
    cfg = dict(hf_config.get("text_config") or hf_config) if hf_config["model_type"] == "qwen3_5" else dict(hf_config)
    cfg.update(vocab_size=256, tie_word_embeddings=False)
    model_cfg = config_from_hf(hf_config)
    if hf_config["model_type"] in ("qwen3_5", "qwen3_5_text"):
        cfg["model_type"] = "qwen3_5_text"
        kinds, key = model_cfg.layer_types, "layer_types"
    elif hf_config["model_type"] == "glm_moe_dsa":
        cfg.update(n_routed_experts=cfg["num_experts_per_tok"], n_group=1, topk_group=1)
        kinds, key = model_cfg.mlp_layer_types, "mlp_layer_types"
    else:
        return [(model_cfg.num_hidden_layers, cfg, True)]
    return [(kinds.count(k), {**cfg, key: [k]}, k == kinds[-1]) for k in dict.fromkeys(kinds)]


def _layers(cfg: dict, n: int) -> dict:
    """`cfg` with n layers of its one kind."""
    out = {**cfg, "num_hidden_layers": n}
    for key in ("layer_types", "mlp_layer_types"):
        if key in cfg:
            out[key] = cfg[key] * n
    if cfg["model_type"] == "glm_moe_dsa":
        out["indexer_types"] = ["full"] * n
    return out


def measured_activation_bytes(hf_config: dict, lora: dict | None = None) -> int:
    """Autograd-saved bytes per prompt token of the whole model (bf16), from proxies of one and two layers of each
    kind: a prompt chunk's last layer only emits its state, so a layer costs what the second one adds. With `lora`
    (add_lora's arguments) the proxies carry the adapters and frozen weights, which save less (no input is kept
    for a frozen weight's gradient)."""
    def probe(cfg: dict) -> int:
        torch.manual_seed(0)
        model = build_model(cfg, dtype=torch.bfloat16)
        names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        present = [t for t in (lora or {}).get("target_modules", []) if any(n.endswith("." + t) for n in names)]
        if present:  # a proxy of one layer kind has only that kind's modules
            add_lora(model, r=lora["r"], target_modules=present)
        elif lora is not None:
            model.requires_grad_(False)
        return activation_bytes_per_token(model)

    total = 0
    for count, cfg, has_last in _proxies(hf_config):
        one = probe(_layers(cfg, 1))
        layer = probe(_layers(cfg, 2)) - one
        total += (count - 1) * layer + one if has_last else count * layer
    return total


def adapter_parameters(hf_config: dict, r: int, target_modules: list[str]) -> int:
    """Parameters of LoRA adapters of rank r on the named linear modules: r x (in + out) each."""
    with torch.device("meta"):
        model = build(hf_config)
    check_lora_targets(model, target_modules)
    return sum(r * (m.in_features + m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and any(n == t or n.endswith("." + t) for t in target_modules))


def plan(hf_config: dict, tokens: int, gpus: int, gpu_mem_gb: float, *, zero: int = 1, sp: int | None = None,
         chunk: int = 2048, responses: int = 8, response_tokens: int = 1024, activation_bytes: int | None = None,
         lora: dict | None = None, rope_scaling: dict | None = None) -> dict:
    """Per-rank bytes of exact and detached mode on `gpus` ranks in groups of `sp` (default: all of them). With
    `lora` ({r, target_modules}), the adapters' count replaces the parameters in the gradients and the optimizer
    (fp32 adapters: weights, gradients and two moments, 16 bytes each), and the base weights are frozen bf16.
    `rope_scaling` (as `load_model`'s) extends the model's positions; `positions_accepted` says whether capture
    takes prompt + response (`*_fits` count the memory only)."""
    hf_config = with_rope_scaling(hf_config, rope_scaling)
    c = sp or gpus
    if gpus % c or c < 1:
        raise ValueError(f"--sp {c} must divide --gpus {gpus}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero {zero}: ZeRO stages are 0, 1, 2, 3")
    with torch.device("meta"):
        meta = build(hf_config)
    params = sum(p.numel() for p in meta.parameters())
    size = state_size(hf_config, tokens, "bf16", chunk)
    act = measured_activation_bytes(hf_config, _lora_args(lora)) if activation_bytes is None else activation_bytes
    n = gpus
    weights = 2 * params / (n if zero >= 3 else 1)
    grads = 2 * params / (n if zero >= 2 else 1)
    optim = 12 * params / (n if zero >= 1 else 1)
    adapters = 0
    if lora is not None:
        adapters = adapter_parameters(hf_config, lora["r"], lora["target_modules"])
        weights += 4 * adapters
        grads = 4 * adapters / (n if zero >= 2 else 1)
        optim = 8 * adapters / (n if zero >= 1 else 1)
    rows = size["bytes_per_token"] * tokens / c
    state = rows + size["fixed_bytes"]
    dstate = (size["bytes_per_token"] - size["bytes_per_token_nograd"]) * tokens / c + size["fixed_bytes"]
    budget = gpu_mem_gb * 1e9
    mine = math.ceil(size["prompt_chunks"] / c)  # each rank keeps the boundaries of its own chunks
    every = boundary_interval(EngineConfig(prompt_chunk=chunk), mine, size["fixed_bytes"], int(budget))
    boundaries = size["fixed_bytes"] * (math.ceil(mine / every) + (every if every > 1 else 0))
    chunk_act = act * chunk / c  # a rank runs its block of each chunk only
    # ZeRO-3's layer-major prompt backward (engine/prompt_by_layer.py), when it fits a quarter of the GPU (its
    # `auto` rule): layers / k + k hidden states of the rank's tokens, one group's fixed-size states per chunk
    layers = meta.config.num_hidden_layers
    k = checkpoint_every(layers)
    checkpoints = (-(-layers // k) + k) * tokens / c * meta.config.hidden_size * 2 + \
        size["fixed_bytes"] * k / layers * (size["prompt_chunks"] + 1)
    by_layer = checkpoints if zero == 3 and checkpoints <= budget / 4 else 0.0
    branches = max(1, responses // (gpus // c))
    branch_act = act * response_tokens  # one branch at a time (branch_batch 1)
    common = weights + grads + optim + state
    exact = common + dstate + boundaries + by_layer + max(chunk_act, branch_act)
    detached = common + branch_act  # its capture runs without autograd
    return {
        "model_type": size["model_type"], "parameters": params, "adapter_parameters": adapters, "tokens": tokens,
        "gpus": gpus, "sp": c,
        "dp": gpus // c, "zero": zero, "chunk": chunk, "boundary_every": every, "branches_per_group": branches,
        "activation_bytes_per_token": act, "gpu_bytes": budget,
        "per_rank": {"parameters": weights, "gradients": grads, "optimizer": optim, "state shard": state,
                     "dState shard": dstate, "boundary states": boundaries, "layer-major checkpoints": by_layer,
                     "one chunk's activations": chunk_act,
                     "one branch's activations": branch_act},
        "prompt_order": "layers" if by_layer else "chunks", "layer_major_bytes": checkpoints,
        "exact_bytes": exact, "detached_bytes": detached, "exact_fits": exact <= budget,
        "detached_fits": detached <= budget, **_positions(meta.config, tokens + response_tokens),
    }


def _positions(model_cfg, positions: int) -> dict:
    """Prompt + response positions against what the model accepts (the engine's check)."""
    ok = positions <= model_cfg.max_positions
    return {"positions": positions, "max_positions": model_cfg.max_positions, "positions_accepted": ok,
            "rope_scaling_needed": None if ok else model_cfg.scaling_for(positions)}


def smallest_fit(hf_config: dict, tokens: int, gpu_mem_gb: float, mode: str, **kw) -> int | None:
    """The fewest GPUs (all in one sequence-parallel group) on which `mode` fits, up to 4096."""
    act = kw.pop("activation_bytes", None) or measured_activation_bytes(hf_config, _lora_args(kw.get("lora")))
    for n in [2**i for i in range(13)]:
        if plan(hf_config, tokens, n, gpu_mem_gb, activation_bytes=act, **kw)[f"{mode}_fits"]:
            return n
    return None


def _lora_args(lora: dict | None) -> dict | None:
    return None if lora is None else {"r": lora["r"], "target_modules": lora["target_modules"]}


def format_plan(r: dict, fit_exact: int | None, fit_detached: int | None) -> str:
    gb = lambda b: f"{b / 1e9:10.2f} GB"  # noqa: E731
    lines = [f"{r['model_type']}: {r['parameters'] / 1e9:.2f}B parameters, {r['tokens']:,} tokens, {r['gpus']} GPUs "
             f"x {r['gpu_bytes'] / 1e9:.0f} GB, sequence-parallel groups of {r['sp']} (x{r['dp']}), ZeRO-{r['zero']}, "
             f"chunk {r['chunk']:,}" + (f", LoRA: {r['adapter_parameters'] / 1e6:,.1f}M adapter parameters"
                                        if r["adapter_parameters"] else ""), f"activations {r['activation_bytes_per_token'] / 1e3:,.1f} KB per token "
             "(measured on one- and two-layer proxies)", "per rank:"]
    for name, b in r["per_rank"].items():
        lines.append(f"  {name:<26}{gb(b)}")
    ok = r.get("positions_accepted", True)
    if "positions" in r:
        lines.append(f"positions: {r['positions']:,} (prompt + response) " + (
            f"<= {r['max_positions']:,} accepted" if ok else f"> {r['max_positions']:,} accepted: capture would "
            f"refuse this prompt; add --rope-scaling {r['rope_scaling_needed']}"))
    for mode in ("exact", "detached"):
        verdict = ("fits" if ok else "capture would refuse the prompt (positions), though it fits in memory") \
            if r[f"{mode}_fits"] else "does NOT fit"
        lines.append(f"{mode:<9} mode: {gb(r[f'{mode}_bytes'])} per rank: {verdict}")
    for mode, n in (("exact", fit_exact), ("detached", fit_detached)):
        lines.append(f"smallest N for {mode}: {n if n else 'more than 4096'} GPUs (ZeRO-{r['zero']}, one group)")
    if r["boundary_every"] > 1:
        lines.append(f"boundary states: those of 1 in {r['boundary_every']} chunks kept, the others regenerated "
                     "(one more no-grad prompt forward)")
    if r["zero"] == 3:
        lines.append(f"prompt order: {r['prompt_order']} (layer by layer each layer is gathered once per pass, for "
                     f"{r['layer_major_bytes'] / 1e9:,.2f} GB of checkpoints; auto takes it when they fit a quarter "
                     "of the GPU)")
    return "\n".join(lines)
