"""The RL objective: `GRPOConfig` (TRL's option names), the loss of one branch and the group's token weights
(`loss`), advantages, and reward functions (`rewards`, imported on its own: it pulls in the built-in problems'
verifiers)."""

from .config import GRPOConfig, LossType, RolloutCorrection
from .loss import branch_loss, correction_weights, token_weights, vespo_weight
from .advantages import group_advantages

__all__ = ["GRPOConfig", "LossType", "RolloutCorrection", "branch_loss", "correction_weights", "group_advantages",
           "token_weights", "vespo_weight"]
