"""The engine: capture a prompt once, replay branches on its state, and get the GRPO gradient in three modes.

One API for every caller (the library's `grpo_backward`, the training pipeline's ops, the benchmarks):
`capture` -> (`rollout`) -> `replay(model, state, branches, loss, dstate)` -> `prompt_backward(model, state, dstate)`,
with `new_dstate(state)` the dLoss/dState buffer exact mode accumulates, `Branches` what the loss needs of the
responses, and `EngineConfig` how it runs (chunk, branch batch, boundaries, graph budget). Nothing else of this
package is meant to be imported from outside it.
"""

from .branches import Branches
from .budget import activation_bytes_per_token, kept_chunk_count
from .capture import PromptGraphs, capture, new_dstate
from .checks import check_state
from .chunks import chunk_ranges
from .config import DEFAULT_CHUNK, EngineConfig, boundary_interval, sqrt_interval
from .entropy import with_entropy_weights
from .grpo import MODES, grpo_backward, naive_backward, naive_entropies, reduce_gradients
from .prompt import prompt_backward
from .replay import group_entropies, replay, score
from .routing import Routing

__all__ = [
    "Branches",
    "DEFAULT_CHUNK",
    "EngineConfig",
    "MODES",
    "PromptGraphs",
    "Routing",
    "activation_bytes_per_token",
    "boundary_interval",
    "capture",
    "check_state",
    "chunk_ranges",
    "grpo_backward",
    "group_entropies",
    "kept_chunk_count",
    "naive_backward",
    "naive_entropies",
    "new_dstate",
    "prompt_backward",
    "reduce_gradients",
    "replay",
    "score",
    "sqrt_interval",
    "with_entropy_weights",
]
