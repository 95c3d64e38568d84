"""`grpo_train`: the GRPO training flow. Each step is a subflow chaining the stage tasks of `tasks/stages.py`.

The flow holds no tensors: stages exchange paths/URLs with sha256s. It starts from the run directory's latest
checkpoint, so running it again on the same config (or `longstraw resume`) continues a failed run; stages that
completed before the failure are taken from the cache, not recomputed.
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

from fsspec.core import url_to_fs
from prefect import Task, flow, get_run_logger
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from tqdm.auto import tqdm

from longstraw.files import CorruptArtefact
from longstraw.train.artifacts import load_json, save_json
from longstraw.train.config import TrainConfig
from longstraw.train.lock import RunLock
from longstraw.train.stages import missing_artefacts, preflight
from longstraw.version import code_digest
from tasks import stages, tracking
from tasks.stages import configured

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _run_all(stage: Task, calls: list[dict], *, cfg: TrainConfig, parent: str | None, check: bool = True
             ) -> list[dict]:
    """Submit one task of `stage` per argument dict (they run concurrently), then wait for all, in order. With
    `check`, a result whose artefact is gone (a cached stage whose checkpoint, file or stored state was deleted)
    runs again."""
    t = configured(stage, cfg)
    config = cfg.model_dump(mode="json")
    results = [f.result() for f in [t.submit(config, **args, parent_run_id=parent) for args in calls]]
    redo = [i for i, r in enumerate(results) if check and missing_artefacts(r)]
    if redo:
        get_run_logger().warning("%s: %d cached results name artefacts that are gone (%s); computing them again",
                                 stage.name, len(redo), missing_artefacts(results[redo[0]])[0])
        again = t.with_options(refresh_cache=True)
        for i, f in zip(redo, [again.submit(config, **calls[i], parent_run_id=parent) for i in redo]):
            results[i] = f.result()
    return results


def _slices(n: int, size: int) -> list[list[int]]:
    return [list(range(b, min(b + size, n))) for b in range(0, n, size)]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


@flow(name="grpo-step", flow_run_name="step-{step}")
def grpo_step(config: dict, step: int, checkpoint: str, parent_run_id: str | None = None, recover: bool = False
              ) -> dict:
    """One GRPO step: capture -> rollout -> (reference) -> reward -> replay (per branch) -> (prompt backward)
    -> optimizer step + checkpoint, once per epoch. `recover`: the step was committed but its record was lost;
    its results come from the cache as they are (its gradient files were deleted after the commit)."""
    cfg = TrainConfig.model_validate(config)
    t0 = time.perf_counter()
    groups = range(cfg.groups)
    parent = parent_run_id
    run = partial(_run_all, cfg=cfg, parent=parent, check=not recover)
    update = step * cfg.epochs
    caps = run(stages.capture, [
        dict(checkpoint=checkpoint, step=step, group=g, epoch=0) for g in groups])
    rolls = run(stages.rollout, [
        dict(checkpoint=checkpoint, state=_state(caps[g]), step=step, group=g) for g in groups])
    refs: list[dict | None] = [None] * cfg.groups
    if cfg.grpo.kl_coef > 0:
        ref_ckpt = str(cfg.paths().checkpoint(0))
        refs = run(stages.reference, [
            dict(ref_checkpoint=ref_ckpt, rollout_ref=_ref(rolls[g]), step=step, group=g) for g in groups])
    rews = run(stages.reward, [dict(rollout_ref=_ref(rolls[g]), step=step, group=g) for g in groups])

    replays: list[dict] = []
    opt: dict = {}
    for epoch in range(cfg.epochs):
        if epoch > 0:  # the weights changed: the prefix state must be recaptured with them
            caps = run(stages.capture, [
                dict(checkpoint=checkpoint, step=step, group=g, epoch=epoch) for g in groups])
        calls = [dict(checkpoint=checkpoint, state=_state(caps[g]), rollout_ref=_ref(rolls[g]),
                      reward_ref=_ref(rews[g]), reference_ref=_ref(refs[g]), step=step, group=g, epoch=epoch,
                      branches=b)
                 for g in groups for b in _slices(cfg.responses, cfg.pipeline.branches_per_task)]
        replays = run(stages.replay, calls)
        grads = [_ref(r) for r in replays]
        if cfg.mode == "exact":
            per_group = [[_ref(r) for r, c in zip(replays, calls) if c["group"] == g] for g in groups]
            prompts = run(stages.prompt, [
                dict(checkpoint=checkpoint, state=_state(caps[g]), replay_refs=per_group[g], step=step, group=g,
                     epoch=epoch) for g in groups])
            grads += [_ref(p) for p in prompts]
        (opt,) = run(stages.optimizer, [
            dict(checkpoint=checkpoint, grad_refs=grads, update=update + epoch, step=step)])
        checkpoint = opt["checkpoint"]
        if not cfg.pipeline.keep_gradients:  # committed into the checkpoint; a resume starts from there
            for g in grads:
                Path(g["path"]).unlink(missing_ok=True)

    tokens = sum(r["tokens"] for r in replays)
    seconds = time.perf_counter() - t0
    metrics = {
        "reward_mean": _mean([r["reward_mean"] for r in rews]),
        "reward_std": _mean([r["reward_std"] for r in rews]),
        "accuracy": _mean([r["accuracy"] for r in rews]),
        "reward_failures": sum(r["reward_failures"] for r in rews),
        "loss": sum(r["loss"] for r in replays) / cfg.groups,
        "kl": sum(r["kl_sum"] for r in replays) / max(tokens, 1),
        "clip_frac": sum(r["clipped_tokens"] for r in replays) / max(tokens, 1),
        "grad_norm": opt["grad_norm"],
        "skipped_updates": opt.get("skipped", 0.0),
        "lr": opt["lr"],
        "response_len": _mean([r["response_len_mean"] for r in rolls]),
        "prefix_state_bytes": _mean([c["state_bytes"] for c in caps]),
        "peak_bytes": max(x.get("peak_bytes", 0) for x in [*caps, *rolls, *replays]),
        "step_seconds": seconds,
        "tokens_per_s": (sum(c["prompt_tokens"] for c in caps) + tokens) / seconds,
    }
    for name, outs in (("capture", caps), ("rollout", rolls), ("reward", rews), ("replay", replays)):
        metrics[f"{name}_seconds"] = sum(o["seconds"] for o in outs)
    metrics["optimizer_seconds"] = opt["seconds"]
    if cfg.mode == "exact":
        metrics["prompt_backward_seconds"] = sum(p["seconds"] for p in prompts)
    return {"step": step, "checkpoint": checkpoint, "metrics": metrics}


def _state(capture: dict) -> dict:
    return {"url": capture["url"], "sha256": capture["sha256"]}


def _step_dropping_corrupt(step_flow, cfg: TrainConfig, step: int, checkpoint: str, parent: str | None) -> dict:
    """Run a step; when a stage finds a stored input corrupted (the state, a rollout, a gradient file: derived
    data, never a checkpoint), delete it and run the step once more. The stage that wrote it is cached, but its
    artefact is gone now, so it runs again (`_run_all`), and nothing has to be cleaned up by hand."""
    try:
        return step_flow(cfg.model_dump(mode="json"), step, checkpoint, parent)
    except CorruptArtefact as e:
        fs, where = url_to_fs(e.where)
        if Path(cfg.paths().checkpoints).resolve() in Path(where).resolve().parents or not fs.exists(where):
            raise
        get_run_logger().warning("step %d: %s; deleted it, running the step again", step, e)
        fs.rm(where, recursive=True)
    return step_flow(cfg.model_dump(mode="json"), step, checkpoint, parent)


def _ref(out: dict | None) -> dict | None:
    return None if out is None else {"path": out["path"], "sha256": out["sha256"]}


def _history(cfg: TrainConfig) -> tuple[Path, list[dict]]:
    path = Path(cfg.run_dir) / "history.json"
    return path, (load_json(path) if path.is_file() else [])


@flow(name="grpo-train", log_prints=True)
def grpo_train(config: dict, progress: bool = True) -> dict:
    """Train with GRPO for `config.steps` steps (a TrainConfig as a dict), continuing from the run directory's
    latest checkpoint. Returns the final checkpoint and the per-step metrics."""
    cfg = TrainConfig.model_validate(config)
    with RunLock(cfg.run_dir):  # before anything is written: a second run on this directory stops here
        return _train(cfg, progress)


def _train(cfg: TrainConfig, progress: bool) -> dict:
    logger = get_run_logger()
    run_dir = Path(cfg.run_dir)
    preflight(cfg)  # bad rewards, tasks, options and lengths fail here, before anything is written
    save_json(run_dir / "config.json", cfg.model_dump(mode="json"))
    code, code_path = code_digest(), run_dir / "code.json"
    changed = code_path.is_file() and (was := load_json(code_path).get("code")) != code
    if changed:
        logger.warning("the library changed since this run last ran (%s -> %s): stages that completed with the old "
                       "code are computed again (cache keys include the code digest)", was, code)
    save_json(code_path, {"code": code})
    init = configured(stages.init_run, cfg)(cfg.model_dump(mode="json"))
    start = init["update"] // cfg.epochs
    checkpoint = str(cfg.paths().checkpoint(start * cfg.epochs))
    parent = tracking.start_parent(cfg, f"grpo-train {flow_run.get_name() or ''}".strip(), {
        "prefect.flow_run_id": str(flow_run.get_id()), "run_dir": str(run_dir.resolve()), "resumed_from_step": str(start)})
    logger.info("run dir %s, MLflow %s (parent run %s), state store %s; starting at step %d of %d",
                run_dir.resolve(), tracking.tracking_uri(cfg), parent, cfg.paths().store_url, start, cfg.steps)
    history_path, history = _history(cfg)
    history = [h for h in history if h["step"] < start]
    step_flow = grpo_step.with_options(task_runner=ThreadPoolTaskRunner(max_workers=cfg.pipeline.replay_concurrency))

    def record(step: int, res: dict) -> None:
        tracking.log_metrics(cfg, parent, res["metrics"], step)
        history.append({"step": step, **res["metrics"]})
        history.sort(key=lambda h: h["step"])
        save_json(history_path, history)
        m = res["metrics"]
        logger.info("step %d: reward %.3f (accuracy %.3f), loss %.4f, grad norm %.3f, %.1f s", step,
                    m["reward_mean"], m["accuracy"], m["loss"], m["grad_norm"], m["step_seconds"])

    status = "FAILED"
    try:
        # a kill between a step's checkpoint commit and its record: the record comes back from the cached results
        for step in sorted(set(range(start)) - {h["step"] for h in history}):
            first = cfg.paths().checkpoint(step * cfg.epochs)
            if changed or not first.is_dir():  # recomputing would rewrite a committed checkpoint
                logger.warning("step %d is committed but has no record, and cannot be recovered (%s)", step,
                               "the library changed" if changed else f"{first} is gone")
                continue
            record(step, step_flow(cfg.model_dump(mode="json"), step, str(first), parent, recover=True))
        for step in tqdm(range(start, cfg.steps), desc="GRPO steps", unit="step", disable=not progress,
                         initial=start, total=cfg.steps):
            res = _step_dropping_corrupt(step_flow, cfg, step, checkpoint, parent)
            checkpoint = res["checkpoint"]
            record(step, res)
        status = "FINISHED"
    finally:
        if history:
            png = tracking.reward_curve_png(history, run_dir / "reward_curve.png")
            tracking.log_artifact(cfg, parent, png)
        tracking.log_artifact(cfg, parent, run_dir / "config.json")
        tracking.end_run(cfg, parent, status)
    return {"checkpoint": checkpoint, "history": history, "run_dir": str(run_dir), "mlflow_run_id": parent}


