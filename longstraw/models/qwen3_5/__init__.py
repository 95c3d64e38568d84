"""Qwen3.5: Gated DeltaNet linear layers with every n-th layer gated full attention."""

from .config import MODEL_TYPES, Qwen35Config
from .model import Qwen35ForCausalLM

__all__ = ["MODEL_TYPES", "Qwen35Config", "Qwen35ForCausalLM"]
