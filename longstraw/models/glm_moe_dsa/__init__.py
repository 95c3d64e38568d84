"""GLM-5 (`glm_moe_dsa`): MLA with the DSA indexer, MoE MLPs after the first dense layers."""

from .config import GlmMoeDsaConfig
from .model import GlmMoeDsaForCausalLM

MODEL_TYPES = ("glm_moe_dsa",)

__all__ = ["MODEL_TYPES", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"]
