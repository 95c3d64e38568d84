"""What a GRPO step needs besides the model: the prompt of each group, the checks before any work (`preflight`),
and the rewards and advantages of a rollout (`reward_stage`, run on rank 0 alone). The stages that run on the model
are the ops of `worker.Worker`, kept resident on every rank of the run (spmd.py). The Prefect tasks in
`tasks/stages.py` wrap both one to one.

One step, for each group g (one prompt) and each epoch e:
  capture(g, e) -> rollout(g) [e = 0 only] -> reference(g) [kl_coef > 0] -> reward(g)
  -> replay(g, e, branch slices) per task -> prompt(g, e) [exact mode]; then optimizer(e) [-> checkpoint]
The prompt runs once per step for the policy: the rollout samples from the captured state (with
`moe_routing_replay`, capture(g, e > 0) routes the prompt as capture(g, 0) did). When an advantage
needs every group's rewards (`grpo.scale_rewards` batch, `multi_objective_aggregation` normalize_then_sum), epoch 0
runs capture -> rollout -> reference -> reward for all groups first, then advantages(g) for each (`advantage_stage`),
then each group's replays and prompt backward (its state read back from the store).
"""

from __future__ import annotations

import logging
import math
import re
import time

import torch

from ..agents import ToolChat
from ..agents.builtin import resolve_environment
from ..errors import UserError
from ..data import Example, check_vocab, load_tokenizer, stop_ids
from ..grpo.advantages import advantages, needs_batch, weighted_rewards
from ..grpo.rewards import compute_rewards, get_reward
from ..lora import check_lora_targets
from ..models.common.moe import moe_layers
from ..models.registry import build, config_from_hf
from ..files import Artefact
from ..store import StoredRollout, load_rollout
from .artifacts import load_json, save_json
from .config import ENV_REWARD, TrainConfig
from .data import prompt_ids, step_example

log = logging.getLogger(__name__)


def make_prompt(cfg: TrainConfig, step: int, group: int, vocab: int) -> tuple[torch.Tensor, Example]:
    """The token ids of a step's group and its example (generated from the seed, or read from the dataset)."""
    tok = load_tokenizer(cfg.tokenizer)
    ex = step_example(cfg, tok, step, group)
    ids = prompt_ids(tok, ex)
    check_vocab(ids, vocab, f"prompt of step {step} group {group}")
    return torch.tensor(ids, dtype=torch.long), ex


def example_record(ex: Example) -> dict:
    """What the state and the rollout store of a group's example (not its prompt: the state holds its tokens)."""
    return {"answer": ex.answer, "meta": ex.meta}


def env_example(ex: Example) -> dict:
    """The example an agent's environment is made from: {prompt, answer, meta}."""
    return {"prompt": ex.prompt, **example_record(ex)}


# ---- run set-up ---------------------------------------------------------------------------------------------

def preflight(cfg: TrainConfig) -> None:
    """Check what the stages would find only later, before any work: the reward resolves, the task and its
    options make a prompt, the tokenizer covers it, LoRA's targets and MoE routing replay's experts are in the
    model, and prompt + answers fit the model's positions."""
    tok = load_tokenizer(cfg.tokenizer)
    ids = prompt_ids(tok, step_example(cfg, tok, 0, 0))
    for name in cfg.rewards:
        if name != ENV_REWARD:  # the environment's, stored with the rollout
            get_reward(name)
    if cfg.agent is not None:  # the environment and its tools resolve, the chat format renders them
        ToolChat(tok, resolve_environment(cfg.agent)[1], cfg.stop_tokens)
    hf = cfg.model.hf_config()
    mc = config_from_hf(hf)
    check_vocab(ids, mc.vocab_size, f"tokenizer {cfg.tokenizer!r}")
    check_vocab(stop_ids(tok, cfg.stop_tokens), mc.vocab_size, "stop_tokens")
    if cfg.lora is not None or cfg.moe_routing_replay:  # checked on a weightless copy
        with torch.device("meta"):
            skeleton = build(hf)
        if cfg.lora is not None:  # the targets name modules of this model
            check_lora_targets(skeleton, cfg.lora.target_modules)
        if cfg.moe_routing_replay and not moe_layers(skeleton):
            raise ValueError(f"moe_routing_replay replays the experts a MoE model's tokens were routed to, but this "
                             f"{hf['model_type']} model has no MoE layer; set moe_routing_replay: false")
    # prompt_tokens sizes generated tasks only; a dataset's prompts are as long as the file makes them
    source = (f"prompt_tokens {cfg.prompt_tokens}" if cfg.task is not None
              else f"the first example of {cfg.dataset}")
    if len(ids) - 1 < (sp := cfg.pipeline.sequence_parallel):
        longer = "raise prompt_tokens" if cfg.task is not None else "use longer prompts"
        raise ValueError(f"a prompt of {len(ids)} tokens ({source}) leaves some of the {sp} sequence-parallel ranks "
                         f"without a token; {longer} or lower pipeline.sp")
    if len(ids) + cfg.max_new_tokens > mc.max_positions:
        shorter = "lower prompt_tokens" if cfg.task is not None else "shorten the dataset's prompts"
        raise ValueError(mc.positions_error(f"a prompt of {len(ids):,} tokens ({source} and the chat template) + "
                                            f"max_new_tokens {cfg.max_new_tokens}",
                                            len(ids) + cfg.max_new_tokens) + f"; or {shorter}")


# ---- the reward --------------------------------------------------------------------------------------------

def read_rollout(cfg: TrainConfig, rollout: Artefact) -> StoredRollout:
    """A stored rollout in the run's store (response token ids, their log-probs, the sampler's log-probs or None,
    meta with texts and finish reasons), verified against its digest."""
    return load_rollout(rollout.path, storage_options=cfg.store.storage_options, digest=rollout.sha256)


def reward_stage(cfg: TrainConfig, rollout: dict, step: int, group: int) -> dict:
    """Score the answers of the rollout (an `Artefact`'s JSON) with each reward function and, when they need no
    other group's rewards, turn them into the group's advantages; returns the stored record's `Artefact` JSON with
    the reward metrics (the weighted reward's and each function's mean) and those advantages, which the flow sends
    to every rank's replay. The record holds each function's rewards
    (None: it does not apply to that answer), their weighted sum ("rewards", None: no function applies) and the
    advantages the replay reads (else `advantage_stage` writes them)."""
    t0 = time.perf_counter()
    meta = read_rollout(cfg, Artefact.from_json(rollout)).meta
    if ENV_REWARD in cfg.rewards and "agent" not in meta:
        raise ValueError(f"reward {ENV_REWARD!r} reads the environments' rewards stored with the rollout, but the "
                         f"rollout at {rollout['path']} holds none (sampled without an agent); delete it so that its "
                         "step samples it again")
    if (ex := meta.get("example")) is None:  # a rollout stored without its example
        ex = example_record(step_example(cfg, load_tokenizer(cfg.tokenizer), step, group))
    prompt_meta = ex["meta"] | {"answer": ex["answer"]}
    texts = meta["texts"]
    per_function, failed = {}, 0
    for name in cfg.rewards:
        if name == ENV_REWARD:
            # None: the environment gave none. A branch cut short before it did (its budget or max_turns spent)
            # failed the task and scores 0, else a policy that rambles past every feedback would never be
            # pushed back; an environment that saw the branch end and gave no reward means it does not apply (NaN)
            given = [float(r) if r is not None else 0.0 if reason in ("length", "turns") else math.nan
                     for r, reason in zip(meta["agent"]["rewards"], meta["finish_reasons"], strict=True)]
            bad = sum(math.isinf(r) for r in given)  # scored 0.0 and counted, as a reward function's would be
            per_function[name] = [0.0 if math.isinf(r) else r for r in given]
            failed += bad
            continue
        got = compute_rewards(get_reward(name), [prompt_meta] * len(texts), texts)
        per_function[name] = got.rewards
        failed += got.failed
        _check_nans(cfg, name, got.nan, len(texts), step, group)
    table = _table([per_function], cfg.rewards)
    weighted = weighted_rewards(table, _weights(cfg))
    record = {"rewards": _json_floats(weighted),
              "rewards_per_function": {k: _json_floats(v) for k, v in per_function.items()},
              "failed": failed, "texts": texts}
    if not needs_batch_advantages(cfg):
        record["advantages"] = _advantages(cfg, table).tolist()
    path = str(cfg.paths().step(step) / f"rewards-g{group:03d}.json")
    sha = save_json(path, record)
    scored = weighted[~weighted.isnan()].tolist()
    n = max(len(scored), 1)
    mean = sum(scored) / n
    out = {**Artefact(path, sha).to_json(), "reward_mean": mean,
           "reward_std": (sum((r - mean) ** 2 for r in scored) / n) ** 0.5,
           "accuracy": sum(r >= 1.0 for r in scored) / n, "reward_failures": failed,
           "reward_unscorable": len(texts) - len(scored)}
    if "advantages" in record:
        out["advantages"] = record["advantages"]
    for name, values in per_function.items():  # TRL's rewards/<name>/mean, over the answers it applies to
        if present := [v for v in values if not math.isnan(v)]:
            out[reward_metric(name)] = sum(present) / len(present)
    return out | {"seconds": time.perf_counter() - t0}


def _check_nans(cfg: TrainConfig, name: str, nans: int, n: int, step: int, group: int) -> None:
    """Stop the run when more than `reward_nan_max_share` of the group's answers scored NaN; else one warning."""
    if not nans:
        return
    share = nans / max(n, 1)
    if share > cfg.reward_nan_max_share:
        raise UserError(
            f"reward {name} returned NaN for {nans} of {n} answers ({share:.0%}) in step {step} group {group}, more "
            f"than reward_nan_max_share {cfg.reward_nan_max_share:g}: fix the reward function (return None for an "
            "answer it does not apply to), or raise reward_nan_max_share in the config")
    log.warning("reward %s: %d of %d samples NaN in step %d group %d, each scored 0.0 and counted in "
                "reward_failures", name, nans, n, step, group)


def advantage_stage(cfg: TrainConfig, rewards: list[dict], step: int, group: int) -> dict:
    """The advantages of one group when they depend on the whole step's rewards (`grpo.scale_rewards` batch, or
    `multi_objective_aggregation` normalize_then_sum): read every group's reward record (`rewards`: their
    `Artefact`s' JSON, in group order), compute all advantages, store this group's as the record the replay reads;
    returns its `Artefact` JSON with the advantages."""
    t0 = time.perf_counter()
    records = [load_json(a.path, a.sha256) for a in map(Artefact.from_json, rewards)]
    adv = _advantages(cfg, _table([r["rewards_per_function"] for r in records], cfg.rewards))
    g = cfg.responses
    record = {"rewards": records[group]["rewards"], "advantages": adv[group * g:(group + 1) * g].tolist()}
    path = str(cfg.paths().step(step) / f"advantages-g{group:03d}.json")
    return {**Artefact(path, save_json(path, record)).to_json(), "advantages": record["advantages"],
            "seconds": time.perf_counter() - t0}


def reward_metric(name: str) -> str:
    """The metric of a reward function's mean: TRL's `rewards/<name>/mean`, the name made a valid MLflow key."""
    return f"rewards/{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}/mean"


def needs_batch_advantages(cfg: TrainConfig) -> bool:
    """Whether the run's advantages need the whole step's rewards before any replay (`grpo.scale_rewards` batch, or
    `multi_objective_aggregation` normalize_then_sum): then the reward stage stores none, the flow scores every
    group first and `advantage_stage` computes them."""
    return needs_batch(cfg.grpo.scale_rewards, cfg.grpo.multi_objective_aggregation)


def _weights(cfg: TrainConfig) -> torch.Tensor:
    w = cfg.grpo.reward_weights
    return torch.ones(len(cfg.rewards), dtype=torch.float64) if w is None else torch.tensor(w, dtype=torch.float64)


def _table(groups: list[dict[str, list]], names: list[str]) -> torch.Tensor:
    """[answers, functions] float64 rewards, group after group (None and NaN: the function does not apply)."""
    rows = [[math.nan if g[k][i] is None else g[k][i] for k in names] for g in groups for i in range(len(g[names[0]]))]
    return torch.tensor(rows, dtype=torch.float64)


def _advantages(cfg: TrainConfig, table: torch.Tensor) -> torch.Tensor:
    p = cfg.grpo
    return advantages(table, cfg.responses, p.reward_weights, p.scale_rewards, p.multi_objective_aggregation)


def _json_floats(values) -> list[float | None]:
    """NaN as None: JSON has no NaN."""
    return [None if math.isnan(v) else v for v in (values.tolist() if torch.is_tensor(values) else values)]
