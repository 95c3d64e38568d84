"""Work of one exact GRPO step per rank, counted from config.json: FLOPs under the split schedule
(parallel/sequence.py) and under one that repeats the token-local work on every rank, bytes each rank sends,
and a time estimate for a GPU FLOP rate and link speed.

A model of the engine, not a measurement (bench/work_per_rank.py counts the real thing on tiny models):
- token-local work: 2 FLOPs per active parameter per token (MoE: the routed experts' share), no LM head on the
  prompt; the replays' tokens include it;
- attention: 4 x heads x head dim per (query, key) pair, causal over the prompt; MLA absorbed in latent space
  (rank + rope dims for scores, rank for values), DSA over its top-k keys plus its indexer over every pair;
- Gated DeltaNet: the chunked rule's products per token (chunks of 64), and on a split chunk the recurrence run
  with dk more value columns (ops/gated_delta.py: `split_gated_delta_rule`);
- an exact step with every prompt chunk recomputed: capture (1 forward), prompt backward (forward + backward,
  3), replays (3 per token); boundary regeneration left out.
Bytes: what one rank sends per step in the split schedule's collectives (ops/split_attention.py,
ops/split_sparse_attention.py), bf16 activations, fp32 log-sum-exps, gradients, DSA scores and recurrent
summaries, int64 positions, plus the parameter gradients' reduction over the group.
"""

from __future__ import annotations

import math

import torch

from ..models.common.attention import Attention
from ..models.common.deltanet import GatedDeltaNet
from ..models.common.mla import MLAttention
from ..models.common.moe import MoE
from ..models.registry import build
from ..parallel.experts import expert_modules

GDN_CHUNK = 64


def _active_parameters(model: torch.nn.Module) -> tuple[float, float]:
    """(non-embedding parameters a token uses, LM head parameters)."""
    # a token runs through top-k of the routed experts: that share of their weights
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    share = moe[0].gate.top_k / moe[0].gate.experts if moe else 1.0
    body = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or name.startswith("lm_head"):
            continue
        body += p.numel() * (share if ".experts." in name else 1)
    return body, float(model.lm_head.weight.numel())


def _gdn_per_token(m: GatedDeltaNet, widened: bool = False) -> float:
    dv = m.v_dim + (m.k_dim if widened else 0)
    return 2 * m.v_heads * (1.5 * GDN_CHUNK * (m.k_dim + dv) + 3 * m.k_dim * dv)


def _pair_flops(m) -> float:
    """Forward FLOPs of one (query, key) pair of an attention layer."""
    if isinstance(m, Attention):
        return 4 * m.heads * m.head_dim
    return 2 * m.heads * (2 * m.rank + m.rope_dim)


def step_work(hf_config: dict, tokens: int, sp: int, chunk: int, responses: int, response_tokens: int,
              dp: int = 1, zero: int = 0, by_layer: bool = True, expert_parallel: bool = False) -> dict:
    """FLOPs per rank of one exact step (busiest rank, even split, and the busiest of a schedule that repeats the
    token-local work on every rank) and bytes sent per rank, for a sequence-parallel group of `sp` ranks (`dp`
    groups splitting the branches) under ZeRO stage `zero`, the prompt walked layer by layer or not (`by_layer`,
    ZeRO-3's choice when its checkpoints fit: `plan`'s "prompt_order"). With `expert_parallel` the gathers leave
    the experts out, and each MoE layer's tokens travel to their experts and back (all-to-all)."""
    with torch.device("meta"):
        model = build(hf_config)
    body, head = _active_parameters(model)
    mixers = [layer.mixer for layer in model.model.layers]
    p, c = float(tokens), sp
    branches = responses / dp
    token = 2 * body * p
    attn = gdn = gdn_split = 0.0
    replay = 2 * (body + head) * branches * response_tokens
    sent = 0.0
    blocks = p / c  # a rank's tokens over the whole prompt
    for m in mixers:
        if isinstance(m, GatedDeltaNet):
            gdn += _gdn_per_token(m) * p
            gdn_split += _gdn_per_token(m, widened=True) * p
            replay += _gdn_per_token(m) * branches * response_tokens
            # per chunk, forward twice (capture, recompute) and backward once: the blocks' summaries
            sent += 3 * (p / chunk) * (c - 1) * m.v_heads * m.k_dim * (m.k_dim + m.v_dim) * 4
            continue
        pairs = p * p / 2
        if isinstance(m, MLAttention) and m.index_topk < p:
            if (idx := getattr(m, "indexer", None)) is not None:  # layers without one reuse the last selection
                attn += 2 * idx.heads * idx.head_dim * pairs  # the indexer scores every pair
            pairs = p * m.index_topk
        attn += _pair_flops(m) * pairs
        replay += _pair_flops(m) * branches * response_tokens * min(p, getattr(m, "index_topk", p))
        if isinstance(m, Attention):
            q, kv = m.heads * m.head_dim * 2, 2 * m.kv_heads * m.head_dim * 2
            # per forward: K/V and queries gathered, partial outputs (+ lse) exchanged; backward: (do, o, lse)
            # gathered, dq and the earlier blocks' dK/dV sent back
            forward = (c - 1) * blocks * (kv + q + q + 4 * m.heads)
            backward = (c - 1) * blocks * (2 * q + 4 * m.heads + q + kv)
            sent += 2 * forward + backward
        elif m.index_topk >= p:  # MLA, dense: split_chunk_attention over the shared latent head
            q, kv = m.heads * (m.rank + m.rope_dim) * 2, (m.rank + m.rope_dim) * 2
            forward = (c - 1) * blocks * (kv + q + m.heads * m.rank * 2 + 4 * m.heads)
            backward = (c - 1) * blocks * (m.heads * m.rank * 4 + q + 4 * m.heads + q + kv)
            sent += 2 * forward + backward
        else:  # MLA + DSA (ops/split_sparse_attention.py): the queries travel to the rows
            idx, k = getattr(m, "indexer", None), m.index_topk
            q = m.heads * (m.rank + m.rope_dim)
            # indexer queries gathered, every rank's candidates to the owners, thresholds gathered (layers with
            # their own indexer); queries gathered and partial outputs back (forward); (do, lse, delta) gathered
            # and dq back (backward)
            select = 0.0 if idx is None else (c - 1) * blocks * (idx.heads * (idx.head_dim + 1) * 4 + 12 * k + 12)
            forward = select + (c - 1) * blocks * (2 * q + m.heads * (2 * m.rank + 4))
            backward = (c - 1) * blocks * (m.heads * (2 * m.rank + 8) + 4 * q)
            sent += 2 * forward + backward
    per_step = 4 * (token + attn + gdn)  # capture + recompute + backward = 4 forward units
    even = (per_step + 3 * replay) / c
    share = math.ceil(branches / c) / branches  # each rank replays its share, padded with fillers
    busiest = 4 * (token + attn + gdn_split) / c + 3 * replay * share
    replicated = 4 * (token + gdn) + 4 * attn * (2 * c - 1) / (c * c) + 3 * replay  # contiguous ranges: rank 0
    params = sum(t.numel() for t in model.parameters())
    grad_bytes = 2 * (c - 1) / c * 4 * params if c > 1 else 0.0
    gathers = _weight_gathers(zero, tokens, chunk, math.ceil(branches / c), by_layer)
    n = c * dp
    experts = sum(t.numel() for e in expert_modules(model) for t in e.parameters()) if expert_parallel else 0
    gather_bytes = gathers * (n - 1) / n * 2 * (params - experts)  # bf16 weights over a ring of all N ranks
    routed = _routed_bytes(model, p / c, math.ceil(branches / c) * response_tokens, n) if expert_parallel else 0.0
    return {"flops_one_rank": per_step + 3 * replay, "flops_even": even, "flops_busiest": busiest,
            "flops_replicated_busiest": replicated, "balance": busiest / even,
            "sent_bytes": sent + grad_bytes + gather_bytes + routed, "sent_bytes_gradients": grad_bytes,
            "sent_bytes_weight_gathers": gather_bytes, "sent_bytes_all_to_all": routed, "weight_gathers": gathers}


def _routed_bytes(model, prompt_tokens: float, branch_tokens: float, ranks: int) -> float:
    """Bytes a rank sends in the MoE layers' all-to-alls of one step (expert parallelism, bf16): each (token,
    expert) row to its expert's rank and its output back, (N - 1) / N of them elsewhere; the prompt's tokens in
    capture, the recompute and the backward (which sends both ways again), the replayed tokens forward and back."""
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    if not moe:
        return 0.0
    row = moe[0].gate.top_k * model.config.hidden_size * 2 * (ranks - 1) / ranks
    return len(moe) * 2 * row * (4 * prompt_tokens + 3 * branch_tokens)


def _weight_gathers(zero: int, tokens: int, chunk: int, branches: float, by_layer: bool) -> float:
    """Whole-model all-gathers per step under ZeRO `zero` (FSDP: 2 keeps a layer gathered from its forward to its
    backward, 3 gathers it for each use), replaying one branch at a time. ZeRO-3 layer by layer
    (engine/prompt_by_layer.py): capture 1, the prompt backward 3 (a forward to the checkpoints, the groups'
    recompute, the backward), each branch 2; chunk by chunk: capture 1 per chunk, the prompt backward 2 per chunk.
    ZeRO-2: one per chunk and per branch."""
    if zero < 2:
        return 0.0
    chunks = math.ceil(tokens / chunk)
    if zero == 2:
        return 1 + chunks + branches
    return (1 + 3 if by_layer else 3 * chunks) + 2 * branches


def step_time(work: dict, tflops: float, link_gbps: float) -> dict:
    """Seconds of the busiest rank's compute at `tflops` TFLOP/s, and of its sends at `link_gbps` GB/s (the sum
    is the bound without overlap)."""
    _check(tflops, "--tflops")
    _check(link_gbps, "--link-gbps")
    compute = work["flops_busiest"] / (tflops * 1e12)
    comm = work["sent_bytes"] / (link_gbps * 1e9)
    return {"compute_s": compute, "communication_s": comm, "step_s": compute + comm,
            "replicated_compute_s": work["flops_replicated_busiest"] / (tflops * 1e12)}


def format_work(work: dict, time: dict, tflops: float, link_gbps: float) -> str:
    tf = lambda f: f"{f / 1e15:,.1f} PFLOP"  # noqa: E731
    return "\n".join([
        f"work of one exact step (split schedule): busiest rank {tf(work['flops_busiest'])}, an even split "
        f"{tf(work['flops_even'])} ({work['balance']:.2f}x), one rank alone {tf(work['flops_one_rank'])}; "
        f"every rank repeating the token-local work: {tf(work['flops_replicated_busiest'])}",
        f"sent per rank: {work['sent_bytes'] / 1e9:,.1f} GB (of it {work['sent_bytes_gradients'] / 1e9:,.1f} GB "
        f"the gradients' reduction, {work['sent_bytes_weight_gathers'] / 1e9:,.1f} GB ZeRO's "
        f"{work['weight_gathers']:,.0f} weight all-gathers of the model" +
        (f" but its experts, {work['sent_bytes_all_to_all'] / 1e9:,.1f} GB the experts' all-to-alls)"
         if work.get("sent_bytes_all_to_all") else ")"),
        f"time per step at {tflops:g} TFLOP/s and {link_gbps:g} GB/s per GPU: {time['compute_s']:,.0f} s compute + "
        f"{time['communication_s']:,.0f} s communication = {time['step_s'] / 60:,.1f} min without overlap "
        f"(repeating the token-local work: {time['replicated_compute_s'] / 60:,.1f} min of compute)",
    ])


def _check(value: float, name: str) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value}")
