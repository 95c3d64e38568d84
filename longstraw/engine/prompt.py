"""Exact mode's prompt backward: dLoss/dState, summed over every branch, back-propagated through the prompt chunk
by chunk, last chunk first.

dState (one buffer per layer, `new_dstate`) is what each layer kind's `leaf()` / `leaf_grad()` / `segment_grads()`
make of it: per-token layers accumulate into it in place over all branches and later chunks; a fixed-size layer's
entry is the gradient of its state at the current chunk boundary. A chunk is recomputed from its boundary states
(kept at capture, or regenerated from the last kept one before it), unless capture kept its graph.

Over a sequence-parallel group every rank runs its block of every chunk; one rank keeps each chunk's boundary
states and hands them to the others (`SequenceGroup.share`). A rank back-propagates its block: its rows' dState
is its own, the fixed-size states (the same on every rank) take 1/C of their gradient on each rank, and what is
partial per rank (the chunk's starting states' gradients, the parameters') is summed over the group. On one rank
the same code runs with collectives that do nothing.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..models.protocol import PrefixLM
from ..parallel import ONE_RANK, SequenceGroup
from ..state import LayerState, PrefixState, boundary_states
from .checks import check_state
from .chunks import block_rows, chunk_with_graph, run_chunk
from .config import EngineConfig, check_engine
from .gradients import gradients_summed_over_group
from .policy import Plan, plan_group
from .prompt_by_layer import prompt_backward_by_layer

Boundaries = dict[int, dict[int, LayerState]]  # chunk index -> the fixed-size states at its start, by layer


def prompt_backward(model: PrefixLM, state: PrefixState, dstate: dict[int, LayerState], *,
                    engine: EngineConfig = EngineConfig(), plan: Plan | None = None,
                    parallel: SequenceGroup = ONE_RANK, last_chunks: int | None = None,
                    progress: bool = False) -> Plan:
    """Back-propagate `dstate` (dLoss/dState of all this group's branches) through the prompt into `param.grad`;
    returns the plan it ran.

    With data-parallel groups, dstate is first summed over them (each group then runs the same prompt backward in
    lockstep, as ZeRO-3 and FSDP need, with 1/dp of it: the groups' parameter gradients add up to one). Chunk i's
    per-token rows have their final gradient once all later chunks are done; its backward adds into the rows
    before it, into its boundary leaves (whose gradients become the fixed-size layers' entries for chunk i-1) and
    into the parameters. The state is left as it is (its kept graphs are used up).

    `plan` (the group's, engine/policy.py; resolved from `engine` and the state if not given): layer by layer
    (`prompt_order`), the chunks without a kept graph run in the layer-major order of engine/prompt_by_layer.py
    (one layer at a time already), after the kept ones. Chunk by chunk, `checkpoint_layers` recomputes each layer
    of a chunk in its backward. `last_chunks`: only the last ones chunk by chunk (a partial gradient: `longstraw
    plan --rehearse` runs the peak's representatives)."""
    engine = check_engine(engine, "prompt_backward")
    check_state(model, state, parallel)
    if plan is None:
        plan = plan_group(model, engine, state, parallel=parallel, exact=True)
    plan = plan.ran(state.boundary_every, 0 if state.graphs is None else len(state.graphs.kept))
    by_layer = plan.prompt_order == "layers"
    # the plan as run (its order, checkpointing, boundary interval) and which chunks' graphs the state kept
    parallel.check_agree("prompt backward settings", {
        **plan.decisions(), "chunks": len(state.chunks),
        "kept_chunks": [] if state.graphs is None else sorted(state.graphs.kept)})
    checkpointed = plan.checkpoint_layers
    kept = {}
    if state.graphs is not None:  # the kept graphs add into their own buffer: make it the one
        if state.graphs.dstate is not dstate:
            for j, g in dstate.items():
                state.graphs.dstate[j].add_(g)
        dstate, kept = state.graphs.dstate, state.graphs.kept
        state.graphs = None
    for g in dstate.values():
        for t in g.tensors():
            parallel.dp_sum_(t).div_(parallel.dp_size)
    stored: Boundaries = dict(state.boundaries)  # consumed here; the state keeps its own
    shared: Boundaries = {}  # the boundaries every rank holds: regenerated, or handed on by their owner
    n = len(state.chunks)
    by_chunk = min(kept, default=n) if by_layer else 0  # the chunks from here on run chunk by chunk
    if last_chunks is not None:
        by_chunk = max(n - last_chunks, 0)
    with gradients_summed_over_group(model, parallel):
        for i in tqdm(range(n - 1, by_chunk - 1, -1), desc="prompt backward", unit="chunk",
                      disable=not progress, leave=False):
            if i in kept:
                emitted, leaves = kept.pop(i)
            else:
                boundary = _boundary(model, state, i, stored, shared, parallel)
                with torch.enable_grad():
                    emitted, leaves = chunk_with_graph(model, state, i, dstate, boundary, parallel, checkpointed)
            outputs, grads = [], []
            for j, new in emitted.items():
                outputs += new.differentiable()
                grads += _output_grads(state, i, dstate[j], parallel)
            # with frozen weights (LoRA) some outputs have no path to anything trainable (layer 0's K/V of chunk 0)
            live = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
            if live:
                torch.autograd.backward(*map(list, zip(*live)))
            for j, leaf in enumerate(leaves):
                if (g := leaf.leaf_grad()) is not None:
                    for t in g.tensors():  # each rank's share of the chunk's starting state's gradient
                        parallel.sum_(t)
                    dstate[j] = g
        if by_chunk and last_chunks is None:
            prompt_backward_by_layer(model, state, by_chunk, dstate, lambda i, g: _output_grads(state, i, g, parallel),
                                     parallel, progress=progress)
    return plan


def _output_grads(state: PrefixState, i: int, grad: LayerState, parallel: SequenceGroup) -> list[torch.Tensor]:
    """The gradients of what chunk i emitted into layer state `grad`'s layer, read from dState: this rank's
    block's rows; of a fixed-size state (the same on every rank, each rank feeding its share of it), 1/C."""
    s, e = state.chunks[i]
    if grad.token_axis is None:
        return [g / parallel.size for g in grad.segment_grads(s, e)]
    row, count = block_rows(state, i, parallel)
    return grad.segment_grads(row, row + count)


def _boundary(model: PrefixLM, state: PrefixState, i: int, stored: Boundaries, shared: Boundaries,
              parallel: SequenceGroup) -> dict[int, LayerState]:
    """The boundary states at chunk i's start. If no rank holds them yet, the rank that kept the last one before
    it (chunk j = i - i % boundary_every) hands that one to every rank, and all ranks regenerate those of chunks
    j+1..i from it together, which leaves them on every rank for the chunks that follow (i-1, ..., j)."""
    if i not in shared:
        j = i - i % state.boundary_every
        owner = parallel.boundary_owner(j, state.boundary_every)
        like = boundary_states(state.layers)
        mine = stored.pop(j) if owner == parallel.rank else None
        flat = parallel.share(None if mine is None else [t for b in mine.values() for t in b.tensors()],
                              [t for b in like.values() for t in b.tensors()], owner)
        it = iter(flat)
        shared[j] = {k: b.map(lambda _: next(it)) for k, b in like.items()}
        with torch.no_grad():
            for c in range(j, i):
                prefix = [shared[c].get(k, layer) for k, layer in enumerate(state.layers)]
                emitted = run_chunk(model, state, c, prefix, parallel=parallel)
                shared[c + 1] = {k: b for k, new in emitted.items() if (b := new.row(0).boundary()) is not None}
    return shared.pop(i)
