"""`grpo_backward`: the GRPO gradient of one group (prompt + G responses) in one of three modes.

naive    every branch forwards prompt+response with autograd (the reference; G x the prompt work)
detached capture once, replay branches with autograd; no gradient reaches the prompt
exact    as detached, plus dLoss/dState summed over branches, back-propagated through the prompt chunk by
         chunk in reverse; equals naive up to rounding

dState (`grad`, one buffer per layer, `PrefixState.grad_buffer()`) is what each layer kind's `leaf()` /
`leaf_grad()` / `segment_grads()` make of it: per-token layers accumulate into it in place over all branches and
later chunks; a fixed-size layer's entry is the gradient of its state at the current chunk boundary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from ..grpo import GRPOConfig, branch_loss, token_weights
from ..memory import free_bytes
from ..models.protocol import PrefixLM
from ..parallel import SequenceParallel, is_sharded
from ..state import LayerState, PrefixState, boundary_states
from .budget import kept_chunk_count
from .capture import capture_checked, check_prompt, empty_state, run_chunk, store_chunk
from .checks import as_advantages, as_responses, check_per_token, check_positions
from .replay import replay_logprobs, token_logprobs

MODES = ("naive", "detached", "exact")
Grad = dict[int, LayerState]  # dState: one buffer per layer
Kept = tuple[dict[int, LayerState], list[LayerState]]  # a chunk's emitted state and the leaves it read


def grpo_backward(
    model: PrefixLM,
    prompt_ids,
    responses: Sequence,
    advantages: Sequence[float] | torch.Tensor,
    *,
    mode: str = "exact",
    old_logprobs: Sequence | None = None,
    ref_logprobs: Sequence | None = None,
    config: GRPOConfig | None = None,
    progress: bool = False,
    parallel: SequenceParallel | None = None,
) -> dict:
    """Accumulate d(GRPO loss)/d(params) into `param.grad` (like `loss.backward()`) and return step stats.

    `old_logprobs=None` is on-policy (ratio 1). `ref_logprobs` is needed when `config.kl_coef > 0`. With
    `parallel`, every rank of the sequence-parallel group passes the same group; the prefix state is sharded over
    the ranks, and afterwards every rank's `param.grad` is the one-process gradient.
    """
    cfg = config or GRPOConfig()
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} unknown; choose one of {MODES}")
    if parallel is not None and mode == "naive":
        raise ValueError("naive mode is the one-process reference and has no state to shard; run it without "
                         "`parallel`")
    mc = model.config
    prompt = check_prompt(model, prompt_ids, parallel)
    resp = as_responses(responses, mc.vocab_size)
    if parallel is not None:
        parallel.check_same(torch.cat([torch.tensor([len(r) for r in resp]), *resp]), "responses")
    check_positions(prompt.numel(), resp, mc.max_position_embeddings)
    adv = as_advantages(advantages, len(resp))
    old = check_per_token(old_logprobs, resp, "old_logprobs")
    ref = check_per_token(ref_logprobs, resp, "ref_logprobs")
    if cfg.kl_coef > 0 and ref is None:
        raise ValueError("config.kl_coef > 0 needs ref_logprobs (log-probs of the responses under the reference model)")
    weights = token_weights([r.numel() for r in resp], cfg)

    totals = {"loss": 0.0, "clipped_tokens": 0.0, "kl_sum": 0.0}
    t0 = time.perf_counter()
    state_bytes = grad_bytes = 0
    mine = range(len(resp)) if parallel is None else parallel.branches(len(resp))
    branch_groups = parallel is not None and parallel.dp_size > 1
    # the groups' parameter gradients are summed at the end (by FSDP itself when it shards them)
    sum_params = branch_groups and not is_sharded(model)
    if sum_params:  # what param.grad held before is every group's alike
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(parallel.dp_size)
    if mode == "naive":
        naive_backward(model, prompt, resp, adv, weights, cfg, old, ref, totals, progress)
    else:
        exact = mode == "exact"
        if exact:
            state, grad, kept = _capture_keeping_graphs(model, prompt, cfg, progress, parallel)
            grad_bytes = sum(g.nbytes for g in grad.values()) + state.boundary_nbytes
        else:
            state = capture_checked(model, prompt, cfg.prompt_chunk, progress, parallel)
            grad, kept = None, {}
        state_bytes = state.nbytes
        pick = lambda xs: None if xs is None else [xs[i] for i in mine]  # noqa: E731
        replay_backward(model, state, pick(resp), adv[list(mine)], pick(weights), cfg, pick(old), pick(ref), grad,
                        totals, progress, mode, parallel)
        if exact:
            if branch_groups:
                sum_over_branch_groups(grad, parallel)
            prompt_backward(model, state, grad, kept, progress, parallel)
        if branch_groups:
            totals = _sum_branch_results(model, totals, parallel, sum_params)

    tokens = sum(r.numel() for r in resp)
    return {
        "mode": mode,
        "loss": totals["loss"],
        "clip_frac": totals["clipped_tokens"] / tokens,
        "kl": totals["kl_sum"] / tokens,
        "tokens": tokens,
        "prompt_tokens": prompt.numel(),
        "state_bytes": state_bytes,
        "peak_state_bytes": state_bytes + grad_bytes,
        "seconds": time.perf_counter() - t0,
    }


def _loss_backward(
    idx: list[int], logps: list[torch.Tensor], adv: torch.Tensor, weights: Sequence[float], cfg: GRPOConfig,
    old: list[torch.Tensor] | None, ref: list[torch.Tensor] | None, totals: dict[str, float],
) -> None:
    loss = 0.0
    for i, lp in zip(idx, logps):
        li, st = branch_loss(lp, float(adv[i]), weights[i], cfg, None if old is None else old[i], None if ref is None else ref[i])
        loss = loss + li
        for key, val in st.items():
            totals[key] += val
    loss.backward()


def naive_backward(
    model: PrefixLM, prompt: torch.Tensor, resp: list[torch.Tensor], adv: torch.Tensor, weights: Sequence[float],
    cfg: GRPOConfig, old: list[torch.Tensor] | None, ref: list[torch.Tensor] | None, totals: dict[str, float],
    progress: bool = False,
) -> None:
    """Every branch forwards prompt + response with autograd (the reference)."""
    device = next(model.parameters()).device
    for i, r in enumerate(tqdm(resp, desc="naive branches", unit="branch", disable=not progress, leave=False)):
        logits = model(torch.cat([prompt, r[:-1]]).to(device)[None], logits_from=prompt.numel() - 1)
        _loss_backward([i], [token_logprobs(logits[0], r.to(device))], adv, weights, cfg, old, ref, totals)


def replay_backward(
    model: PrefixLM, state: PrefixState, resp: list[torch.Tensor], adv: torch.Tensor, weights: Sequence[float],
    cfg: GRPOConfig, old: list[torch.Tensor] | None, ref: list[torch.Tensor] | None, grad: Grad | None,
    totals: dict[str, float], progress: bool = False, mode: str = "exact", parallel: SequenceParallel | None = None,
) -> None:
    """Replay the branches on `state` with autograd and back-propagate their GRPO loss into the parameters.

    With a dState buffer `grad` (exact mode), dLoss/dState of these branches is added into it; without (detached
    mode) the prefix gets no gradient. Only the given branches run: `weights` and `adv` are the whole group's, so
    a group may be split over several calls (or workers) whose buffers add up.
    """
    leaves = None if grad is None else [s.leaf() for s in state.layers]
    with tqdm(total=len(resp), desc=f"{mode} branches", unit="branch", disable=not progress, leave=False) as pbar:
        for b in range(0, len(resp), cfg.branch_batch):
            idx = list(range(b, min(b + cfg.branch_batch, len(resp))))
            logps = replay_logprobs(model, state, [resp[i] for i in idx], grad, leaves, parallel)
            _loss_backward(idx, logps, adv, weights, cfg, old, ref, totals)
            pbar.update(len(idx))
    for i, leaf in enumerate(leaves or []):
        if (g := leaf.leaf_grad()) is not None:
            grad[i].add_(g)


def sum_over_branch_groups(grad: Grad, parallel: SequenceParallel) -> None:
    """dState of all branches, divided by the number of data-parallel groups: each group then runs the same prompt
    backward (in lockstep, as ZeRO-3 and FSDP need), and the sum of their parameter gradients counts it once."""
    for g in grad.values():
        for t in g.tensors():
            parallel.dp_sum_(t).div_(parallel.dp_size)


def _sum_branch_results(model: PrefixLM, totals: dict[str, float], parallel: SequenceParallel,
                        params: bool) -> dict[str, float]:
    """Loss statistics and (with `params`) parameter gradients summed over the data-parallel groups."""
    for p in model.parameters() if params else ():
        if p.grad is not None:
            parallel.dp_sum_(p.grad)
    t = parallel.dp_sum_(torch.tensor(list(totals.values()), dtype=torch.float64, device=parallel.device))
    return dict(zip(totals, t.tolist()))


def stored_prompt_backward(model: PrefixLM, state: PrefixState, grad: Grad, progress: bool = False) -> None:
    """`prompt_backward` for a state captured elsewhere (e.g. loaded from the store): every chunk is recomputed,
    and boundary states are regenerated from the prompt's starting state."""
    if 0 not in state.boundaries:
        p = next(model.parameters())
        state.boundaries[0] = boundary_states(model.empty_state(0, p.dtype, p.device))
    prompt_backward(model, state, grad, {}, progress)


def _capture_keeping_graphs(
    model: PrefixLM, prompt: torch.Tensor, cfg: GRPOConfig, progress: bool, parallel: SequenceParallel | None = None,
) -> tuple[PrefixState, Grad, dict[int, Kept]]:
    """Capture for exact mode: the last chunks that fit `prompt_graph_budget` run with autograd and keep their
    graph (no recompute later); the others run without autograd and are recomputed in `prompt_backward`.
    Boundary states at every `boundary_every`-th chunk start are kept in state.boundaries (each rank keeps those
    of its own chunks)."""
    state = empty_state(model, prompt, cfg.prompt_chunk, parallel)
    grad = state.grad_buffer()
    free = free_bytes(next(model.parameters()).device)
    if parallel is not None:  # every rank must take the same decisions
        free = parallel.agree_min(free)
    budget = free // 4 if cfg.prompt_graph_budget is None else cfg.prompt_graph_budget
    first_kept = len(state.chunks) - kept_chunk_count(model, state.chunks, budget)
    # sharded, each rank keeps the boundaries of its own chunks only
    mine = len(state.chunks) if parallel is None else max(_chunks_per_rank(state, parallel))
    every = state.boundary_every = cfg.boundary_every or boundary_interval(mine, state.fixed_nbytes, free // 8)
    kept: dict[int, Kept] = {}
    for i, (s, e) in enumerate(tqdm(state.chunks, desc="capture", unit="chunk", disable=not progress, leave=False)):
        if i >= first_kept:
            with torch.enable_grad():
                kept[i] = _chunk_with_graph(model, state, i, grad, boundary_states(state.layers), parallel)
            emitted = kept[i][0]
        else:
            if i % every == 0 and state.owns(s):
                state.boundaries[i] = boundary_states(state.layers)
            with torch.no_grad():
                emitted = run_chunk(model, state, s, e, parallel=parallel)
        with torch.no_grad():
            store_chunk(state, s, emitted)
    return state, grad, kept


def sqrt_interval(chunks: int) -> int:
    """ceil(sqrt(chunks)): stored plus regenerated boundaries then stay near 2 sqrt(n) states."""
    return max(1, math.isqrt(max(chunks, 1) - 1) + 1)


def boundary_interval(chunks: int, fixed_bytes: int, budget: int) -> int:
    """Keep every boundary when all fit `budget`; else every sqrt_interval-th, for one extra no-grad forward."""
    return 1 if chunks * fixed_bytes <= budget else sqrt_interval(chunks)


def _ensure_boundary(model: PrefixLM, state: PrefixState, boundaries: dict[int, dict[int, LayerState]], i: int,
                     parallel: SequenceParallel | None = None) -> None:
    """Regenerate the boundary states at the starts of chunks j+1..i into `boundaries` from the nearest one j < i
    there (sharded: on every rank, all running the chunks)."""
    if i in boundaries:
        return
    j = max(b for b in boundaries if b < i)
    with torch.no_grad():
        for c in range(j, i):
            prefix = [boundaries[c].get(k, layer) for k, layer in enumerate(state.layers)]
            emitted = run_chunk(model, state, *state.chunks[c], prefix, parallel=parallel)
            boundaries[c + 1] = {k: b for k, new in emitted.items() if (b := new.row(0).boundary()) is not None}


def _chunk_with_graph(model: PrefixLM, state: PrefixState, i: int, grad: Grad, boundary: dict[int, LayerState],
                      parallel: SequenceParallel | None = None) -> Kept:
    """Chunk i with autograd, reading leaves: its `boundary` states as fresh ones (so each chunk's graph stands
    alone), the per-token rows before it as themselves (their gradient goes into `grad`)."""
    s, e = state.chunks[i]
    leaves = [boundary.get(j, layer).leaf() for j, layer in enumerate(state.layers)]
    return run_chunk(model, state, s, e, leaves, grad, parallel), leaves


def _owner(state: PrefixState, start: int, parallel: SequenceParallel) -> int:
    return next(r for r, (a, b) in enumerate(parallel.ranges(state.length)) if a <= start < b)


def _chunks_per_rank(state: PrefixState, parallel: SequenceParallel) -> list[int]:
    owners = [_owner(state, s, parallel) for s, _ in state.chunks]
    return [owners.count(r) for r in range(parallel.size)]


def _boundary(model: PrefixLM, state: PrefixState, i: int, parallel: SequenceParallel | None,
              shared: dict[int, dict[int, LayerState]]) -> dict[int, LayerState]:
    """The boundary states at chunk i's start: kept or regenerated here; sharded, the ones every rank holds
    (`shared`), or else sent by the owner of the last kept one before it (chunk j = i - i % boundary_every), and
    regenerated from it by all ranks together, which leaves those of chunks j+1..i on every rank."""
    if parallel is None:
        _ensure_boundary(model, state, state.boundaries, i)
        return state.boundaries[i]
    if i not in shared:
        j = i - i % state.boundary_every
        shared[j] = _from_owner(state, j, parallel)
        _ensure_boundary(model, state, shared, i, parallel)
    return shared.pop(i)


def _from_owner(state: PrefixState, j: int, parallel: SequenceParallel) -> dict[int, LayerState]:
    """Chunk j's kept boundary states, broadcast by the rank that owns the chunk."""
    # contiguous on every rank alike (see _row_grads)
    if state.owns(state.chunks[j][0]):
        mine = {k: b.map(torch.Tensor.contiguous) for k, b in state.boundaries.pop(j).items()}
    else:
        mine = {k: b.map(lambda t: t.new_empty(t.shape)) for k, b in boundary_states(state.layers).items()}
    owner = _owner(state, state.chunks[j][0], parallel)
    for b in mine.values():
        for t in b.tensors():
            parallel.broadcast_(t, owner)
    return mine


def prompt_backward(model: PrefixLM, state: PrefixState, grad: Grad, kept: dict[int, Kept],
                    progress: bool = False, parallel: SequenceParallel | None = None) -> None:
    """Back-propagate dLoss/dState through the prompt, last chunk first.

    Chunk i's per-token rows have their final gradient in grad[:, s:e] once all later chunks and all branches
    are done, and a fixed-size layer's grad entry is the gradient of its state after chunk i. The chunk's
    backward adds into the rows before it, into its boundary leaves (whose gradients become the fixed-size
    layers' entries for chunk i-1) and into the parameters. Sharded, every rank runs every chunk: the chunk's
    owner sends its rows' gradients, and each rank's rows before the chunk collect their share.
    """
    shared: dict[int, dict[int, LayerState]] = {}  # sharded: boundaries every rank holds
    for i in tqdm(range(len(state.chunks) - 1, -1, -1), desc="prompt backward", unit="chunk", disable=not progress, leave=False):
        s, e = state.chunks[i]
        if i in kept:
            emitted, leaves = kept.pop(i)
        else:
            boundary = _boundary(model, state, i, parallel, shared)
            with torch.enable_grad():
                emitted, leaves = _chunk_with_graph(model, state, i, grad, boundary, parallel)
        state.boundaries.pop(i, None)  # chunk i is the last to need it
        owner = None if parallel is None else _owner(state, s, parallel)
        outputs, grads = [], []
        for j, new in emitted.items():
            outputs += new.differentiable()
            if new.token_axis is None:  # a fixed-size state: its dState entry is replicated
                grads += grad[j].segment_grads(s, e)
            else:
                grads += _row_grads(state, grad[j], new, s, e, parallel, owner)
        # with frozen weights (LoRA) some outputs have no path to anything trainable (layer 0's K/V of chunk 0)
        live = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        if live:
            torch.autograd.backward(*map(list, zip(*live)))
        for j, leaf in enumerate(leaves):
            if (g := leaf.leaf_grad()) is not None:
                grad[j] = g


def _row_grads(state: PrefixState, g: LayerState, new: LayerState, s: int, e: int,
               parallel: SequenceParallel | None, owner: int | None) -> list[torch.Tensor]:
    """dState rows [s, e) of one layer on every rank: the owner's (rank `owner` of the group), sent to the others."""
    if parallel is None:
        return g.segment_grads(s, e)
    # contiguous on every rank alike, so that the backward takes the same kernels (bitwise equal gradients)
    if state.owns(s):
        rows = [t.contiguous() for t in g.segment_grads(s - state.offset, e - state.offset)]
    else:
        rows = [t.new_empty(t.shape) for t in new.differentiable()]
    for t in rows:
        parallel.broadcast_(t, owner)
    return rows
