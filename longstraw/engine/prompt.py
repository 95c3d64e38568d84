"""Exact mode's prompt backward: dLoss/dState, summed over every branch, back-propagated through the prompt chunk
by chunk, last chunk first.

dState (one buffer per layer, `new_dstate`) is what each layer kind's `leaf()` / `leaf_grad()` / `segment_grads()`
make of it: per-token layers accumulate into it in place over all branches and later chunks; a fixed-size layer's
entry is the gradient of its state at the current chunk boundary. A chunk is recomputed from its boundary states
(kept at capture, or regenerated from the last kept one before it), unless capture kept its graph.

Sharded over a sequence-parallel group, every rank runs every chunk; what one rank owns (a chunk's dState rows,
its kept boundary states) it hands to the others with `SequenceGroup.share`, and each rank's rows before the
chunk collect their share. On one rank the same code runs with collectives that do nothing.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..models.protocol import PrefixLM
from ..parallel import ONE_RANK, SequenceGroup
from ..state import LayerState, PrefixState, boundary_states
from .checks import check_state
from .chunks import chunk_with_graph, run_chunk

Boundaries = dict[int, dict[int, LayerState]]  # chunk index -> the fixed-size states at its start, by layer


def prompt_backward(model: PrefixLM, state: PrefixState, dstate: dict[int, LayerState], *,
                    parallel: SequenceGroup = ONE_RANK, progress: bool = False) -> None:
    """Back-propagate `dstate` (dLoss/dState of all this group's branches) through the prompt into `param.grad`.

    With data-parallel groups, dstate is first summed over them (each group then runs the same prompt backward in
    lockstep, as ZeRO-3 and FSDP need, with 1/dp of it: the groups' parameter gradients add up to one). Chunk i's
    per-token rows have their final gradient once all later chunks are done; its backward adds into the rows
    before it, into its boundary leaves (whose gradients become the fixed-size layers' entries for chunk i-1) and
    into the parameters. The state is left as it is (its kept graphs are used up)."""
    check_state(model, state, parallel)
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
    for i in tqdm(range(len(state.chunks) - 1, -1, -1), desc="prompt backward", unit="chunk", disable=not progress,
                  leave=False):
        s, e = state.chunks[i]
        if i in kept:
            emitted, leaves = kept.pop(i)
        else:
            boundary = _boundary(model, state, i, stored, shared, parallel)
            with torch.enable_grad():
                emitted, leaves = chunk_with_graph(model, state, i, dstate, boundary, parallel)
        owner = parallel.owner(s, state.length)
        outputs, grads = [], []
        for j, new in emitted.items():
            outputs += new.differentiable()
            if new.token_axis is None:  # a fixed-size state: its dState entry is replicated
                grads += dstate[j].segment_grads(s, e)
            else:  # the owner's rows, on every rank
                mine = dstate[j].segment_grads(s - state.offset, e - state.offset) if state.owns(s) else None
                grads += parallel.share(mine, new.differentiable(), owner)
        # with frozen weights (LoRA) some outputs have no path to anything trainable (layer 0's K/V of chunk 0)
        live = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        if live:
            torch.autograd.backward(*map(list, zip(*live)))
        for j, leaf in enumerate(leaves):
            if (g := leaf.leaf_grad()) is not None:
                dstate[j] = g


def _boundary(model: PrefixLM, state: PrefixState, i: int, stored: Boundaries, shared: Boundaries,
              parallel: SequenceGroup) -> dict[int, LayerState]:
    """The boundary states at chunk i's start. If no rank holds them yet, the owner of the last kept one before
    it (chunk j = i - i % boundary_every) hands that one to every rank, and all ranks regenerate those of chunks
    j+1..i from it together, which leaves them on every rank for the chunks that follow (i-1, ..., j)."""
    if i not in shared:
        j = i - i % state.boundary_every
        s = state.chunks[j][0]
        like = boundary_states(state.layers)
        mine = stored.pop(j) if state.owns(s) else None
        flat = parallel.share(None if mine is None else [t for b in mine.values() for t in b.tensors()],
                              [t for b in like.values() for t in b.tensors()], parallel.owner(s, state.length))
        it = iter(flat)
        shared[j] = {k: b.map(lambda _: next(it)) for k, b in like.items()}
        with torch.no_grad():
            for c in range(j, i):
                prefix = [shared[c].get(k, layer) for k, layer in enumerate(state.layers)]
                emitted = run_chunk(model, state, *state.chunks[c], prefix, parallel=parallel)
                shared[c + 1] = {k: b for k, new in emitted.items() if (b := new.row(0).boundary()) is not None}
    return shared.pop(i)
