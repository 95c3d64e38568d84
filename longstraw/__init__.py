"""LongStraw: GRPO on very long prompts. Run the prompt once, replay each response on its state, exact gradient."""

from .engine import (MODES, Branches, EngineConfig, Routing, capture, grpo_backward, naive_backward, new_dstate,
                     prompt_backward, replay, score)
from .grpo import GRPOConfig, group_advantages
from .lora import add_lora
from .models import SUPPORTED_MODEL_TYPES, build_model, load_model
from .parallel import ONE_RANK, SequenceGroup, SequenceParallel
from .rollout import DecodeOptions, Draw, Sample, SamplingSettings, rollout
from .state import AttentionState, PrefixState

__all__ = [
    "MODES",
    "ONE_RANK",
    "SUPPORTED_MODEL_TYPES",
    "AttentionState",
    "Branches",
    "DecodeOptions",
    "Draw",
    "EngineConfig",
    "GRPOConfig",
    "PrefixState",
    "Routing",
    "Sample",
    "SamplingSettings",
    "SequenceGroup",
    "SequenceParallel",
    "add_lora",
    "build_model",
    "capture",
    "group_advantages",
    "grpo_backward",
    "load_model",
    "naive_backward",
    "new_dstate",
    "prompt_backward",
    "replay",
    "rollout",
    "score",
]
