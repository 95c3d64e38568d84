"""Replay branches on a prefix state: `[prompt[-1]] + response[:-1]` at positions P-1.., scored on `response`.

`score` gives the log-probs without autograd; `replay` back-propagates the GRPO loss of the branches into the
parameters and, in exact mode, dLoss/dState into a dState buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from tqdm.auto import tqdm

from ..grpo import GRPOConfig, branch_loss
from ..models.protocol import PrefixLM
from ..parallel import ONE_RANK, SequenceGroup
from ..segment import PrefixView, Segment
from ..state import LayerState, PrefixState
from .branches import Branches
from .checks import as_responses, check_positions, check_state
from .config import EngineConfig, check_engine
from .gradients import gradients_summed_over_group
from .policy import Plan, plan_group
from .routing import Routing, batch_routing, check_replay


def replay_logprobs(
    model: PrefixLM,
    state: PrefixState,
    responses: list[torch.Tensor],
    grad: dict[int, LayerState] | None = None,
    prefix: list[LayerState] | None = None,
    parallel: SequenceGroup = ONE_RANK,
    spread_to: int | None = None,
    checkpoint_layers: bool = False,
    head_chunk: int | None = None,
    entropy: bool | Literal["grad"] = False,
    routing: Sequence[dict[int, torch.Tensor] | None] | None = None,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token log-probs of a batch of responses, replayed together (right-padded) on the shared state.

    The state is read, never written; with `grad` (dState sinks), backward adds dLoss/dPrefix of the per-token
    layers into it. `prefix` overrides the layers' states (exact mode passes `leaf()`s, views of the state).
    `spread_to`: the ranks of `parallel` replay different responses, all padded to that many tokens (`Segment`'s
    spread). `checkpoint_layers`: each layer keeps only its input for the backward. The LM head runs over
    `head_chunk` tokens at a time (the model's `token_logprobs`; None: its default), so the logits of the whole
    batch never exist at once. With `entropy`, also each token's entropy (no autograd; "grad": with autograd):
    (logps, entropies). `routing`: each response's MoE routing to replay (engine/routing.py), or None.
    """
    device = state.prompt_ids.device
    longest = spread_to or max(r.numel() for r in responses)
    inputs = torch.zeros(len(responses), longest, dtype=torch.long, device=device)
    targets = torch.zeros_like(inputs)
    for i, r in enumerate(responses):
        r = r.to(device)
        inputs[i, 0] = state.prompt_ids[-1]
        inputs[i, 1 : r.numel()] = r[:-1]
        targets[i, : r.numel()] = r
    view = PrefixView(prefix or state.layers, state.length, grad, state.rows, parallel)
    seg = Segment(start=state.length, prefix=view, spread=spread_to is not None, checkpoint_layers=checkpoint_layers,
                  routing=None if routing is None else batch_routing(routing, longest, device))
    # right padding is safe: causal mixers keep real tokens from seeing the padding after them
    out = model.token_logprobs(inputs, targets, seg, head_chunk=head_chunk, entropy=entropy)
    logp, ent = out if entropy else (out, None)
    logps = [logp[i, : r.numel()] for i, r in enumerate(responses)]
    return (logps, [ent[i, : r.numel()] for i, r in enumerate(responses)]) if entropy else logps


@torch.no_grad()
def score(model: PrefixLM, state: PrefixState, responses: Sequence, *, engine: EngineConfig = EngineConfig(),
          plan: Plan | None = None, parallel: SequenceGroup = ONE_RANK,
          routing: Sequence[dict[int, torch.Tensor] | None] | None = None) -> list[torch.Tensor]:
    """Per-token log-probabilities of each response given the captured prompt (no autograd), `engine.branch_batch`
    responses at a time, the LM head over `engine.head_chunk` tokens at a time. `routing`: each response's MoE
    routing to replay (`Sample.routing`; engine/routing.py), as the loss will. On a group, every rank passes its
    shard of the state and the same responses, and gets the same result. `plan`: the group's (engine/policy.py,
    resolved without autograd), resolved from `engine` and the state if not given."""
    engine = check_engine(engine, "score")
    check_state(model, state, parallel)
    resp = as_responses(responses, model.config.vocab_size)
    check_positions(state.length + 1, resp, model.config)
    if routing is not None:
        routing = list(check_replay(model, Routing(branches=routing), state.length, resp).branches)
    if plan is None:
        plan = plan_group(model, engine, state, parallel=parallel, exact=False, grad=False)
    parallel.check_agree("score settings", {**plan.decisions(), "branches": len(resp)})
    batch = plan.branch_batch
    out: list[torch.Tensor] = []
    for b in range(0, len(resp), batch):
        out += replay_logprobs(model, state, resp[b : b + batch], parallel=parallel, head_chunk=plan.head_chunk,
                               routing=None if routing is None else routing[b : b + batch])
    return out


# statistics summed over the group's tokens (every key on every rank, zero when unused: they are summed by one
# collective); `mismatch_abs_max` is the group's maximum
LOSS_TOTALS = ("loss", "clipped_tokens", "kl_sum", "entropy_sum", "off_policy_masked", "entropy_kept_tokens",
               "mismatch_abs_sum", "mismatch_kl_sum", "sampler_tokens", "correction_weight_sum")
LOSS_MAXIMA = ("mismatch_abs_max",)


def new_totals() -> dict[str, float]:
    return dict.fromkeys(LOSS_TOTALS + LOSS_MAXIMA, 0.0)


def loss_backward(branches: Branches, logps: list[torch.Tensor], loss: GRPOConfig, totals: dict[str, float],
                  entropies: list[torch.Tensor] | None = None) -> None:
    """Back-propagate the GRPO loss of `branches` (their log-probs `logps`, with autograd); add its statistics
    into `totals` (`new_totals()`). `entropies`: each branch's per-token entropies (with autograd when the loss has
    an entropy bonus); their sum goes into `entropy_sum`."""
    if loss.top_entropy_quantile < 1.0 and branches.entropy_keep is None or (
            loss.entropy_coef > 0.0 and branches.bonus_weights is None):
        raise ValueError("the entropy options are functions of the whole group: set them on the group's Branches "
                         "with engine.entropy.with_entropy_weights before replaying any of its branches")
    total = 0.0
    per = lambda xs, i: None if xs is None else xs[i]  # noqa: E731
    for i, lp in enumerate(logps):
        ent = per(entropies, i)
        keep = per(branches.entropy_keep, i)
        li, st = branch_loss(lp, float(branches.advantages[i]), branches.token_weights[i], loss,
                             per(branches.old_logprobs, i), per(branches.ref_logprobs, i),
                             per(branches.sampler_logprobs, i), ent,
                             None if keep is None else keep.to(lp.device), per(branches.bonus_weights, i) or 0.0,
                             mask=branches.mask(i))
        total = total + li
        if branches.token_weights[i] == 0.0:  # a filler, or a truncated response masked out: in no statistic
            continue
        for key, val in st.items():
            totals[key] = max(totals[key], val) if key in LOSS_MAXIMA else totals[key] + val
        mask = branches.mask(i)  # the model's tokens: the only ones a statistic counts
        if ent is not None:
            ent = ent.detach() if mask is None else ent.detach()[mask.to(ent.device)]
            totals["entropy_sum"] += float(ent.sum())
        totals["entropy_kept_tokens"] += float((lp.numel() if mask is None else mask.sum()) if keep is None
                                               else keep.sum())
    total.backward()


def reduce_totals(totals: dict[str, float], parallel: SequenceGroup, spread: bool) -> dict[str, float]:
    """The statistics of every rank's branches: sums over the data-parallel groups (and over the sequence-parallel
    ranks when they replayed different branches), maxima likewise."""
    sums = torch.tensor([totals[k] for k in LOSS_TOTALS], dtype=torch.float64, device=parallel.device)
    # a maximum through the sums: each rank's value in its own slot, so one all-reduce gives every rank's
    slots = torch.zeros(parallel.dp_size * parallel.size, len(LOSS_MAXIMA), dtype=torch.float64,
                        device=parallel.device)
    slots[parallel.dp_rank * parallel.size + parallel.rank] = torch.tensor([totals[k] for k in LOSS_MAXIMA],
                                                                      dtype=torch.float64)
    both = parallel.dp_sum_(torch.cat([sums, slots.flatten()]))
    if spread:
        both = parallel.sum_(both)
    out = dict(zip(LOSS_TOTALS, both[: len(LOSS_TOTALS)].tolist()))
    maxima = both[len(LOSS_TOTALS):].view(-1, len(LOSS_MAXIMA)).amax(0)
    return out | dict(zip(LOSS_MAXIMA, maxima.tolist()))


@torch.no_grad()
def group_entropies(model: PrefixLM, state: PrefixState, branches: Branches, *, engine: EngineConfig = EngineConfig(),
                    parallel: SequenceGroup = ONE_RANK) -> list[torch.Tensor]:
    """Each branch's per-token entropies on the captured prompt (routed as its loss will be), no autograd,
    `engine.branch_batch` at a time, the LM head over `engine.head_chunk` tokens at a time: every rank of a group
    scores every branch (the top-entropy quantile is the whole group's)."""
    plan = plan_group(model, engine, state, parallel=parallel, exact=False, grad=False)
    out: list[torch.Tensor] = []
    for b in range(0, len(branches), plan.branch_batch):
        batch = branches.select(range(b, min(b + plan.branch_batch, len(branches))))
        _, ents = replay_logprobs(model, state, batch.tokens, parallel=parallel, head_chunk=plan.head_chunk,
                                  entropy=True, routing=batch.routing)
        out += ents
    return out


def replay(
    model: PrefixLM,
    state: PrefixState,
    branches: Branches,
    loss: GRPOConfig,
    dstate: dict[int, LayerState] | None = None,
    *,
    engine: EngineConfig = EngineConfig(),
    plan: Plan | None = None,
    parallel: SequenceGroup = ONE_RANK,
    progress: bool = False,
) -> dict[str, float]:
    """Replay `branches` on `state` with autograd, `engine.branch_batch` at a time, and back-propagate their GRPO
    loss: parameter gradients accumulate in `param.grad`; with a dState buffer (exact mode, `new_dstate`),
    dLoss/dState adds into it; without (detached mode) the prefix gets no gradient. `plan`: the group's
    (engine/policy.py), resolved from `engine` and the state if not given.

    `branches` may be a slice of a group (their token weights are the whole group's), so a group can be split over
    several calls, or over the data-parallel groups, whose buffers add up. Returns the loss statistics summed over
    the data-parallel groups (a collective over them: each group replays its slice)."""
    engine = check_engine(engine, "replay")
    check_state(model, state, parallel)
    check_positions(state.length + 1, branches.tokens, model.config)
    if plan is None:
        plan = plan_group(model, engine, state, parallel=parallel, exact=dstate is not None)
    parallel.check_agree("replay settings", {**plan.decisions(), "exact": dstate is not None,
                                             "branches": len(branches)})
    # the ranks of a group replay their own share of the branches (their queries visit every rank's rows), padded
    # with fillers to a multiple of the group
    spread = parallel.size > 1
    if spread:
        per = -(-len(branches) // parallel.size)
        pad = max(r.numel() for r in branches.tokens)  # one length on every rank: their queries are gathered
        branches = branches.padded(per * parallel.size).select(range(parallel.rank * per, (parallel.rank + 1) * per))
    longest = pad if spread else max(r.numel() for r in branches.tokens)
    checkpointed = plan.checkpoints(plan.branch_batch * longest)
    leaves = None if dstate is None else [s.leaf() for s in state.layers]
    totals = new_totals()
    entropy = "grad" if loss.entropy_coef > 0.0 else True
    mode = "detached" if dstate is None else "exact"
    with (tqdm(total=len(branches), desc=f"{mode} branches", unit="branch", disable=not progress, leave=False) as bar,
          gradients_summed_over_group(model, parallel, spread)):
        for b in range(0, len(branches), plan.branch_batch):
            batch = branches.select(range(b, min(b + plan.branch_batch, len(branches))))
            logps, entropies = replay_logprobs(model, state, batch.tokens, dstate, leaves, parallel,
                                               pad if spread else None, checkpointed, plan.head_chunk,
                                               entropy=entropy, routing=batch.routing)
            loss_backward(batch, logps, loss, totals, entropies)
            bar.update(len(batch))
    for i, leaf in enumerate(leaves or []):
        if (g := leaf.leaf_grad()) is not None:
            if spread:  # each rank's branches' share of the fixed-size states' gradient
                for t in g.tensors():
                    parallel.sum_(t)
            dstate[i].add_(g)
    return reduce_totals(totals, parallel, spread)
