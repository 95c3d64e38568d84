"""The rollout seam: a `Sampler` draws a GRPO group's answers from a captured prefix state. The training worker
calls the sampler its run config names (`rollout.backend`), never a sampling function directly, so that another
sampler (an inference server such as vLLM or SGLang) plugs in by implementing `Sampler.sample` and registering
itself in `SAMPLERS`.

One implementation today: `NativeSampler`, longstraw's own batched decode on the shared prefix (`rollout.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

from .models.protocol import PrefixLM
from .parallel import ONE_RANK, SequenceGroup
from .rollout import Sample, rollout
from .state import PrefixState


@dataclass(frozen=True)
class SamplingSettings:
    """How a run samples its answers (the same for every group of the run): the decode length, the distribution
    (`temperature` 0 is greedy; `top_k` 0 and `top_p` 1 filter nothing), the ids that end an answer, and whether
    each answer's MoE routing is recorded (routing replay)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    record_routing: bool = False


@dataclass(frozen=True)
class Draw:
    """One call's share of a group: `n` answers, the first being branch `first_branch` of the group, drawn with
    `seed` (branch i from `seed + i`, so that data-parallel slices together draw what one call would)."""

    n: int
    seed: int
    first_branch: int = 0


@runtime_checkable
class Sampler(Protocol):
    """Draws answers to the prompt held by a prefix state. Over a `parallel` group every rank passes its shard of the
    state and the same arguments, and gets the same samples. Each `Sample` carries its tokens, their log-probs at
    temperature 1, their log-probs under the distribution they were drawn from, its finish reason and (with
    `record_routing`) its MoE routing."""

    def sample(self, model: PrefixLM, state: PrefixState, settings: SamplingSettings, draw: Draw,
               parallel: SequenceGroup = ONE_RANK) -> list[Sample]: ...


class NativeSampler:
    """longstraw's decode: every branch of the draw in one batch on the one shared prefix state (`rollout`)."""

    def sample(self, model: PrefixLM, state: PrefixState, settings: SamplingSettings, draw: Draw,
               parallel: SequenceGroup = ONE_RANK) -> list[Sample]:
        return rollout(model, state, **asdict(settings), **asdict(draw), parallel=parallel)


# The samplers a run config may name (`rollout.backend`), each by a factory of its instance.
SAMPLERS: dict[str, Callable[[], Sampler]] = {"native": NativeSampler}


def accepted_backends() -> str:
    return ", ".join(sorted(SAMPLERS))


def check_backend(name: str) -> str:
    """`name` if a sampler is registered under it, else a one-line error naming the accepted values."""
    if name not in SAMPLERS:
        raise ValueError(f"rollout.backend {name!r} is not a known sampler; accepted: {accepted_backends()}")
    return name


def build_sampler(name: str) -> Sampler:
    """The sampler registered as `name` (`rollout.backend`)."""
    return SAMPLERS[check_backend(name)]()
