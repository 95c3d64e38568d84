"""`grpo_backward`: the GRPO gradient of one group (prompt + G responses) in one of three modes.

naive    every branch forwards prompt+response with autograd (the reference; G x the prompt work)
detached capture once, replay branches with autograd; no gradient reaches the prompt
exact    as detached, plus dLoss/dState summed over branches, back-propagated through the prompt chunk by
         chunk in reverse; equals naive up to rounding

`grpo_backward` is the engine's four steps in a row, as the training pipeline runs them one op at a time:
`capture` -> `new_dstate` -> `replay` -> `prompt_backward`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from ..grpo import GRPOConfig
from ..models.protocol import PrefixLM
from ..parallel import ONE_RANK, SequenceGroup, is_sharded
from ..state import Segment
from .branches import Branches
from .capture import capture, new_dstate
from .checks import check_positions
from .chunks import check_prompt
from .config import EngineConfig
from .prompt import prompt_backward
from .routing import Routing, check_replay, joined
from .entropy import with_entropy_weights
from .replay import group_entropies, loss_backward, new_totals, replay

MODES = ("naive", "detached", "exact")


def grpo_backward(
    model: PrefixLM,
    prompt_ids,
    responses: Sequence,
    advantages: Sequence[float] | torch.Tensor,
    *,
    mode: str = "exact",
    old_logprobs: Sequence | None = None,
    ref_logprobs: Sequence | None = None,
    sampler_logprobs: Sequence | None = None,
    truncated: Sequence[bool] | None = None,
    routing: Routing | None = None,
    config: GRPOConfig | None = None,
    engine: EngineConfig | None = None,
    parallel: SequenceGroup = ONE_RANK,
    progress: bool = False,
) -> dict:
    """Accumulate d(GRPO loss)/d(params) into `param.grad` (like `loss.backward()`) and return step stats.

    `old_logprobs=None` is on-policy (ratio 1). `ref_logprobs` is needed when `config.kl_coef > 0`,
    `sampler_logprobs` (each token's log-prob under the distribution the sampler drew it from) by
    `config.rollout_correction` (and used by the off-policy mask), `truncated` (one bool per response: it hit the
    length limit) by `config.mask_truncated_completions`. On a sequence-parallel group every rank passes the same
    group; the prefix state is sharded over the ranks, and afterwards every rank's `param.grad` is the one-process
    gradient.

    `routing` (MoE routing replay, engine/routing.py): the branches' tokens go to the experts it gives each (and
    naive mode's prompt tokens to the prompt's); exact and detached mode record the prompt's routing at capture, or
    take the one given, and the prompt backward routes as capture did.
    """
    loss, engine = config or GRPOConfig(), engine or EngineConfig()
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} unknown; choose one of {MODES}")
    if mode == "naive" and parallel.size * parallel.dp_size > 1:
        raise ValueError("naive mode is the one-process reference and has no state to shard; run it on one rank")
    parallel.check_agree("grpo_backward settings", {"mode": mode, **loss.model_dump(), **engine.model_dump()})
    prompt = check_prompt(model, prompt_ids, parallel)
    branches = Branches.group(responses, advantages, loss, vocab_size=model.config.vocab_size,
                              old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                              sampler_logprobs=sampler_logprobs, truncated=truncated)
    parallel.check_same(torch.cat([torch.tensor([len(r) for r in branches.tokens]), *branches.tokens]), "responses")
    check_positions(prompt.numel(), branches.tokens, model.config)
    if routing is not None:
        routing = check_replay(model, routing, prompt.numel() - 1, branches.tokens)
        branches = replace(branches, routing=None if routing.branches is None else list(routing.branches))

    t0 = time.perf_counter()
    state_bytes = grad_bytes = 0
    summed_here = _share_earlier_gradients(model, parallel)
    if mode == "naive":
        branches = with_entropy_weights(branches, loss, lambda: naive_entropies(
            model, prompt, branches, engine.head_chunk, None if routing is None else routing.prompt))
        totals = naive_backward(model, prompt, branches, loss, progress, head_chunk=engine.head_chunk,
                                prompt_routing=None if routing is None else routing.prompt)
    else:
        exact = mode == "exact"
        state = capture(model, prompt, engine, parallel=parallel, exact=exact, progress=progress,
                        record_routing=routing is not None, routing=None if routing is None else routing.prompt)
        branches = with_entropy_weights(branches, loss, lambda: group_entropies(
            model, state, branches, engine.branch_batch, parallel=parallel, head_chunk=engine.head_chunk))
        dstate = new_dstate(state) if exact else None
        state_bytes = state.nbytes
        if exact:
            grad_bytes = sum(g.nbytes for g in dstate.values()) + state.boundary_nbytes
        totals = replay(model, state, branches.select(parallel.branches(len(branches))), loss, dstate, engine=engine,
                        parallel=parallel, progress=progress)
        if exact:
            prompt_backward(model, state, dstate, parallel=parallel, order=engine.prompt_order,
                            checkpoint_layers=engine.checkpoint_layers, progress=progress)
        if summed_here:
            reduce_gradients(model, parallel)

    tokens = branches.token_count
    sampled = max(totals["sampler_tokens"], 1.0)
    return {
        "mode": mode,
        "loss": totals["loss"],
        "clip_frac": totals["clipped_tokens"] / tokens,
        "kl": totals["kl_sum"] / tokens,
        "entropy": totals["entropy_sum"] / tokens,
        "entropy_kept_frac": totals["entropy_kept_tokens"] / tokens,
        "off_policy_masked": totals["off_policy_masked"],
        "sampler_logp_diff_mean": totals["mismatch_abs_sum"] / sampled,
        "sampler_logp_diff_max": totals["mismatch_abs_max"],
        "sampler_kl": totals["mismatch_kl_sum"] / sampled,
        "correction_weight_mean": totals["correction_weight_sum"] / sampled,
        "tokens": tokens,
        "prompt_tokens": prompt.numel(),
        "state_bytes": state_bytes,
        "peak_state_bytes": state_bytes + grad_bytes,
        "seconds": time.perf_counter() - t0,
    }


def naive_backward(model: PrefixLM, prompt: torch.Tensor, branches: Branches, loss: GRPOConfig,
                   progress: bool = False, *, head_chunk: int | None = None,
                   prompt_routing: dict[int, torch.Tensor] | None = None) -> dict[str, float]:
    """Every branch forwards prompt + response with autograd (the reference); returns the loss statistics. The
    LM head runs over the response's positions only, `head_chunk` tokens at a time (`EngineConfig.head_chunk`).
    MoE routing replay: `prompt_routing` (prompt[:-1]'s) and `branches.routing` route the tokens."""
    device = next(model.parameters()).device
    totals = new_totals()
    entropy = "grad" if loss.entropy_coef > 0.0 else True
    for i in tqdm(range(len(branches)), desc="naive branches", unit="branch", disable=not progress, leave=False):
        r = branches.tokens[i].to(device)
        seg = Segment(routing=joined(prompt_routing, None if branches.routing is None else branches.routing[i],
                                     prompt.numel() - 1, r.numel(), device))
        logp, ent = model.token_logprobs(torch.cat([prompt.to(device), r[:-1]])[None], r[None], seg,
                                         logits_from=prompt.numel() - 1, head_chunk=head_chunk, entropy=entropy)
        loss_backward(branches.select([i]), [logp[0]], loss, totals, [ent[0]])
    return totals


@torch.no_grad()
def naive_entropies(model: PrefixLM, prompt: torch.Tensor, branches: Branches, head_chunk: int | None = None,
                    prompt_routing: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Each branch's per-token entropies from a full forward of prompt + response, routed as its loss will be
    (naive mode's pre-pass for the entropy options)."""
    device = next(model.parameters()).device
    out = []
    for i, r in enumerate(branches.tokens):
        r = r.to(device)
        seg = Segment(routing=joined(prompt_routing, None if branches.routing is None else branches.routing[i],
                                     prompt.numel() - 1, r.numel(), device))
        _, ent = model.token_logprobs(torch.cat([prompt.to(device), r[:-1]])[None], r[None], seg,
                                      logits_from=prompt.numel() - 1, head_chunk=head_chunk, entropy=True)
        out.append(ent[0])
    return out


def reduce_gradients(model: PrefixLM, parallel: SequenceGroup) -> None:
    """Sum the parameter gradients over the data-parallel groups (each replayed its own branches). FSDP does it
    itself while it reduce-scatters, and one group has nothing to sum."""
    if is_sharded(model) or parallel.dp_size == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            parallel.dp_sum_(p.grad)


def _share_earlier_gradients(model: PrefixLM, parallel: SequenceGroup) -> bool:
    """Whether this step's gradients get summed over the data-parallel groups here (not by FSDP); if so, what
    `param.grad` held before is every group's alike, and is divided by the group count first so the sum counts it
    once."""
    if is_sharded(model) or parallel.dp_size == 1:
        return False
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(parallel.dp_size)
    return True
