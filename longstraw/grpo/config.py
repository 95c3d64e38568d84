"""`GRPOConfig`: the RL objective in TRL's words (1.16's `GRPOConfig`), with LongStraw's clip and KL names.

TRL name -> LongStraw name: `epsilon` -> `clip_low`, `epsilon_high` -> `clip_high`, `beta` -> `kl_coef`,
`vllm_importance_sampling_mode` / `_clip_min` / `_clip_max` -> `rollout_correction` / `_min` / `_max` (off unless
set). Every other option has TRL's name and meaning. Defaults that differ from TRL's: `loss_type` "grpo" (TRL:
"dapo"), `use_bias_correction_kl` false (TRL: true), `rollout_correction` "off" (TRL: on, with vLLM).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossType = Literal["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"]
RolloutCorrection = Literal["off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
# the options LongStraw had before it took TRL's names: old name -> what to write instead
REPLACED = {
    "loss_agg": "loss_type (seq_mean_token_mean -> grpo, token_mean -> dapo, seq_mean_token_sum_norm -> dr_grpo)",
    "norm_len": "max_completion_length (dr_grpo's constant length divisor)",
    "epsilon": "clip_low", "epsilon_high": "clip_high", "beta": "kl_coef",
    "vllm_importance_sampling_mode": "rollout_correction", "vllm_importance_sampling_correction": "rollout_correction",
    "vllm_importance_sampling_clip_min": "rollout_correction_min",
    "vllm_importance_sampling_clip_max": "rollout_correction_max",
}


class GRPOConfig(BaseModel):
    """The GRPO objective: the loss type, its ratio and clipping, masks, KL, entropy bonus, sampler correction and
    reward aggregation. How the engine computes its gradient is `EngineConfig`."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    loss_type: LossType = Field(
        "grpo", description="grpo: per-sequence token mean, then mean over the group; bnpo / dapo / cispo / vespo: "
        "mean over the group's tokens; dr_grpo: sum / (G * max_completion_length); luspo: per-sequence token sum, "
        "mean over the group; sapo: soft gate, aggregated as grpo. cispo, sapo, vespo change the surrogate itself")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="token: one ratio per token; sequence: exp(mean log-ratio) of the response for all its "
        "tokens (GSPO)")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="ratio clipped below at 1 - clip_low (TRL: epsilon)")
    clip_high: float = Field(
        0.2, ge=0.0, description="ratio clipped above at 1 + clip_high (TRL: epsilon_high; DAPO's clip-higher); "
        "cispo: the ratio's upper bound itself (ScaleRL's eps_max, e.g. 5.0)")
    delta: float | None = Field(None, gt=1.0, description="two-sided clipping (INTELLECT-2): the unclipped ratio "
                                "also capped at delta (> 1 + clip_high)")
    kl_coef: float = Field(0.0, ge=0.0, description="weight of the k3 KL estimator to the reference (TRL: beta)")
    use_bias_correction_kl: bool = Field(
        False, description="multiply the KL term by the (differentiable) ratio: the unbiased reverse-KL gradient "
        "(DeepSeek-V3.2; TRL's default)")
    sapo_temperature_neg: float = Field(1.05, gt=0.0, description="sapo: gate temperature of advantages <= 0")
    sapo_temperature_pos: float = Field(1.0, gt=0.0, description="sapo: gate temperature of advantages > 0")
    vespo_k_pos: float = Field(2.0, description="vespo: power of the Gamma weight, advantages >= 0")
    vespo_lambda_pos: float = Field(3.0, description="vespo: decay of the Gamma weight, advantages >= 0")
    vespo_k_neg: float = Field(3.0, description="vespo: power of the Gamma weight, advantages < 0")
    vespo_lambda_neg: float = Field(2.0, description="vespo: decay of the Gamma weight, advantages < 0")
    off_policy_mask_threshold: float | None = Field(
        None, gt=0.0, description="DeepSeek-V3.2's off-policy sequence mask: a response of negative advantage whose "
        "mean (sampler - trainer) log-prob exceeds this is dropped from the policy loss")
    top_entropy_quantile: float = Field(
        1.0, ge=0.0, le=1.0, description="keep in the policy loss only the tokens whose entropy is in the group's "
        "top quantile (Beyond the 80/20 rule: 0.2); 1.0 keeps all")
    entropy_coef: float = Field(0.0, ge=0.0, description="entropy bonus: loss - entropy_coef * mean token entropy "
                                "(over the tokens the policy loss keeps), with its own gradient")
    mask_truncated_completions: bool = Field(False, description="responses that hit max_new_tokens without a stop "
                                             "token add nothing to the loss (DAPO)")
    max_completion_length: int | None = Field(
        None, ge=1, description="dr_grpo's constant length divisor; default: the group's longest response")
    rollout_correction: RolloutCorrection = Field(
        "off", description="correct the sampler/trainer mismatch by importance weights exp(trainer - sampler "
        "log-prob) per token or per sequence, truncated to [min, max] or masked outside it (TRL's "
        "vllm_importance_sampling_mode)")
    rollout_correction_min: float | None = Field(None, ge=0.0, description="lower bound of the correction weight")
    rollout_correction_max: float | None = Field(3.0, gt=0.0, description="upper bound of the correction weight")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="divide advantages by the std of the group, of the step's batch, or not (Dr. GRPO)")
    reward_weights: list[float] | None = Field(None, description="one weight per reward function (default all 1)")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="several rewards: weighted sum then normalize, or normalize each in its "
        "group, sum, then normalize over the batch (GDPO)")

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, data):
        if not isinstance(data, dict):
            return data
        old = sorted(k for k in REPLACED if k in data)
        if old:
            raise ValueError("; ".join(f"grpo option {k!r} is now {REPLACED[k]}" for k in old))
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "GRPOConfig":
        if self.loss_type == "cispo" and self.clip_high < 1.0:
            raise ValueError(f"loss_type cispo caps the ratio at clip_high itself (TRL's epsilon_high, ScaleRL's "
                             f"eps_max), and clip_high {self.clip_high} < 1 would cap every on-policy token; set "
                             "clip_high to e.g. 5.0")
        if self.delta is not None and self.delta <= 1.0 + self.clip_high:
            raise ValueError(f"delta {self.delta} must exceed 1 + clip_high ({1.0 + self.clip_high}), or the upper "
                             "clip would never act; raise delta or leave it unset")
        lo, hi = self.rollout_correction_min, self.rollout_correction_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"rollout_correction_min {lo} must be below rollout_correction_max {hi}")
        if self.rollout_correction.endswith("truncate") and lo is None and hi is None:
            raise ValueError(f"rollout_correction {self.rollout_correction} truncates the weights to "
                             "[rollout_correction_min, rollout_correction_max]: set at least one of them")
        if self.loss_type == "vespo" and self.rollout_correction.startswith("sequence"):
            raise ValueError("loss_type vespo takes the sampler correction into its sequence weight token by token: "
                             "set rollout_correction to token_truncate or token_mask (or off)")
        if self.reward_weights is not None and not self.reward_weights:
            raise ValueError("reward_weights is empty; give one weight per reward function, or leave it unset")
        return self

    @property
    def entropy_needed(self) -> bool:
        """Whether the loss needs each token's entropy (the top-entropy mask or the bonus)."""
        return self.top_entropy_quantile < 1.0 or self.entropy_coef > 0.0
