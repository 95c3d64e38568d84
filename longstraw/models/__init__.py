"""Model families. Each family maps transformers `model_type`s to an own PyTorch module with HF names.

One package per family (`dense/`, `qwen3_5/`, `glm_moe_dsa/`: its config and its model) built from the shared
layers in `common/`, and its planner profile (`planner.py`: what `longstraw plan` needs of it); `registry.py` is the
table of families; `checkpoint.py` reads and writes HF checkpoint directories; `protocol.py` states what the engine
needs of a model.
"""

from .checkpoint import load_model, meta_model, read_config, write_weights
from .config import with_rope_scaling
from .protocol import PrefixLM
from .registry import FAMILIES, SUPPORTED_MODEL_TYPES, build_model, config_from_hf

__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "PrefixLM", "build_model", "config_from_hf", "load_model",
           "meta_model", "read_config", "with_rope_scaling", "write_weights"]
