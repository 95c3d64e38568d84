"""Dense decoder-only transformers: llama, qwen2, qwen3."""

from .config import MODEL_TYPES, DenseConfig
from .model import DenseForCausalLM

__all__ = ["MODEL_TYPES", "DenseConfig", "DenseForCausalLM"]
