"""Replay branches on a prefix state: `[prompt[-1]] + response[:-1]` at positions P-1.., scored on `response`.

`score` gives the log-probs without autograd; `replay` back-propagates the GRPO loss of the branches into the
parameters and, in exact mode, dLoss/dState into a dState buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from ..grpo import GRPOConfig, branch_loss
from ..models.common.head import logprobs_from_logits
from ..models.protocol import PrefixLM
from ..parallel import ONE_RANK, SequenceGroup
from ..state import LayerState, PrefixState, PrefixView, Segment
from .branches import Branches
from .budget import checkpoints_layers
from .checks import as_responses, check_positions, check_state
from .chunks import gradients_summed_over_group
from .config import EngineConfig

LOSS_TOTALS = ("loss", "clipped_tokens", "kl_sum", "entropy_sum")

token_logprobs = logprobs_from_logits  # log softmax(logits)[targets] in fp32 (fp64 for fp64 models), of given logits


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
    entropy: bool = False,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token log-probs of a batch of responses, replayed together (right-padded) on the shared state.

    The state is read, never written; with `grad` (dState sinks), backward adds dLoss/dPrefix of the per-token
    layers into it. `prefix` overrides the layers' states (exact mode passes `leaf()`s, views of the state).
    `spread_to`: the ranks of `parallel` replay different responses, all padded to that many tokens (`Segment`'s
    spread). `checkpoint_layers`: each layer keeps only its input for the backward. The LM head runs over
    `head_chunk` tokens at a time (the model's `token_logprobs`; None: its default), so the logits of the whole
    batch never exist at once. With `entropy`, also each token's entropy (no autograd): (logps, entropies).
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
    seg = Segment(start=state.length, prefix=view, spread=spread_to is not None, checkpoint_layers=checkpoint_layers)
    # right padding is safe: causal mixers keep real tokens from seeing the padding after them
    out = model.token_logprobs(inputs, targets, seg, head_chunk=head_chunk, entropy=entropy)
    logp, ent = out if entropy else (out, None)
    logps = [logp[i, : r.numel()] for i, r in enumerate(responses)]
    return (logps, [ent[i, : r.numel()] for i, r in enumerate(responses)]) if entropy else logps


@torch.no_grad()
def score(model: PrefixLM, state: PrefixState, responses: Sequence, branch_batch: int = 1, *,
          parallel: SequenceGroup = ONE_RANK, head_chunk: int | None = None) -> list[torch.Tensor]:
    """Per-token log-probabilities of each response given the captured prompt (no autograd), the LM head over
    `head_chunk` tokens at a time (`EngineConfig.head_chunk`). On a group, every rank passes its shard of the
    state and the same responses, and gets the same result."""
    check_state(model, state, parallel)
    resp = as_responses(responses, model.config.vocab_size)
    check_positions(state.length + 1, resp, model.config)
    parallel.check_agree("score settings", {"branch_batch": branch_batch, "branches": len(resp)})
    out: list[torch.Tensor] = []
    for b in range(0, len(resp), branch_batch):
        out += replay_logprobs(model, state, resp[b : b + branch_batch], parallel=parallel, head_chunk=head_chunk)
    return out


def loss_backward(branches: Branches, logps: list[torch.Tensor], loss: GRPOConfig, totals: dict[str, float],
                  entropies: list[torch.Tensor] | None = None) -> None:
    """Back-propagate the GRPO loss of `branches` (their log-probs `logps`, with autograd); add its statistics
    into `totals` (with `entropies`, each branch's per-token entropies, their sum as `entropy_sum`)."""
    total = 0.0
    for i, lp in enumerate(logps):
        old = None if branches.old_logprobs is None else branches.old_logprobs[i]
        ref = None if branches.ref_logprobs is None else branches.ref_logprobs[i]
        li, st = branch_loss(lp, float(branches.advantages[i]), branches.token_weights[i], loss, old, ref)
        total = total + li
        if branches.token_weights[i] == 0.0:  # a filler (`Branches.padded`): in the graph, in no statistic
            continue
        for key, val in st.items():
            totals[key] += val
        if entropies is not None:
            totals["entropy_sum"] += float(entropies[i].sum())
    total.backward()


def replay(
    model: PrefixLM,
    state: PrefixState,
    branches: Branches,
    loss: GRPOConfig,
    dstate: dict[int, LayerState] | None = None,
    *,
    engine: EngineConfig = EngineConfig(),
    parallel: SequenceGroup = ONE_RANK,
    progress: bool = False,
) -> dict[str, float]:
    """Replay `branches` on `state` with autograd, `engine.branch_batch` at a time, and back-propagate their GRPO
    loss: parameter gradients accumulate in `param.grad`; with a dState buffer (exact mode, `new_dstate`),
    dLoss/dState adds into it; without (detached mode) the prefix gets no gradient.

    `branches` may be a slice of a group (their token weights are the whole group's), so a group can be split over
    several calls, or over the data-parallel groups, whose buffers add up. Returns the loss statistics summed over
    the data-parallel groups (a collective over them: each group replays its slice)."""
    check_state(model, state, parallel)
    check_positions(state.length + 1, branches.tokens, model.config)
    parallel.check_agree("replay settings", {"branch_batch": engine.branch_batch, "exact": dstate is not None,
                                             "branches": len(branches), "checkpoint_layers": engine.checkpoint_layers})
    # the ranks of a group replay their own share of the branches (their queries visit every rank's rows), padded
    # with fillers to a multiple of the group
    spread = parallel.size > 1
    if spread:
        per = -(-len(branches) // parallel.size)
        pad = max(r.numel() for r in branches.tokens)  # one length on every rank: their queries are gathered
        branches = branches.padded(per * parallel.size).select(range(parallel.rank * per, (parallel.rank + 1) * per))
    longest = pad if spread else max(r.numel() for r in branches.tokens)
    checkpointed = checkpoints_layers(model, engine.checkpoint_layers, engine.branch_batch * longest, parallel)
    leaves = None if dstate is None else [s.leaf() for s in state.layers]
    totals = dict.fromkeys(LOSS_TOTALS, 0.0)
    mode = "detached" if dstate is None else "exact"
    with (tqdm(total=len(branches), desc=f"{mode} branches", unit="branch", disable=not progress, leave=False) as bar,
          gradients_summed_over_group(model, parallel, spread)):
        for b in range(0, len(branches), engine.branch_batch):
            batch = branches.select(range(b, min(b + engine.branch_batch, len(branches))))
            logps, entropies = replay_logprobs(model, state, batch.tokens, dstate, leaves, parallel,
                                               pad if spread else None, checkpointed, engine.head_chunk, entropy=True)
            loss_backward(batch, logps, loss, totals, entropies)
            bar.update(len(batch))
    for i, leaf in enumerate(leaves or []):
        if (g := leaf.leaf_grad()) is not None:
            if spread:  # each rank's branches' share of the fixed-size states' gradient
                for t in g.tensors():
                    parallel.sum_(t)
            dstate[i].add_(g)
    summed = parallel.dp_sum_(torch.tensor(list(totals.values()), dtype=torch.float64, device=parallel.device))
    if spread:
        summed = parallel.sum_(summed)
    return dict(zip(totals, summed.tolist()))
