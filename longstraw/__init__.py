"""LongStraw: GRPO on very long prompts. Run the prompt once, replay each response on its state, exact gradient."""

from .engine.backward import MODES, grpo_backward
from .engine.capture import capture
from .engine.replay import score
from .grpo import GRPOConfig, group_advantages
from .lora import add_lora
from .models import SUPPORTED_MODEL_TYPES, build_model, load_model
from .rollout import Sample, rollout
from .state import AttentionState, PrefixState

__all__ = [
    "MODES",
    "SUPPORTED_MODEL_TYPES",
    "AttentionState",
    "GRPOConfig",
    "PrefixState",
    "Sample",
    "add_lora",
    "build_model",
    "capture",
    "group_advantages",
    "grpo_backward",
    "load_model",
    "rollout",
    "score",
]
