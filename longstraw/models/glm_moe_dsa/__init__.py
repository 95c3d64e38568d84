"""GLM-5 (`glm_moe_dsa`): MLA with the DSA indexer, MoE MLPs after the first dense layers."""

from .config import GlmMoeDsaConfig
from .model import GlmMoeDsaForCausalLM
from .planner import GlmMoeDsaPlanner

MODEL_TYPES = ("glm_moe_dsa",)
PLANNER = GlmMoeDsaPlanner()

__all__ = ["MODEL_TYPES", "PLANNER", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"]
