"""Dense decoder-only transformers: llama, qwen2, qwen3."""

from .config import MODEL_TYPES, DenseConfig
from .model import DenseForCausalLM
from .planner import DensePlanner

PLANNER = DensePlanner()

__all__ = ["MODEL_TYPES", "PLANNER", "DenseConfig", "DenseForCausalLM"]
