"""The stages of a GRPO step as plain functions: inputs are paths, URLs and small numbers; outputs are small
JSON-able dicts naming what was written (with its sha256) and the stage's metrics. The Prefect tasks in `tasks/`
wrap these one to one; anything else (a script, another orchestrator) can call them the same way.

One step, for each group g (one prompt) and each epoch e:
  capture(g, e) -> rollout(g) [e = 0 only] -> reference(g) [kl_coef > 0] -> reward(g)
  -> replay(g, e, branches) for each branch slice -> prompt_backward(g, e) [exact mode] -> optimizer(e) -> checkpoint
The prompt runs once per step for the policy: the rollout samples from the captured (stored) state.
"""

from __future__ import annotations

import time

import torch
from fsspec.core import url_to_fs
from torch import nn

from ..config import torch_dtype
from ..data import Example, check_vocab, load_tokenizer
from ..engine.backward import naive_backward, replay_backward, stored_prompt_backward
from ..engine.capture import capture
from ..engine.replay import score
from ..files import remove_stale_temporaries
from ..grpo import group_advantages, token_weights
from ..grpo.rewards import compute_rewards, get_reward
from ..memory import PeakMeter
from ..models import build_model, load_model
from ..models.checkpoint import read_config
from ..models.registry import config_from_hf
from ..rollout import rollout
from ..store import load_state, manifest_digest, read_manifest, save_rollout, save_state
from ..store import load_rollout as store_load_rollout
from .artifacts import load_json, load_tensors, save_json, save_tensors
from .checkpoint import latest_checkpoint, load_checkpoint, read_trainer, save_checkpoint
from .config import TrainConfig
from .data import example_seed, prompt_ids, step_example
from .optim import build_optimizer, optimizer_step

# `peak_bytes` in the outputs is PeakMeter's: CUDA allocator peak, or on CPU the process's RSS peak while the
# stage ran, which stages running at the same time in one process share.


def _setup(cfg: TrainConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)


def _policy(cfg: TrainConfig, checkpoint: str) -> tuple[nn.Module, str]:
    """The model of a verified checkpoint, in eval mode, and its weights version."""
    meta = read_trainer(checkpoint)
    model = load_model(checkpoint, dtype=torch_dtype(cfg.dtype)).eval()
    return model, meta["weights_version"]


def _prompt(cfg: TrainConfig, step: int, group: int, vocab: int) -> tuple[torch.Tensor, Example]:
    tok = load_tokenizer(cfg.tokenizer)
    ex = step_example(cfg, tok, step, group)
    ids = prompt_ids(tok, ex)
    check_vocab(ids, vocab, f"prompt of step {step} group {group}")
    return torch.tensor(ids, dtype=torch.long), ex


def _example_record(ex: Example) -> dict:
    return {"answer": ex.answer, "meta": ex.meta}


def _stored_example(cfg: TrainConfig, state: dict | str) -> dict | None:
    """The example the capture stage stored with the state (None for a state stored without one)."""
    url = state if isinstance(state, str) else state["url"]
    return read_manifest(url, cfg.store.storage_options).get("extra", {}).get("example")


def _ref(path: str, sha: str) -> dict:
    return {"path": path, "sha256": sha}


# ---- run set-up ---------------------------------------------------------------------------------------------

def missing_artefacts(out: dict) -> list[str]:
    """The artefacts a stage's result names (`checkpoint`, `path`, `url`: local paths or fsspec URLs, e.g. a
    rollout in an s3 store) that are not there (any more)."""
    gone = []
    for key in ("checkpoint", "path", "url"):
        if key in out:
            fs, where = url_to_fs(out[key])
            if not fs.exists(where):
                gone.append(out[key])
    return gone


def preflight(cfg: TrainConfig) -> None:
    """Check what the stages would find only later, before any work: the reward resolves, the task and its
    options make a prompt, the tokenizer covers it, and prompt + answers fit the model's positions."""
    tok = load_tokenizer(cfg.tokenizer)
    ids = prompt_ids(tok, step_example(cfg, tok, 0, 0))
    get_reward(cfg.reward or cfg.task)
    hf = read_config(cfg.model.path) if cfg.model.path else cfg.model.random
    mc = config_from_hf(hf)
    check_vocab(ids, mc.vocab_size, f"tokenizer {cfg.tokenizer!r}")
    if len(ids) + cfg.max_new_tokens > mc.max_position_embeddings:
        raise ValueError(f"a prompt of {len(ids)} tokens (prompt_tokens {cfg.prompt_tokens} and the chat template) "
                         f"+ max_new_tokens {cfg.max_new_tokens} exceeds the model's max_position_embeddings "
                         f"{mc.max_position_embeddings}; lower prompt_tokens or use a long-context checkpoint")


def init_run(cfg: TrainConfig) -> dict:
    """The checkpoint to continue from: the run's latest, or update 0 made from the configured model."""
    _setup(cfg)
    paths = cfg.paths()
    remove_stale_temporaries(paths.checkpoints)  # a kill mid-commit leaves one; the run lock makes this safe
    latest = latest_checkpoint(paths.checkpoints)
    if latest is None:
        torch.manual_seed(cfg.seed)
        dtype = torch_dtype(cfg.dtype)
        model = load_model(cfg.model.path, dtype=dtype) if cfg.model.path else build_model(cfg.model.random, dtype)
        tok = load_tokenizer(cfg.tokenizer)
        check_vocab([tok.vocab_size - 1], model.config.vocab_size, f"tokenizer {cfg.tokenizer!r}")
        latest = save_checkpoint(paths.checkpoint(0), model, build_optimizer(model, cfg.optim), update=0, step=0, extra={})
    meta = read_trainer(latest)
    return {"checkpoint": str(latest), "update": meta["update"], "weights_version": meta["weights_version"]}


# ---- stages -------------------------------------------------------------------------------------------------

def capture_stage(cfg: TrainConfig, checkpoint: str, step: int, group: int, epoch: int) -> dict:
    """Capture the group's prompt with the checkpoint's weights and commit its prefix state to the store."""
    _setup(cfg)
    model, version = _policy(cfg, checkpoint)
    prompt, ex = _prompt(cfg, step, group, model.config.vocab_size)
    url = f"{cfg.paths().store_url}/states/step-{step:06d}/group-{group:03d}/epoch-{epoch:02d}"
    with PeakMeter() as m:
        state = capture(model, prompt, cfg.grpo.prompt_chunk)
        # the example goes with the state: the reward reads its answer from there instead of regenerating it
        manifest = save_state(state, url, weights_version=version, shard_tokens=cfg.store.shard_tokens,
                              storage_options=cfg.store.storage_options, extra={"example": _example_record(ex)})
    return {"url": url, "sha256": manifest_digest(manifest), "weights_version": version,
            "prompt_tokens": prompt.numel(), "state_bytes": state.nbytes,
            "peak_bytes": m.peak_bytes, "seconds": m.seconds, "tokens_per_s": prompt.numel() / max(m.seconds, 1e-9)}


def _load_state(cfg: TrainConfig, model: nn.Module, version: str, state: dict | str):
    """The stored prefix state of a capture stage's result ({url, sha256}: its manifest checked against the
    digest) or of a bare URL."""
    url, digest = (state, None) if isinstance(state, str) else (state["url"], state["sha256"])
    return load_state(url, model=model, weights_version=version, storage_options=cfg.store.storage_options,
                      digest=digest)


def rollout_stage(cfg: TrainConfig, checkpoint: str, state: dict | str, step: int, group: int) -> dict:
    """Sample G answers from the stored prefix state (shared by all branches) and store them."""
    _setup(cfg)
    model, version = _policy(cfg, checkpoint)
    tok = load_tokenizer(cfg.tokenizer)
    with PeakMeter() as m:
        prefix = _load_state(cfg, model, version, state)
        samples = rollout(model, prefix, n=cfg.responses, max_new_tokens=cfg.max_new_tokens,
                          temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, stop_ids=[tok.eos_id],
                          seed=example_seed(cfg.seed, step, group))
    lengths = [s.tokens.numel() for s in samples]
    meta = {"finish_reasons": [s.finish_reason for s in samples],
            "texts": [tok.decode(s.tokens.tolist()) for s in samples], "example": _stored_example(cfg, state)}
    url = f"{cfg.paths().store_url}/rollouts/step-{step:06d}/group-{group:03d}"
    manifest = save_rollout(url, [s.tokens for s in samples], [s.logprobs for s in samples], meta,
                            storage_options=cfg.store.storage_options)
    return {**_ref(url, manifest_digest(manifest)), "responses": len(samples),
            "response_len_mean": sum(lengths) / len(lengths), "peak_bytes": m.peak_bytes, "seconds": m.seconds,
            "tokens_per_s": sum(lengths) / max(m.seconds, 1e-9)}


def load_rollout(cfg: TrainConfig, ref: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """(response token ids, sampling log-probs, meta with texts and finish reasons) of a stored rollout."""
    return store_load_rollout(ref["path"], storage_options=cfg.store.storage_options, digest=ref["sha256"])


def reference_stage(cfg: TrainConfig, ref_checkpoint: str, rollout_ref: dict, step: int, group: int) -> dict:
    """Log-probs of the sampled answers under the frozen initial weights (for the KL term)."""
    _setup(cfg)
    model, _ = _policy(cfg, ref_checkpoint)
    prompt, _ = _prompt(cfg, step, group, model.config.vocab_size)
    responses, _, _ = load_rollout(cfg, rollout_ref)
    with PeakMeter() as m:
        state = capture(model, prompt, cfg.grpo.prompt_chunk)
        logps = score(model, state, responses, cfg.grpo.branch_batch)
    path = str(cfg.paths().step(step) / f"reference-g{group:03d}.safetensors")
    sha = save_tensors(path, {f"logprobs.{i}": lp for i, lp in enumerate(logps)})
    return {**_ref(path, sha), "peak_bytes": m.peak_bytes, "seconds": m.seconds}


def reward_stage(cfg: TrainConfig, rollout_ref: dict, step: int, group: int) -> dict:
    """Score the answers with the reward function and turn them into group advantages."""
    t0 = time.perf_counter()
    _, _, meta = load_rollout(cfg, rollout_ref)
    if (ex := meta.get("example")) is None:  # a rollout stored without its example
        ex = _example_record(step_example(cfg, load_tokenizer(cfg.tokenizer), step, group))
    prompt_meta = ex["meta"] | {"answer": ex["answer"]}
    fn = get_reward(cfg.reward or cfg.task)
    rewards, failed = compute_rewards(fn, [prompt_meta] * len(meta["texts"]), meta["texts"])
    adv = group_advantages(rewards, scale=cfg.scale_advantages).tolist()
    record = {"rewards": rewards, "advantages": adv, "failed": failed, "texts": meta["texts"]}
    path = str(cfg.paths().step(step) / f"rewards-g{group:03d}.json")
    sha = save_json(path, record)
    n = len(rewards)
    mean = sum(rewards) / n
    return {**_ref(path, sha), "reward_mean": mean, "reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
            "accuracy": sum(r >= 1.0 for r in rewards) / n, "reward_failures": failed,
            "seconds": time.perf_counter() - t0}


def _grad_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"param.{n}": p.grad for n, p in model.named_parameters() if p.grad is not None}


def replay_stage(
    cfg: TrainConfig, checkpoint: str, state: dict | str | None, rollout_ref: dict, reward_ref: dict,
    reference_ref: dict | None, step: int, group: int, epoch: int, branches: list[int],
) -> dict:
    """Replay some branches of a group with autograd; store their parameter gradients and, in exact mode, their
    gradient of the prefix state (summed over these branches)."""
    _setup(cfg)
    model, version = _policy(cfg, checkpoint)
    responses, sample_logps, _ = load_rollout(cfg, rollout_ref)
    record = load_json(reward_ref["path"], reward_ref["sha256"])
    weights_all = token_weights([r.numel() for r in responses], cfg.grpo)
    pick = lambda xs: [xs[i] for i in branches]  # noqa: E731
    resp, weights = pick(responses), pick(weights_all)
    adv = torch.tensor(pick(record["advantages"]), dtype=torch.float64)
    old = pick(sample_logps) if cfg.epochs > 1 else None  # several epochs: ratios against the sampling policy
    ref = None
    if reference_ref is not None:
        t = load_tensors(reference_ref["path"], reference_ref["sha256"])
        ref = [t[f"logprobs.{i}"] for i in branches]
    totals = {"loss": 0.0, "clipped_tokens": 0.0, "kl_sum": 0.0}
    tensors: dict[str, torch.Tensor] = {}
    model.zero_grad(set_to_none=True)
    with PeakMeter() as m:
        if cfg.mode == "naive":
            prompt, _ = _prompt(cfg, step, group, model.config.vocab_size)
            naive_backward(model, prompt, resp, adv, weights, cfg.grpo, old, ref, totals)
        else:
            prefix = _load_state(cfg, model, version, state)
            grad = prefix.grad_buffer() if cfg.mode == "exact" else None
            replay_backward(model, prefix, resp, adv, weights, cfg.grpo, old, ref, grad, totals, mode=cfg.mode)
            for i, g in (grad or {}).items():
                tensors |= {f"state.{i}.{name}": t for name, t in g.named_tensors().items()}
    tensors |= _grad_tensors(model)
    tokens = sum(r.numel() for r in resp)
    path = str(cfg.paths().step(step) / f"replay-g{group:03d}-e{epoch:02d}-b{branches[0]:04d}.safetensors")
    sha = save_tensors(path, tensors)
    return {**_ref(path, sha), "branches": branches, "loss": totals["loss"], "clipped_tokens": totals["clipped_tokens"],
            "kl_sum": totals["kl_sum"], "tokens": tokens, "peak_bytes": m.peak_bytes, "seconds": m.seconds,
            "tokens_per_s": tokens / max(m.seconds, 1e-9)}


def prompt_stage(cfg: TrainConfig, checkpoint: str, state: dict | str, replay_refs: list[dict], step: int,
                 group: int, epoch: int) -> dict:
    """Exact mode: sum the branches' prefix-state gradients and back-propagate them through the prompt."""
    _setup(cfg)
    model, version = _policy(cfg, checkpoint)
    model.zero_grad(set_to_none=True)
    with PeakMeter() as m:
        prefix = _load_state(cfg, model, version, state)
        grad = prefix.grad_buffer()
        for r in replay_refs:  # in branch order, so every run sums the same way
            t = load_tensors(r["path"], r["sha256"])
            for i, g in grad.items():
                for name, buf in g.named_tensors().items():
                    buf += t[f"state.{i}.{name}"].to(buf)
        stored_prompt_backward(model, prefix, grad)
    path = str(cfg.paths().step(step) / f"prompt-g{group:03d}-e{epoch:02d}.safetensors")
    sha = save_tensors(path, _grad_tensors(model))
    return {**_ref(path, sha), "peak_bytes": m.peak_bytes, "seconds": m.seconds,
            "tokens_per_s": prefix.length / max(m.seconds, 1e-9)}


def optimizer_stage(cfg: TrainConfig, checkpoint: str, grad_refs: list[dict], update: int, step: int) -> dict:
    """Sum the stored gradients (fixed order), clip, AdamW step, and commit the next checkpoint."""
    _setup(cfg)
    t0 = time.perf_counter()
    factory = lambda model: build_optimizer(model, cfg.optim)  # noqa: E731
    model, optimizer, _ = load_checkpoint(checkpoint, factory, torch_dtype(cfg.dtype))
    params = dict(model.named_parameters())
    for r in grad_refs:
        for key, g in load_tensors(r["path"], r["sha256"]).items():
            if not key.startswith("param."):
                continue  # prefix-state gradients: the prompt stage's input, not the optimizer's
            p = params[key.removeprefix("param.")]
            p.grad = g.to(p).clone() if p.grad is None else p.grad.add_(g.to(p))
    stats = optimizer_step(model, optimizer, cfg.optim, update, cfg.updates)
    out = save_checkpoint(cfg.paths().checkpoint(update + 1), model, optimizer, update=update + 1, step=step,
                          extra={"skipped_update": bool(stats["skipped"])})
    version = read_trainer(out)["weights_version"]  # verified as it was written: no second pass
    return {"checkpoint": str(out), "update": update + 1, "weights_version": version, **stats,
            "seconds": time.perf_counter() - t0}
