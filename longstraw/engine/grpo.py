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
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from ..grpo import GRPOConfig
from ..models.protocol import PrefixLM
from ..parallel import ONE_RANK, SequenceGroup
from ..segment import Segment
from .branches import Branches
from .capture import capture, new_dstate
from .checks import check_positions
from .chunks import check_prompt
from .config import EngineConfig, check_engine
from .gradients import gradients_summed_over_dp
from .policy import Plan, plan_group
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
    masks: Sequence | None = None,
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
    length limit) by `config.mask_truncated_completions`. `masks` (one bool per token of each response, True where
    the model wrote it; None: all): a multi-turn branch's tool output is attended to but weighs 0 in the loss and
    counts in no statistic (the sampler's log-probs may be NaN there). On a sequence-parallel group every rank
    passes the same group; the prefix state is sharded over the ranks, and afterwards every rank's `param.grad` is
    the one-process gradient.

    `routing` (MoE routing replay, engine/routing.py): the branches' tokens go to the experts it gives each (and
    naive mode's prompt tokens to the prompt's); exact and detached mode record the prompt's routing at capture, or
    take the one given, and the prompt backward routes as capture did.
    """
    loss, engine = config or GRPOConfig(), check_engine(engine or EngineConfig(), "grpo_backward")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} unknown; choose one of {MODES}")
    if mode == "naive" and parallel.size * parallel.dp_size > 1:
        raise ValueError("naive mode is the one-process reference and has no state to shard; run it on one rank")
    prompt = check_prompt(model, prompt_ids, parallel)
    exact = mode == "exact"
    # naive mode has no state to plan for, and its forwards are never checkpointed
    plan = plan_group(model, engine, prompt.numel(), parallel=parallel, exact=exact, grad=mode != "naive")
    parallel.check_agree("grpo_backward settings", {"mode": mode, **loss.model_dump(), **plan.decisions()})
    branches = Branches.group(responses, advantages, loss, vocab_size=model.config.vocab_size,
                              old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                              sampler_logprobs=sampler_logprobs, truncated=truncated, masks=masks)
    parallel.check_same(torch.cat([torch.tensor([len(r) for r in branches.tokens]), *branches.tokens]), "responses")
    check_positions(prompt.numel(), branches.tokens, model.config)
    if routing is not None:
        routing = check_replay(model, routing, prompt.numel() - 1, branches.tokens)
        branches = replace(branches, routing=None if routing.branches is None else list(routing.branches))

    t0 = time.perf_counter()
    state_bytes = grad_bytes = 0
    prompt_routing = None if routing is None else routing.prompt
    if mode == "naive":
        branches = with_entropy_weights(branches, loss, lambda: naive_entropies(
            model, prompt, branches, plan=plan, prompt_routing=prompt_routing))
        totals = naive_backward(model, prompt, branches, loss, progress, plan=plan, prompt_routing=prompt_routing)
    else:
        with gradients_summed_over_dp(model, parallel):
            state = capture(model, prompt, engine, plan=plan, parallel=parallel, exact=exact, progress=progress,
                            record_routing=routing is not None, routing=prompt_routing)
            branches = with_entropy_weights(branches, loss, lambda: group_entropies(
                model, state, branches, engine=engine, parallel=parallel))
            dstate = new_dstate(state) if exact else None
            state_bytes = state.nbytes
            if exact:
                grad_bytes = sum(g.nbytes for g in dstate.values()) + state.boundary_nbytes
            totals = replay(model, state, branches.select(parallel.branches(len(branches))), loss, dstate,
                            engine=engine, plan=plan, parallel=parallel, progress=progress)
            if exact:
                plan = prompt_backward(model, state, dstate, engine=engine, plan=plan, parallel=parallel,
                                       progress=progress)

    tokens = branches.token_count
    counted = max(branches.model_token_count, 1)  # the statistics' tokens: the model's
    sampled = max(totals["sampler_tokens"], 1.0)
    return {
        "mode": mode,
        "loss": totals["loss"],
        "clip_frac": totals["clipped_tokens"] / counted,
        "kl": totals["kl_sum"] / counted,
        "entropy": totals["entropy_sum"] / counted,
        "entropy_kept_frac": totals["entropy_kept_tokens"] / counted,
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
        "plan": plan.params(),
    }


def naive_backward(model: PrefixLM, prompt: torch.Tensor, branches: Branches, loss: GRPOConfig,
                   progress: bool = False, *, engine: EngineConfig = EngineConfig(), plan: Plan | None = None,
                   prompt_routing: dict[int, torch.Tensor] | None = None) -> dict[str, float]:
    """Every branch forwards prompt + response with autograd (the reference); returns the loss statistics. The
    LM head runs over the response's positions only, `plan.head_chunk` tokens at a time (`plan`: naive mode's,
    `naive_plan`; resolved from `engine` if not given). MoE routing replay: `prompt_routing` (prompt[:-1]'s) and
    `branches.routing` route the tokens."""
    plan = plan or naive_plan(model, engine, prompt)
    totals = new_totals()
    entropy = "grad" if loss.entropy_coef > 0.0 else True
    for i, logp, ent in _naive_branches(model, prompt, branches, plan, prompt_routing, entropy, progress):
        loss_backward(branches.select([i]), [logp[0]], loss, totals, [ent[0]])
    return totals


@torch.no_grad()
def naive_entropies(model: PrefixLM, prompt: torch.Tensor, branches: Branches, *,
                    engine: EngineConfig = EngineConfig(), plan: Plan | None = None,
                    prompt_routing: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Each branch's per-token entropies from a full forward of prompt + response, routed as its loss will be
    (naive mode's pre-pass for the entropy options). `plan`: as `naive_backward`'s."""
    plan = plan or naive_plan(model, engine, prompt)
    return [ent[0] for _, _, ent in _naive_branches(model, prompt, branches, plan, prompt_routing, True)]


def naive_plan(model: PrefixLM, engine: EngineConfig, prompt: torch.Tensor) -> Plan:
    """Naive mode's plan: no state to plan for, and its forwards are never checkpointed (one process)."""
    return plan_group(model, check_engine(engine, "naive mode"), prompt.numel(), exact=False, grad=False)


def _naive_branches(model: PrefixLM, prompt: torch.Tensor, branches: Branches, plan: Plan,
                    prompt_routing: dict[int, torch.Tensor] | None, entropy: bool | str, progress: bool = False
                    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Branch by branch: (i, log-probs [1, R_i], entropies [1, R_i]) of a full forward of prompt + response i
    (the model's autograd as the caller's mode), the LM head over the response's positions only."""
    device = next(model.parameters()).device
    head_chunk = plan.head_chunk
    for i in tqdm(range(len(branches)), desc="naive branches", unit="branch", disable=not progress, leave=False):
        r = branches.tokens[i].to(device)
        seg = Segment(routing=joined(prompt_routing, None if branches.routing is None else branches.routing[i],
                                     prompt.numel() - 1, r.numel(), device))
        logp, ent = model.token_logprobs(torch.cat([prompt.to(device), r[:-1]])[None], r[None], seg,
                                         logits_from=prompt.numel() - 1, head_chunk=head_chunk, entropy=entropy)
        yield i, logp, ent
