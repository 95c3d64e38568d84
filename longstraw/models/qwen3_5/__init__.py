"""Qwen3.5: Gated DeltaNet linear layers with every n-th layer gated full attention."""

from .config import MODEL_TYPES, Qwen35Config
from .model import Qwen35ForCausalLM
from .planner import Qwen35Planner

PLANNER = Qwen35Planner()

__all__ = ["MODEL_TYPES", "PLANNER", "Qwen35Config", "Qwen35ForCausalLM"]
