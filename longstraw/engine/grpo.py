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

import torch
from tqdm.auto import tqdm

from ..grpo import GRPOConfig
from ..models.protocol import PrefixLM
from ..parallel import ONE_RANK, SequenceGroup, is_sharded
from .branches import Branches
from .capture import capture, new_dstate
from .checks import check_positions
from .chunks import check_prompt
from .config import EngineConfig
from .prompt import prompt_backward
from .replay import LOSS_TOTALS, loss_backward, replay

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
    config: GRPOConfig | None = None,
    engine: EngineConfig | None = None,
    parallel: SequenceGroup = ONE_RANK,
    progress: bool = False,
) -> dict:
    """Accumulate d(GRPO loss)/d(params) into `param.grad` (like `loss.backward()`) and return step stats.

    `old_logprobs=None` is on-policy (ratio 1). `ref_logprobs` is needed when `config.kl_coef > 0`. On a
    sequence-parallel group every rank passes the same group; the prefix state is sharded over the ranks, and
    afterwards every rank's `param.grad` is the one-process gradient.
    """
    loss, engine = config or GRPOConfig(), engine or EngineConfig()
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} unknown; choose one of {MODES}")
    if mode == "naive" and parallel.size * parallel.dp_size > 1:
        raise ValueError("naive mode is the one-process reference and has no state to shard; run it on one rank")
    parallel.check_agree("grpo_backward settings", {"mode": mode, **loss.model_dump(), **engine.model_dump()})
    prompt = check_prompt(model, prompt_ids, parallel)
    branches = Branches.group(responses, advantages, loss, vocab_size=model.config.vocab_size,
                              old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
    parallel.check_same(torch.cat([torch.tensor([len(r) for r in branches.tokens]), *branches.tokens]), "responses")
    check_positions(prompt.numel(), branches.tokens, model.config)

    t0 = time.perf_counter()
    state_bytes = grad_bytes = 0
    summed_here = _share_earlier_gradients(model, parallel)
    if mode == "naive":
        totals = naive_backward(model, prompt, branches, loss, progress, head_chunk=engine.head_chunk)
    else:
        exact = mode == "exact"
        state = capture(model, prompt, engine, parallel=parallel, exact=exact, progress=progress)
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
    return {
        "mode": mode,
        "loss": totals["loss"],
        "clip_frac": totals["clipped_tokens"] / tokens,
        "kl": totals["kl_sum"] / tokens,
        "entropy": totals["entropy_sum"] / tokens,
        "tokens": tokens,
        "prompt_tokens": prompt.numel(),
        "state_bytes": state_bytes,
        "peak_state_bytes": state_bytes + grad_bytes,
        "seconds": time.perf_counter() - t0,
    }


def naive_backward(model: PrefixLM, prompt: torch.Tensor, branches: Branches, loss: GRPOConfig,
                   progress: bool = False, *, head_chunk: int | None = None) -> dict[str, float]:
    """Every branch forwards prompt + response with autograd (the reference); returns the loss statistics. The
    LM head runs over the response's positions only, `head_chunk` tokens at a time (`EngineConfig.head_chunk`)."""
    device = next(model.parameters()).device
    totals = dict.fromkeys(LOSS_TOTALS, 0.0)
    for i in tqdm(range(len(branches)), desc="naive branches", unit="branch", disable=not progress, leave=False):
        r = branches.tokens[i].to(device)
        logp, ent = model.token_logprobs(torch.cat([prompt.to(device), r[:-1]])[None], r[None],
                                         logits_from=prompt.numel() - 1, head_chunk=head_chunk, entropy=True)
        loss_backward(branches.select([i]), [logp[0]], loss, totals, [ent[0]])
    return totals


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
