"""Prompt capture: run prompt[:-1] in chunks without autograd and keep each layer's prefix state.

With `exact=True` capture also keeps what exact mode's prompt backward needs: the fixed-size states at every k-th
chunk start (the boundary policy of `engine/policy.py`), and the autograd graphs of the last chunks that fit
`prompt_graph_budget`, so that the prompt backward need not recompute them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..models.protocol import PrefixLM
from ..parallel import ONE_RANK, SequenceGroup
from ..parallel.fsdp import gathered_once
from ..state import LayerState, PrefixState, boundary_states
from .chunks import (Kept, check_prompt, chunk_segment, chunk_with_graph, empty_state, run_chunk, store_chunk,
                     store_routing)
from .config import EngineConfig, check_engine
from .policy import Plan, plan_group
from .routing import LayerRouting, empty_routing, held_routing


@dataclass
class PromptGraphs:
    """What an exact capture kept of its last chunks: their graphs (each chunk's emitted state and the leaves it
    read), and the dState buffer those graphs add dLoss/dPrefix into; the replays add into the same buffer."""

    dstate: dict[int, LayerState]
    kept: dict[int, Kept]


@torch.no_grad()
def capture(
    model: PrefixLM,
    prompt_ids,
    engine: EngineConfig = EngineConfig(),
    *,
    plan: Plan | None = None,
    parallel: SequenceGroup = ONE_RANK,
    exact: bool = False,
    progress: bool = False,
    record_routing: bool = False,
    routing: LayerRouting | None = None,
) -> PrefixState:
    """State of `prompt[:-1]` per layer, computed chunk by chunk (`engine.prompt_chunk` tokens) without autograd;
    this rank's shard of it on a sequence-parallel group (every rank passes the same prompt).

    `exact=True`: also keep the boundary states at every `state.boundary_every`-th chunk start (one rank of the
    group each; they are stored with the state, so a stored state can run the prompt backward without a recapture),
    and the graphs of the final chunks that fit the graph budget (in memory only, `state.graphs`). `plan`: the
    group's `Plan` (engine/policy.py) of `engine`, resolved here if not given.

    MoE routing replay (engine/routing.py): `record_routing` keeps the experts each prompt token was routed to
    with the state (`state.routing`, this rank's rows), and `routing` (the whole `prompt[:-1]`'s, by MoE layer)
    routes the prompt's tokens as it says and is kept likewise; every later recompute of the prompt's chunks
    (exact mode's prompt backward) then routes as the state says."""
    engine = check_engine(engine, "capture")
    p = next(model.parameters())
    prompt = check_prompt(model, prompt_ids, parallel)
    if plan is None:  # capture's own autograd is the kept graphs' alone: without any, nothing is measured for it
        plan = plan_group(model, engine, prompt.numel(), parallel=parallel, exact=exact,
                          grad=exact and engine.prompt_graph_budget != 0)
    elif plan.prompt_chunk != engine.prompt_chunk:
        raise ValueError(f"capture's plan is for prompt chunks of {plan.prompt_chunk}, its engine's are "
                         f"{engine.prompt_chunk}: resolve the plan from the same EngineConfig (policy.plan_group)")
    # what the ranks run is the plan's decisions, whatever settings led to them
    parallel.check_agree("capture settings", {**plan.decisions(), "exact": exact, "dtype": str(p.dtype),
                                              "model": model.config.fingerprint,
                                              "routing": "given" if routing is not None else record_routing})
    state = empty_state(model, prompt, plan.prompt_chunk, parallel)
    recording = routing is None and record_routing
    if routing is not None:
        state.routing = held_routing(model, routing, state)
    elif record_routing:
        state.routing = empty_routing(model, state.rows.rows, state.prompt_ids.device)
        recording = state.routing is not None
    n = len(state.chunks)
    first_kept = n - plan.kept_graphs if exact else n
    if exact:
        state.boundary_every = plan.boundary_every
        if first_kept < n:
            state.graphs = PromptGraphs(state.grad_buffer(), {})
    # layer-major (ZeRO-3): the chunks without a kept graph, each layer gathered once for all, not once per chunk
    done = first_kept if first_kept > 1 and plan.prompt_order == "layers" else 0
    if done:
        _capture_by_layer(model, state, done, exact, parallel, progress, recording)
    for i in tqdm(range(done, n), desc="capture", unit="chunk", disable=not progress, leave=False):
        # one rank keeps each; taken before the chunk moves the state on. Kept even where the chunk's graph is
        # kept too: a stored state has no graphs, and its prompt backward recomputes from these.
        if exact and _keeps_boundary(state, i, parallel):
            state.boundaries[i] = boundary_states(state.layers)
        routed = {} if recording else None
        if i >= first_kept:
            with torch.enable_grad():
                state.graphs.kept[i] = chunk_with_graph(model, state, i, state.graphs.dstate,
                                                        boundary_states(state.layers), parallel, plan.checkpoint_layers,
                                                        routed)
            emitted = state.graphs.kept[i][0]
        else:
            emitted = run_chunk(model, state, i, parallel=parallel, routed=routed)
        store_chunk(model, state, i, emitted, parallel)
        if routed:
            store_routing(state, i, routed, parallel)
    return state


def _keeps_boundary(state: PrefixState, i: int, parallel: SequenceGroup) -> bool:
    """Whether this rank keeps the boundary states at chunk i's start (one rank keeps each kept one)."""
    return i % state.boundary_every == 0 and parallel.boundary_owner(i, state.boundary_every) == parallel.rank


def _capture_by_layer(model: PrefixLM, state: PrefixState, count: int, exact: bool, parallel: SequenceGroup,
                      progress: bool, recording: bool = False) -> None:
    """Capture chunks 0..count-1 layer-major (`emit_states_by_layer`): the same state and boundaries as chunk by
    chunk, each layer's boundary state taken when the layer reaches the chunk (and its routing, `recording`)."""
    chunks = [chunk_segment(state, i, parallel=parallel, record_routing=recording) for i in range(count)]
    if exact and _keeps_boundary(state, 0, parallel):
        state.boundaries[0] = boundary_states(state.layers)
    bar = tqdm(total=count * len(state.layers), desc="capture (layer-major)", unit="chunk-layer",
               disable=not progress, leave=False)

    def stored(j: int, i: int) -> None:
        store_chunk(model, state, i, {j: chunks[i][1].emitted.pop(j)}, parallel)
        if j in chunks[i][1].routed:
            store_routing(state, i, {j: chunks[i][1].routed.pop(j)}, parallel)
        if exact and i + 1 < count and _keeps_boundary(state, i + 1, parallel) and \
                (b := state.layers[j].boundary()) is not None:
            state.boundaries.setdefault(i + 1, {})[j] = b
        bar.update()

    with bar:
        model.emit_states_by_layer(chunks, stored, gathered_once)


def new_dstate(state: PrefixState) -> dict[int, LayerState]:
    """The dLoss/dState buffer of `state`, one per layer: zeros in the state's layout, or, for a state whose
    capture kept chunk graphs, the buffer those graphs add into (the same object each time it is asked)."""
    return state.graphs.dstate if state.graphs is not None else state.grad_buffer()
