"""The RL objective: GRPO advantages, the clipped surrogate with KL (`loss`), and reward functions (`rewards`,
imported on its own: it pulls in the built-in problems' verifiers)."""

from .loss import GRPOConfig, LossAgg, branch_loss, group_advantages, token_weights

__all__ = ["GRPOConfig", "LossAgg", "branch_loss", "group_advantages", "token_weights"]
