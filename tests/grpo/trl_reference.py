"""TRL 1.16's own GRPO loss, called on a transformers model: the reference of tests/grpo/test_trl_parity.py.

`GRPOTrainer.__init__` needs a dataset, a tokenizer, reward functions and a generation backend; `_compute_loss`
needs none of them. So the trainer is made without `__init__` (`object.__new__`) and given the attributes
`_compute_loss` reads, taken from a real `trl.GRPOConfig` the way `__init__` takes them. The model gets TRL's own
fused LM head (`add_fused_lm_head`, as `__init__` adds it), so the log-probs and entropies are TRL's too. Nothing of
the loss is written here: only the batch (TRL's tensor layout) and the sampler correction weights, which TRL
computes inline in `_generate_and_score_completions` (no function to call) and are written out below from it.
"""

from __future__ import annotations

import math
import tempfile
import warnings
from collections import defaultdict

import torch

TRL_VERSION = "1.16.0"  # the options are compared against this version's loss
try:
    import trl
except ImportError as e:
    raise ImportError(f"tests/grpo/test_trl_parity.py calls TRL's GRPO loss: install the dev extras "
                      f"(.venv/bin/pip install -e '.[dev]', which pins trl=={TRL_VERSION})") from e
if trl.__version__ != TRL_VERSION:
    raise ImportError(f"trl {trl.__version__} installed; the parity tests compare against trl {TRL_VERSION}: "
                      f".venv/bin/pip install trl=={TRL_VERSION}")

from accelerate import Accelerator  # noqa: E402  (after the check: trl brings accelerate)
from transformers import TrainerState  # noqa: E402
from trl import GRPOConfig as TrlConfig  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

PAD = 0  # completion padding id: masked out, never scored


def trl_config(**options) -> TrlConfig:
    """TRL's config for one micro-batch that is the whole group: one process, no accumulation, one step per
    generation, so `_compute_loss` normalizes by the group alone, as LongStraw does. (The batch size and
    num_generations only make the config valid; `_compute_loss` reads neither.)"""
    with warnings.catch_warnings():  # TRL 1.16's config sets transformers' deprecated `gradient_checkpointing`
        warnings.filterwarnings("ignore", "`gradient_checkpointing` is deprecated", FutureWarning)
        return TrlConfig(output_dir=tempfile.gettempdir(), use_cpu=True, report_to="none",
                         per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=1,
                         steps_per_generation=1, **options)


def trl_trainer(model: torch.nn.Module, args: TrlConfig) -> GRPOTrainer:
    """A GRPOTrainer holding `model` (patched with TRL's fused head) whose `_compute_loss` runs TRL's code."""
    if not getattr(model, "_trl_fused_head", False):  # patch once: the patch wraps whatever forward it finds
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        model._trl_fused_head = True
    t = object.__new__(GRPOTrainer)
    t.args, t.model, t.accelerator, t.state = args, model, Accelerator(cpu=True), TrainerState()
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    # as GRPOTrainer.__init__ sets them from args
    t.loss_type, t.beta = args.loss_type, args.beta
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.importance_sampling_level = args.importance_sampling_level
    t.off_policy_mask_threshold = args.off_policy_mask_threshold
    t.top_entropy_quantile = args.top_entropy_quantile
    t.max_completion_length = args.max_completion_length
    t.use_vllm = args.use_vllm
    t.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
    t.vllm_importance_sampling_mode = args.vllm_importance_sampling_mode
    t.entropy_coef, t.use_adaptive_entropy = args.entropy_coef, args.use_adaptive_entropy
    t._entropy_bonus_enabled = t.entropy_coef != 0.0 or t.use_adaptive_entropy
    t._last_world_entropy, t._entropy_window_stats = float("inf"), None
    t.aux_loss_enabled = False  # dense and Qwen3.5 have no router
    return t


def rollout_weights(old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, mode: str,
                    lo: float | None, hi: float | None) -> torch.Tensor:
    """TRL's `importance_sampling_ratio` ([G, T], or [G, 1] in the sequence modes) as `_generate_and_score_completions`
    computes it when `use_vllm` and `vllm_importance_sampling_correction`: exp((old - sampler) * mask), summed over
    the response in the sequence modes, clamped to [lo, hi] (truncate) or zeroed outside it (mask)."""
    diff = torch.nan_to_num((old - sampler) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    lo_, hi_ = -math.inf if lo is None else lo, math.inf if hi is None else hi
    return ratio.masked_fill((ratio < lo_) | (ratio > hi_), 0.0)


def pad_right(rows: list[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    width = max(r.numel() for r in rows)
    return torch.stack([torch.cat([r, r.new_full((width - r.numel(),), value)]) for r in rows])


def trl_batch(prompt: torch.Tensor, responses: list[torch.Tensor], advantages: list[float], *, old=None, ref=None,
              sampler=None, truncated=None, rollout: tuple | None = None, generation_logps=None,
              tool_mask: list[torch.Tensor] | None = None) -> dict:
    """The micro-batch `_compute_loss` takes, laid out as `_generate_and_score_completions` leaves it: the prompt
    repeated, completions right-padded, a truncated completion's mask zeroed (`mask_truncated_completions`), and
    `num_items_in_batch` the mask's token count. `rollout` = (mode, lo, hi) adds the sampler correction weights,
    from the trainer's log-probs at generation time: `old`, or `generation_logps` when on-policy (`old` None: TRL
    then leaves `old_per_token_logps` out of the batch and `_compute_loss` takes its own detached log-probs).
    `tool_mask` (bool per token, False on a tool's output) goes in as TRL's `tool_mask` (padded with 1, as TRL pads
    it); `num_items_in_batch` and the correction weights then count the model's tokens only, as TRL computes them."""
    g = len(responses)
    mask = pad_right([torch.ones(r.numel(), dtype=torch.long) for r in responses])
    if truncated is not None:
        mask = mask * (~torch.tensor(truncated)).unsqueeze(1).long()
    loss_mask = mask
    batch = {
        "prompt_ids": prompt.expand(g, -1), "prompt_mask": torch.ones(g, prompt.numel(), dtype=torch.long),
        "completion_ids": pad_right(responses, PAD).long(), "completion_mask": mask,
        "advantages": torch.tensor(advantages, dtype=torch.float32),
    }
    if tool_mask is not None:
        batch["tool_mask"] = pad_right([t.long() for t in tool_mask], 1)
        loss_mask = mask * batch["tool_mask"]
    batch["num_items_in_batch"] = loss_mask.sum()
    for key, rows in (("old_per_token_logps", old), ("ref_per_token_logps", ref),
                      ("sampling_per_token_logps", sampler)):
        if rows is not None:
            batch[key] = pad_right([r.float() for r in rows])
    if rollout is not None:
        trainer = pad_right([r.float() for r in (old if old is not None else generation_logps)])
        batch["importance_sampling_ratio"] = rollout_weights(trainer, batch["sampling_per_token_logps"], loss_mask,
                                                             *rollout)
    return batch


def trl_loss_and_grad(model: torch.nn.Module, args: TrlConfig, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """TRL's loss for `batch` and its gradient, parameter name -> grad."""
    trainer = trl_trainer(model, args)
    model.train()  # _compute_loss normalizes as in training ("train" mode)
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, batch)
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for n, p in model.named_parameters()}
    return loss.item(), grads
