"""The engine's memory policy, in one place: `resolve` turns an `EngineConfig` into the `Plan` one GRPO group runs
with (prompt chunk, per-layer checkpointing, prompt order, boundary interval, kept graphs, head chunk), from what
the model costs (`Costs`) and the free memory, agreed once by the ranks.

The engine's ops take a `Plan` (`plan_group` measures the model and agrees the free memory); `longstraw plan`
estimates the same `Costs` from config.json and calls `resolve` with the GPU's memory, so the planner and the
engine cannot decide differently. None of it changes the gradient, only what is kept and what is recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from dataclasses import asdict, dataclass, replace
from typing import Literal

from ..memory import free_bytes
from ..models.common.head import default_head_chunk
from ..models.protocol import PrefixLM
from ..parallel import ONE_RANK, SequenceGroup
from ..parallel.fsdp import gathers_per_use
from ..state import PrefixState
from .budget import activation_bytes_per_token, checkpointed_bytes_per_token, kept_chunk_count
from .chunks import held_rows, prompt_chunks
from .config import EngineConfig

# the shares of free memory the automatic settings may take
GRAPH_SHARE = 4  # kept prompt-chunk graphs, a chunk's (or branch batch's) whole activations, layer-major checkpoints
BOUNDARY_SHARE = 8  # every boundary state kept


def sqrt_interval(n: int) -> int:
    """ceil(sqrt(n)): keeping every k-th of n states and regenerating the others holds about n / k + k of them,
    least near k = sqrt(n) (sparse boundary states; the layer-major backward's checkpoint groups)."""
    return max(1, math.isqrt(max(n, 1) - 1) + 1)


@dataclass(frozen=True)
class Costs:
    """What the policy weighs for one prompt on one model, per rank of a sequence-parallel group: the engine
    measures it (`model_costs`), `longstraw plan` estimates it."""

    chunk_tokens: tuple[int, ...]  # each prompt chunk's tokens, in order
    ranks: int  # sequence-parallel ranks sharing each chunk
    fixed_bytes: int  # the fixed-size states at one chunk start (one boundary)
    layer_major_bytes: int  # what the layer-major prompt backward keeps on a rank
    layer_major_auto: bool  # whether `prompt_order: auto` may walk layer by layer (ZeRO-3, layers standing alone)
    activation_bytes_per_token: Callable[[], int]  # autograd-saved bytes per token (measured only when needed)
    checkpointed_bytes_per_token: int  # the same under per-layer checkpointing
    vocab_size: int

    @property
    def block_tokens(self) -> int:
        """The most tokens a rank runs of one chunk (its block of the longest)."""
        return max((-(-t // self.ranks) for t in self.chunk_tokens), default=0)

    @property
    def rank_chunks(self) -> int:
        """The chunks whose boundary states one rank keeps."""
        return -(-len(self.chunk_tokens) // self.ranks)


@dataclass(frozen=True)
class Plan:
    """How one group runs. `checkpoint_above`: a forward with autograd of more tokens than this (a branch batch)
    checkpoints its layers (None: never); `checkpoint_layers` is that rule applied to a prompt chunk."""

    prompt_chunk: int
    branch_batch: int
    head_chunk: int
    prompt_order: Literal["chunks", "layers"]
    checkpoint_layers: bool
    checkpoint_above: int | None
    boundary_every: int
    kept_graphs: int
    free_bytes: int

    def checkpoints(self, tokens: int) -> bool:
        """Whether a forward of `tokens` tokens with autograd checkpoints its layers."""
        return self.checkpoint_above is not None and tokens > self.checkpoint_above

    def params(self) -> dict[str, int | str | bool | None]:
        """The plan as flat parameters (an op's result's `plan`, which the pipeline logs as MLflow params)."""
        return asdict(self)

    def decisions(self) -> dict[str, int | str | bool]:
        """What the plan decided, which every rank must run alike (the ranks' agreement checks compare it); not
        the free memory it was decided from."""
        return {k: v for k, v in asdict(self).items() if k != "free_bytes"}

    def ran(self, boundary_every: int, kept_graphs: int) -> "Plan":
        """This plan as an op on a captured state ran it: with the state's boundary interval and kept graphs."""
        return replace(self, boundary_every=boundary_every, kept_graphs=kept_graphs)


def boundary_interval(every: int | None, rank_chunks: int, fixed_bytes: int, free: int) -> int:
    """`every` (`EngineConfig.boundary_every`) if set; else every boundary when a rank's `rank_chunks` boundaries
    of `fixed_bytes` each fit an eighth of `free`, else every sqrt_interval-th, for one more no-grad forward of the
    prompt."""
    if every:
        return every
    return 1 if rank_chunks * fixed_bytes <= free // BOUNDARY_SHARE else sqrt_interval(rank_chunks)


def resolve(engine: EngineConfig, costs: Costs, free: int, *, exact: bool, grad: bool = True) -> Plan:
    """The plan of one group: `engine`'s settings, and where one is left to the engine (None, auto), the rule
    (see `EngineConfig`) applied to `costs` and `free` (the ranks' least free bytes). `exact`: the prompt backward
    runs (boundaries, kept graphs); `grad`: forwards run with autograd (else nothing is checkpointed)."""
    quarter = free // GRAPH_SHARE
    if not grad:
        above = None
    elif engine.checkpoint_layers is not None:
        above = 0 if engine.checkpoint_layers else None
    else:  # the whole activations of more tokens than this exceed a quarter of free memory
        above = quarter // costs.activation_bytes_per_token()
    plan = Plan(prompt_chunk=engine.prompt_chunk, branch_batch=engine.branch_batch,
                head_chunk=engine.head_chunk or default_head_chunk(costs.vocab_size),
                prompt_order=_prompt_order(engine, costs, quarter), checkpoint_layers=False, checkpoint_above=above,
                boundary_every=1, kept_graphs=0, free_bytes=free)
    checkpointed = plan.checkpoints(costs.block_tokens)
    if not exact:
        return replace(plan, checkpoint_layers=checkpointed)
    budget = quarter if engine.prompt_graph_budget is None else engine.prompt_graph_budget
    per_token = (lambda: costs.checkpointed_bytes_per_token) if checkpointed else costs.activation_bytes_per_token
    return replace(plan, checkpoint_layers=checkpointed,
                   boundary_every=boundary_interval(engine.boundary_every, costs.rank_chunks, costs.fixed_bytes, free),
                   kept_graphs=kept_chunk_count(costs.chunk_tokens, budget, per_token))


def _prompt_order(engine: EngineConfig, costs: Costs, quarter: int) -> Literal["chunks", "layers"]:
    """auto: layer by layer where allowed (ZeRO-3) and what it keeps fits a quarter of free memory."""
    if engine.prompt_order != "auto":
        return engine.prompt_order
    return "layers" if costs.layer_major_auto and costs.layer_major_bytes <= quarter else "chunks"


def model_costs(model: PrefixLM, chunks: list[tuple[int, int]], parallel: SequenceGroup = ONE_RANK) -> Costs:
    """`Costs` of a prompt state in `chunks` on `model`, this rank of `parallel` holding its block of each."""
    p = next(model.parameters())
    fixed = sum(s.fixed_bytes for s in model.empty_state(0, p.dtype, p.device))
    layers = len(model.decoder_layers)
    # measured on each rank (ZeRO-3's shards can make it differ a little): the ranks take the largest, once, so that
    # the thresholds built on it, and so their decisions, agree
    measured = cache(lambda: -parallel.agree_min(-activation_bytes_per_token(model)))
    return Costs(chunk_tokens=tuple(e - s for s, e in chunks), ranks=parallel.size, fixed_bytes=fixed,
                 layer_major_bytes=layer_major_bytes(layers, held_rows(chunks, parallel).rows,
                                                     model.config.hidden_size * p.element_size(), fixed, len(chunks)),
                 layer_major_auto=bool(gathers_per_use(model)) and model.layers_stand_alone,
                 activation_bytes_per_token=measured,
                 checkpointed_bytes_per_token=checkpointed_bytes_per_token(model), vocab_size=model.config.vocab_size)


def layer_major_bytes(layers: int, rows: float, hidden_bytes: int, fixed_bytes: float, chunks: int) -> float:
    """What the layer-major prompt backward keeps on a rank holding `rows` rows: layers / k + k hidden states of
    them, and one group of k layers' fixed-size states at every chunk start (engine/prompt_by_layer.py)."""
    k = sqrt_interval(layers)
    return (-(-layers // k) + k) * rows * hidden_bytes + fixed_bytes * k // layers * (chunks + 1)


def plan_group(model: PrefixLM, engine: EngineConfig, prompt: int | PrefixState, *,
               parallel: SequenceGroup = ONE_RANK, exact: bool, grad: bool = True) -> Plan:
    """The plan of a group on `model` (`resolve` of its measured costs), with the free memory and activation cost
    the ranks agree on (the least free, the largest cost: a recomputed layer repeats its collectives, so they must
    decide alike). `prompt`: the prompt's length in tokens (before capture), or its captured state, whose chunks,
    boundary interval and kept graphs the plan then takes. The ranks' `engine`s must be the same (checked first:
    what the plan measures depends on them); the ops then check that their plans are."""
    parallel.check_agree("engine settings", engine.model_dump())
    if engine.prompt_order == "layers" and not model.layers_stand_alone:
        raise ValueError("prompt_order 'layers' runs each layer apart, but this model's DSA layers reuse an earlier "
                         "layer's top-k selection (indexer_types 'shared'); use prompt_order 'chunks' or 'auto'")
    state = prompt if isinstance(prompt, PrefixState) else None
    chunks = state.chunks if state is not None else prompt_chunks(prompt - 1, engine.prompt_chunk, parallel)
    free = parallel.agree_min(free_bytes(next(model.parameters()).device))
    # a captured state has its boundaries and kept graphs already: they are not decided again
    plan = resolve(engine, model_costs(model, chunks, parallel), free, exact=exact and state is None, grad=grad)
    if state is not None and exact:
        plan = plan.ran(state.boundary_every, 0 if state.graphs is None else len(state.graphs.kept))
    return plan
