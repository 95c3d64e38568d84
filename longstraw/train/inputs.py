"""What a GRPO step needs besides the model: the prompt of each group, the checks before any work (`preflight`),
and the rewards and advantages of a rollout (`reward_stage`, run on rank 0 alone). The stages that run on the model
are the ops of `worker.Worker`, kept resident on every rank of the run (spmd.py). The Prefect tasks in
`tasks/stages.py` wrap both one to one.

One step, for each group g (one prompt) and each epoch e:
  capture(g, e) -> rollout(g) [e = 0 only] -> reference(g) [kl_coef > 0] -> reward(g)
  -> replay(g, e, branch slices) per task -> prompt(g, e) [exact mode]; then optimizer(e) [-> checkpoint]
The prompt runs once per step for the policy: the rollout samples from the captured state.
"""

from __future__ import annotations

import time

import torch

from ..data import Example, check_vocab, load_tokenizer
from ..grpo import group_advantages
from ..grpo.rewards import compute_rewards, get_reward
from ..lora import check_lora_targets
from ..models.registry import build, config_from_hf
from ..files import Artefact
from ..store import load_rollout
from .artifacts import save_json
from .config import TrainConfig
from .data import prompt_ids, step_example


def make_prompt(cfg: TrainConfig, step: int, group: int, vocab: int) -> tuple[torch.Tensor, Example]:
    """The token ids of a step's group and its example (generated from the seed, or read from the dataset)."""
    tok = load_tokenizer(cfg.tokenizer)
    ex = step_example(cfg, tok, step, group)
    ids = prompt_ids(tok, ex)
    check_vocab(ids, vocab, f"prompt of step {step} group {group}")
    return torch.tensor(ids, dtype=torch.long), ex


def example_record(ex: Example) -> dict:
    return {"answer": ex.answer, "meta": ex.meta}


# ---- run set-up ---------------------------------------------------------------------------------------------

def preflight(cfg: TrainConfig) -> None:
    """Check what the stages would find only later, before any work: the reward resolves, the task and its
    options make a prompt, the tokenizer covers it, and prompt + answers fit the model's positions."""
    tok = load_tokenizer(cfg.tokenizer)
    ids = prompt_ids(tok, step_example(cfg, tok, 0, 0))
    get_reward(cfg.reward or cfg.task)
    hf = cfg.model.hf_config()
    mc = config_from_hf(hf)
    check_vocab(ids, mc.vocab_size, f"tokenizer {cfg.tokenizer!r}")
    if cfg.lora is not None:  # the targets name modules of this model (checked on a weightless copy)
        with torch.device("meta"):
            check_lora_targets(build(hf), cfg.lora.target_modules)
    if len(ids) - 1 < (sp := cfg.pipeline.sequence_parallel):
        raise ValueError(f"a prompt of {len(ids)} tokens leaves some of the {sp} sequence-parallel ranks without a "
                         "token; raise prompt_tokens or lower pipeline.sp")
    if len(ids) + cfg.max_new_tokens > mc.max_positions:
        raise ValueError(mc.positions_error(f"a prompt of {len(ids):,} tokens (prompt_tokens {cfg.prompt_tokens} and "
                                            f"the chat template) + max_new_tokens {cfg.max_new_tokens}",
                                            len(ids) + cfg.max_new_tokens) + "; or lower prompt_tokens")


# ---- the reward --------------------------------------------------------------------------------------------

def read_rollout(cfg: TrainConfig, rollout: Artefact) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """(response token ids, sampling log-probs, meta with texts and finish reasons) of a stored rollout, in the
    run's store, verified against its digest."""
    return load_rollout(rollout.path, storage_options=cfg.store.storage_options, digest=rollout.sha256)


def reward_stage(cfg: TrainConfig, rollout: dict, step: int, group: int) -> dict:
    """Score the answers of the rollout (an `Artefact`'s JSON) with the reward function and turn them into group
    advantages; returns the stored record's `Artefact` JSON with the reward metrics."""
    t0 = time.perf_counter()
    _, _, meta = read_rollout(cfg, Artefact.from_json(rollout))
    if (ex := meta.get("example")) is None:  # a rollout stored without its example
        ex = example_record(step_example(cfg, load_tokenizer(cfg.tokenizer), step, group))
    prompt_meta = ex["meta"] | {"answer": ex["answer"]}
    fn = get_reward(cfg.reward or cfg.task)
    rewards, failed = compute_rewards(fn, [prompt_meta] * len(meta["texts"]), meta["texts"])
    adv = group_advantages(rewards, scale=cfg.scale_advantages).tolist()
    record = {"rewards": rewards, "advantages": adv, "failed": failed, "texts": meta["texts"]}
    path = str(cfg.paths().step(step) / f"rewards-g{group:03d}.json")
    sha = save_json(path, record)
    n = len(rewards)
    mean = sum(rewards) / n
    return {**Artefact(path, sha).to_json(), "reward_mean": mean, "reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
            "accuracy": sum(r >= 1.0 for r in rewards) / n, "reward_failures": failed,
            "seconds": time.perf_counter() - t0}
