"""The engine: capture a prompt once, replay branches on its state, and get the GRPO gradient in three modes.

One API for every caller (the library's `grpo_backward`, the training pipeline's ops, the benchmarks):
`capture` -> (`rollout`) -> `replay(model, state, branches, loss, dstate)` -> `prompt_backward(model, state, dstate)`,
with `new_dstate(state)` the dLoss/dState buffer exact mode accumulates, `Branches` what the loss needs of the
responses, and `EngineConfig` how it runs (chunk, branch batch, boundaries, graph budget), which every entry point
takes as `engine=` and resolves into one `Plan` per group (engine/policy.py; `plan=` passes one resolved before).
Nothing else of this package is meant to be imported from outside it.
"""

from .branches import Branches
from .budget import activation_bytes_per_token
from .capture import PromptGraphs, capture, new_dstate
from .checks import check_state
from .chunks import chunk_ranges
from .config import DEFAULT_CHUNK, EngineConfig
from .entropy import with_entropy_weights
from .gradients import reduce_gradients
from .grpo import MODES, grpo_backward, naive_backward, naive_entropies, naive_plan
from .policy import Plan, plan_group, sqrt_interval
from .prompt import prompt_backward
from .replay import group_entropies, replay, score
from .routing import Routing

__all__ = [
    "Branches",
    "DEFAULT_CHUNK",
    "EngineConfig",
    "MODES",
    "Plan",
    "PromptGraphs",
    "Routing",
    "activation_bytes_per_token",
    "capture",
    "check_state",
    "chunk_ranges",
    "grpo_backward",
    "group_entropies",
    "naive_backward",
    "naive_entropies",
    "naive_plan",
    "new_dstate",
    "plan_group",
    "prompt_backward",
    "reduce_gradients",
    "replay",
    "score",
    "sqrt_interval",
    "with_entropy_weights",
]
