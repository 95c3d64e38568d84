"""`grpo_train`: the GRPO training flow. Each step is a subflow chaining the stage tasks of `tasks/stages.py`.

The flow holds no tensors: stages exchange paths/URLs with sha256s, and the model stages run on the run's
resident ranks (longstraw/train/spmd.py). It starts from the run directory's latest checkpoint, so running it
again on the same config (or `longstraw resume`) continues a failed run; stages whose output was stored before
the failure are taken from the cache, not recomputed.
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

from fsspec.core import url_to_fs
from prefect import Task, flow, get_run_logger
from prefect.runtime import flow_run
from tqdm.auto import tqdm

from longstraw.files import Artefact, CorruptArtefact
from longstraw.train.artifacts import load_json, save_json
from longstraw.train import spmd
from longstraw.train.checkpoint import latest_checkpoint
from longstraw.train.config import TrainConfig
from longstraw.train.lock import RunLock
from longstraw.train.spmd import Driver
from longstraw.train.inputs import needs_batch_advantages, preflight
from longstraw.train.worker import Worker
from longstraw.version import code_digest
from tasks import stages, tracking
from tasks.run import Run, rooted
from tasks.stages import configured

from .launch import launch_ranks

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _run_stage(stage: Task, args: dict, *, run: Run, parent: str | None) -> dict:
    """Run one stage task and wait for it. A cached result whose artefact is gone (a deleted state, rollout or
    file) runs again."""
    t = configured(stage, run.config)
    # results name the run directory's files relative to it (tasks.run.portable): here, under where it is now
    out = rooted(t(run, **args, parent_run_id=parent), run.config.run_dir)
    if gone := missing_artefacts(out):
        get_run_logger().warning("%s: the cached result names artefacts that are gone (%s); computing it again",
                                 stage.name, gone[0])
        out = rooted(t.with_options(refresh_cache=True)(run, **args, parent_run_id=parent), run.config.run_dir)
    return out


def missing_artefacts(out: dict) -> list[str]:
    """The artefacts a stage's result names (`checkpoint`, `path`, `url`: local paths or fsspec URLs, e.g. a
    rollout in an s3 store) that are not there (any more)."""
    gone = []
    for key in ("checkpoint", "path", "url"):
        if out.get(key) is not None:
            fs, where = url_to_fs(out[key])
            if not fs.exists(where):
                gone.append(out[key])
    return gone


def branch_slices(cfg: TrainConfig) -> list[list[list[int]]]:
    """The replay tasks of one group: each gives every data-parallel group d one slice of `branches_per_task` of
    its own branches (d's share is contiguous, G / D of them), so the groups replay in parallel, in lockstep."""
    dp = cfg.pipeline.data_parallel
    per = cfg.responses // dp
    size = cfg.pipeline.branches_per_task
    return [[list(range(d * per + b, d * per + min(b + size, per))) for d in range(dp)] for b in range(0, per, size)]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


@flow(name="grpo-step", flow_run_name="step-{step}")
def grpo_step(run: Run, step: int, weights_version: str, reference_version: str | None,
              parent_run_id: str | None = None) -> dict:
    """One GRPO step, group by group: capture -> rollout -> (reference) -> reward -> replay (per branch slice)
    -> (prompt backward), then the optimizer step (and checkpoint); once per epoch. When an advantage needs every
    group's rewards (`inputs.needs_batch_advantages`), epoch 0 scores all groups first, then computes advantages,
    then replays.
    `weights_version` is the lineage id of the weights the ranks hold at the step's start, `reference_version` that
    of the KL reference. `run`: the run's config, resolved once, and the driver of its ranks."""
    cfg = run.config
    t0 = time.perf_counter()
    stage = partial(_run_stage, run=run, parent=parent_run_id)
    update = step * cfg.epochs
    caps: list[dict] = []  # every epoch's
    rolls: dict[int, dict] = {}
    refs: dict[int, dict | None] = {}
    rews: dict[int, dict] = {}
    advs: dict[int, dict] = {}  # the records the replays read: the reward's, or the batch advantages'
    replays: list[dict] = []
    prompts: list[dict] = []
    opt: dict = {}
    first: dict[int, dict] = {}  # epoch 0's state of each group: MoE routing replay's later captures route as it did

    def backward(g: int, epoch: int, state: dict) -> None:
        for slices in branch_slices(cfg):
            replays.append(stage(stages.replay, dict(
                weights_version=weights_version, state=state, rollout=_artefact(rolls[g]),
                advantages=advs[g]["advantages"], reference=_artefact(refs[g]), step=step, group=g, epoch=epoch,
                branches=slices)))
        if cfg.mode == "exact":
            prompts.append(stage(stages.prompt, dict(weights_version=weights_version, state=state, step=step, group=g,
                                                   epoch=epoch)))

    for epoch in range(cfg.epochs):
        # one group at a time: one prefix state and one dState resident; batch advantages defer epoch 0's replays
        # until every group is scored, each replay then reading its group's state back from the store
        deferred = epoch == 0 and needs_batch_advantages(cfg)
        states: dict[int, dict] = {}
        for g in range(cfg.groups):
            # epoch > 0: the weights changed, so the prompt is captured again with them
            routing_from = first[g] if cfg.moe_routing_replay and epoch else None
            caps.append(stage(stages.capture, dict(weights_version=weights_version, step=step, group=g, epoch=epoch,
                                                 routing_from=routing_from)))
            states[g] = _state(caps[-1])
            if epoch == 0:
                first[g] = states[g]
                rolls[g] = stage(stages.rollout, dict(weights_version=weights_version, state=states[g], step=step,
                                                    group=g))
                refs[g] = None
                if cfg.grpo.kl_coef > 0:
                    refs[g] = stage(stages.reference, dict(reference_version=reference_version, state=states[g],
                                                         rollout=_artefact(rolls[g]), step=step, group=g))
                rews[g] = advs[g] = stage(stages.reward, dict(rollout=_artefact(rolls[g]), step=step, group=g))
            if not deferred:
                backward(g, epoch, states[g])
        if deferred:
            scored = [_artefact(rews[g]) for g in range(cfg.groups)]
            for g in range(cfg.groups):
                advs[g] = stage(stages.advantages, dict(rewards=scored, step=step, group=g))
            for g in range(cfg.groups):
                backward(g, epoch, states[g])
        record = None  # the step's metrics, for the checkpoint its last update commits (rank 0 writes it)
        if epoch == cfg.epochs - 1:
            record = _metrics(cfg, caps, list(rolls.values()), list(rews.values()), replays, prompts,
                              time.perf_counter() - t0)
        opt = stage(stages.optimizer, dict(weights_version=weights_version, update=update + epoch, step=step,
                                           record=record))
        weights_version = opt["weights_version"]
    # the step's time now includes the optimizer's; its numbers join the record
    metrics = record | _timing(cfg, caps, replays, time.perf_counter() - t0) | _optimizer_metrics(opt)
    return {"step": step, "weights_version": weights_version, "checkpoint": opt["checkpoint"], "metrics": metrics}


def _timing(cfg: TrainConfig, caps: list[dict], replays: list[dict], seconds: float) -> dict:
    """The step's wall time so far and its throughput: the prompts captured and the branches' tokens, once."""
    epoch_tokens = sum(r["tokens"] for r in replays) / cfg.epochs
    return {"step_seconds": seconds, "tokens_per_s": (sum(c["prompt_tokens"] for c in caps) + epoch_tokens) / seconds}


def _optimizer_metrics(opt: dict) -> dict:
    return {"grad_norm": opt["grad_norm"], "skipped_updates": opt.get("skipped", 0.0), "lr": opt["lr"],
            "optimizer_seconds": opt["seconds"]}


def _metrics(cfg: TrainConfig, caps: list[dict], rolls: list[dict], rews: list[dict], replays: list[dict],
             prompts: list[dict], seconds: float) -> dict:
    """The step's metrics before its last optimizer step (`_optimizer_metrics` adds that one's numbers)."""
    m = {
        "reward_mean": _mean([r["reward_mean"] for r in rews]),
        "reward_std": _mean([r["reward_std"] for r in rews]),
        "accuracy": _mean([r["accuracy"] for r in rews]),
        "reward_failures": sum(r["reward_failures"] for r in rews),
        "reward_unscorable": sum(r["reward_unscorable"] for r in rews),
        "loss": sum(r["loss"] for r in replays) / cfg.groups / cfg.epochs,
        "kl": sum(r["kl_sum"] for r in replays) / max(sum(r["tokens"] for r in replays), 1),
        "clip_frac": sum(r["clipped_tokens"] for r in replays) / max(sum(r["tokens"] for r in replays), 1),
        "entropy": sum(r["entropy_sum"] for r in replays) / max(sum(r["tokens"] for r in replays), 1),
        "response_len": _mean([r["response_len_mean"] for r in rolls]),
        "prefix_state_bytes": _mean([c["state_bytes"] for c in caps]),  # caps: every epoch's captures
        "peak_bytes": max(x.get("peak_bytes", 0) for x in [*caps, *rolls, *replays, *prompts]),
        **_timing(cfg, caps, replays, seconds),
        "capture_seconds": sum(c["seconds"] for c in caps),
        "rollout_seconds": sum(r["seconds"] for r in rolls),
        "reward_seconds": sum(r["seconds"] for r in rews),
        "replay_seconds": sum(r["seconds"] for r in replays),
    }
    for key in sorted({k for r in rews for k in r if k.startswith("rewards/")}):  # each reward function's mean
        m[key] = _mean([r[key] for r in rews if key in r])
    m |= _sampler_mismatch(cfg, replays)
    if cfg.agent is not None:  # summed over the step's groups; turns per branch averaged
        m |= {"turns_per_branch": _mean([r["turns_mean"] for r in rolls]),
              **{k: sum(r[k] for r in rolls) for k in ("tool_calls", "tool_errors", "tool_seconds", "env_seconds")}}
    tokens = max(sum(r["tokens"] for r in replays), 1)
    if cfg.grpo.off_policy_mask_threshold is not None:  # responses the off-policy mask dropped, per epoch
        m["off_policy_masked"] = sum(r["off_policy_masked"] for r in replays) / cfg.epochs
    if cfg.grpo.top_entropy_quantile < 1.0:  # the share of tokens the policy loss kept
        m["entropy_kept_frac"] = sum(r["entropy_kept_tokens"] for r in replays) / tokens
    if cfg.mode == "exact":
        m["prompt_backward_seconds"] = sum(p["seconds"] for p in prompts)
    return m


def _sampler_mismatch(cfg: TrainConfig, replays: list[dict]) -> dict:
    """How far the trainer's log-probs of the sampled tokens are from the sampler's, over the tokens the replays
    compared (`sampler_tokens`: those of the answers replayed with the rollout's sampler log-probs): mean and max
    |sampler - trainer|, the k3 KL estimate per token, and with `grpo.rollout_correction` the mean importance weight
    it applied. Empty when no token was compared (a rollout stored without them)."""
    tokens = sum(r.get("sampler_tokens", 0.0) for r in replays)
    if tokens == 0:
        return {}
    compared = [r for r in replays if r.get("sampler_tokens", 0.0) > 0]
    m = {"sampler_logp_diff_mean": sum(r["mismatch_abs_sum"] for r in compared) / tokens,
         "sampler_logp_diff_max": max(r["mismatch_abs_max"] for r in compared),
         "sampler_kl": sum(r["mismatch_kl_sum"] for r in compared) / tokens}
    if cfg.grpo.rollout_correction != "off":
        m["correction_weight_mean"] = sum(r["correction_weight_sum"] for r in compared) / tokens
    return m


def _state(capture: dict) -> dict:
    return {"url": capture["url"], "sha256": capture["sha256"]}


def _step_dropping_corrupt(run: Run, step: int, weights_version: str, reference_version: str | None,
                           parent: str | None) -> dict:
    """Run a step; when a stage finds a stored input corrupted (the state, a rollout, a reward or reference file:
    derived data, never a checkpoint), delete it and run the step once more. The stage that wrote it is cached,
    but its artefact is gone now, so it runs again (`_run_stage`), and nothing has to be cleaned up by hand."""
    try:
        return grpo_step(run, step, weights_version, reference_version, parent)
    except CorruptArtefact as e:
        fs, where = url_to_fs(e.where)
        if Path(run.config.paths().checkpoints).resolve() in Path(where).resolve().parents or not fs.exists(where):
            raise
        get_run_logger().warning("step %d: %s; deleted it, running the step again", step, e)
        fs.rm(where, recursive=True)
    return grpo_step(run, step, weights_version, reference_version, parent)


def _artefact(out: dict | None) -> dict | None:
    """The `Artefact` a stage's result names, as the JSON the next task takes (its cache key hashes it)."""
    return None if out is None else Artefact.from_json(out).to_json()


def _history(cfg: TrainConfig) -> tuple[Path, list[dict]]:
    path = Path(cfg.run_dir) / "history.json"
    return path, (load_json(path) if path.is_file() else [])


@flow(name="grpo-train", log_prints=True)
def grpo_train(config: dict, progress: bool = True) -> dict:
    """Train with GRPO for `config.steps` steps (a TrainConfig as a dict), continuing from the run directory's
    latest checkpoint. Returns the final checkpoint and the per-step metrics.

    On `pipeline.nproc` N > 1 ranks this flow runs on rank 0 of a torchrun job and drives the others; called
    outside one (a deployment's run, a script), it starts the job, whose rank 0 runs it again."""
    cfg = TrainConfig.model_validate(config)
    if cfg.pipeline.nproc > 1 and not spmd.joined():
        return _launched(cfg, progress)
    with RunLock(cfg.run_dir):  # before anything is written: a second run on this directory stops here
        return _train(cfg, progress)


def _launched(cfg: TrainConfig, progress: bool) -> dict:
    """Start the run's job (whose rank 0 runs this flow again) and return what it left in the run directory."""
    if failure := launch_ranks(cfg, progress):
        raise RuntimeError(failure.line)
    latest = latest_checkpoint(cfg.paths().checkpoints)
    return {"checkpoint": str(latest), "history": _history(cfg)[1], "run_dir": cfg.run_dir, "mlflow_run_id": None}


def _train(cfg: TrainConfig, progress: bool) -> dict:
    logger = get_run_logger()
    run_dir = Path(cfg.run_dir)
    preflight(cfg)  # bad rewards, tasks, options and lengths fail here, before anything is written
    save_json(run_dir / "config.json", cfg.model_dump(mode="json"))
    code, code_path = code_digest(), run_dir / "code.json"
    if code_path.is_file() and (was := load_json(code_path).get("code")) != code:
        logger.warning("the library changed since this run last ran (%s -> %s): stages that completed with the old "
                       "code are computed again (cache keys include the code digest)", was, code)
    save_json(code_path, {"code": code})
    spmd.clear_failures(cfg)
    driver = Driver(Worker(cfg, spmd.current_ranks()))
    try:
        return _steps(Run.resolve(cfg, driver), progress, logger)
    finally:
        driver.stop()


def _steps(run: Run, progress: bool, logger) -> dict:
    cfg = run.config
    run_dir = Path(cfg.run_dir)
    init = rooted(configured(stages.start, cfg)(run), cfg.run_dir)
    start, weights_version = init["update"] // cfg.epochs, init["weights_version"]
    checkpoint = init["checkpoint"]
    parent = tracking.start_parent(cfg, f"grpo-train {flow_run.get_name() or ''}".strip(), {
        "prefect.flow_run_id": str(flow_run.get_id()), "run_dir": str(run_dir.resolve()),
        "resumed_from_step": str(start), "ranks": str(cfg.pipeline.nproc)})
    logger.info("run dir %s, MLflow %s (parent run %s), state store %s, %d rank(s); starting at step %d of %d",
                run_dir.resolve(), tracking.tracking_uri(cfg), parent, cfg.paths().store_url, cfg.pipeline.nproc,
                start, cfg.steps)
    history_path, history = _history(cfg)
    history = [h for h in history if h["step"] < start]

    def record(step: int, metrics: dict) -> None:
        tracking.log_metrics(cfg, parent, metrics, step)
        history.append({"step": step, **metrics})
        history.sort(key=lambda h: h["step"])
        save_json(history_path, history)
        logger.info("step %d: reward %.3f (accuracy %.3f), loss %.4f, grad norm %.3f, %.1f s", step,
                    metrics["reward_mean"], metrics["accuracy"], metrics["loss"], metrics["grad_norm"],
                    metrics["step_seconds"])

    status = "FAILED"
    try:
        # a kill between a checkpoint commit and the step's record: the record was committed with the checkpoint
        for step in sorted(set(range(start)) - {h["step"] for h in history}):
            meta = cfg.paths().checkpoint((step + 1) * cfg.epochs) / "trainer.json"
            if meta.is_file() and "record" in (rec := load_json(meta)):
                record(step, rec["record"])
            else:
                logger.warning("step %d has no record (its checkpoint %s holds none)", step, meta.parent)
        for step in tqdm(range(start, cfg.steps), desc="GRPO steps", unit="step", disable=not progress,
                         initial=start, total=cfg.steps):
            res = _step_dropping_corrupt(run, step, weights_version, init["reference_version"], parent)
            weights_version, checkpoint = res["weights_version"], res["checkpoint"] or checkpoint
            record(step, res["metrics"])
        status = "FINISHED"
    finally:
        if history:
            png = tracking.reward_curve_png(history, run_dir / "reward_curve.png")
            tracking.log_artifact(cfg, parent, png)
        tracking.log_artifact(cfg, parent, run_dir / "config.json")
        tracking.end_run(cfg, parent, status)
    return {"checkpoint": checkpoint, "history": history, "run_dir": str(run_dir), "mlflow_run_id": parent}
