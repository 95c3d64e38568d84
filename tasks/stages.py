"""One Prefect task per stage of a GRPO step (`capture`, `rollout`, ... below), each recording a nested MLflow
run. Every task takes the run (`tasks.run.Run`: the config resolved once, its digest, the driver of its ranks)
first and the MLflow parent run last. A model stage (an op of `longstraw.train.worker.Worker`) runs on every rank
of the run through the run's driver: rank 0's task sends the op, all ranks execute it on their resident model.
The reward is computed here, on rank 0 alone.

Caching: a stage's cache key is its name, the digest of the whole `longstraw` package's sources (`code_digest`), the
run's config digest (the config holds the mesh; the placement on nodes and where the run directory is are left out)
and its other inputs (the weights' lineage id and the URLs/hashes it reads), not the MLflow parent run. Results
(small JSON dicts) persist under `<run_dir>/prefect-results`; keys and results name the run directory's files
relative to it (`tasks.run.portable`), so a run directory moved or copied keeps its cache. Stages whose output is
stored (capture, rollout, reference, reward, advantages) are cached, so a resume never recomputes them; stages whose
output lives in the ranks' memory (replay, prompt backward: the gradients; the optimizer step) are never cached,
since a fresh job holds none of it, and run again on resume from the stored state and rollout. After any change to
the library the cached stages run again too. Retries with exponential backoff cover transient errors (`transient`:
timeouts, dropped connections, EIO; never a full or read-only disk or a missing permission, which fail at once as
the user's error) in the cached stages: rank-0 stages, and at nproc 1 the model stages whose output is stored. The
uncached stages are never retried: their effect (gradients, an optimizer step) may be in the ranks' memory when they
fail, and a retry would apply it twice; on N ranks a failed op ends the job.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE, CacheKeyFnPolicy
from prefect.tasks import exponential_backoff

from longstraw.errors import is_user_error
from longstraw.memory import measured
from longstraw.train import inputs
from longstraw.train.config import TrainConfig
from longstraw.version import code_digest

from . import tracking
from .run import Run, portable

TRANSIENT = (OSError, TimeoutError, ConnectionError)
_TAG_KEYS = ("step", "group", "epoch", "update")
_NOT_INPUTS = ("run", "parent_run_id")  # in a cache key: the run by its digest; the tracking run is no input


def transient(e: BaseException) -> bool:
    """An error a retry may fix: a timeout, a dropped connection, an I/O error (EIO, a flaky network file system);
    not a full or read-only disk, a missing permission or a missing file, which a retry repeats
    (`errors.is_user_error`)."""
    return isinstance(e, TRANSIENT) and not is_user_error(e)


def _cache_key(name: str) -> Callable[[object, dict], str]:
    def key(_ctx, params: dict) -> str:
        run = params["run"]
        # inputs that name files of the run directory, named relative to it: a moved or copied run keeps its cache
        given = portable({k: v for k, v in params.items() if k not in _NOT_INPUTS}, run.config.run_dir)
        blob = json.dumps(given, sort_keys=True, default=str)
        return hashlib.sha256(f"{name}\n{code_digest()}\n{run.digest}\n{blob}".encode()).hexdigest()

    return key


def _retry_transient(_task, _run, state) -> bool:
    try:
        state.result()
    except BaseException as e:  # noqa: BLE001 - only decides on a retry
        return transient(e)
    return False


def _stage(name: str, *, cached: bool, on_ranks: bool) -> Callable[[Callable[..., dict]], Task]:
    """Make a stage function the Prefect task `name`; `on_ranks`: an op every rank runs (see `configured`)."""

    def make(fn: Callable[..., dict]) -> Task:
        t = task(
            name=name,
            retries=2,
            retry_delay_seconds=exponential_backoff(2),
            retry_condition_fn=_retry_transient,
            cache_policy=CacheKeyFnPolicy(cache_key_fn=_cache_key(name)) if cached else NO_CACHE,
            persist_result=cached,
            result_serializer="json",
        )(fn)
        t.on_ranks, t.cached = on_ranks, cached
        return t

    return make


def _tracked(run: Run, parent: str | None, name: str, params: dict, execute: Callable[[], dict]) -> dict:
    """`execute()` within the stage's nested MLflow run, tagged with where in the step it runs. The result names
    the run directory's files relative to it (`portable`; what a cached stage persists): `rooted` gives it back."""
    tags = {k: params[k] for k in _TAG_KEYS if k in params}
    if "branches" in params:
        tags["branch"] = params["branches"][0][0]
    with tracking.stage_run(run.config, parent, name, tags) as record:
        out = execute()
        record(out)
    return portable(out, run.config.run_dir)


def _op(run: Run, name: str, parent: str | None, params: dict, leader: dict | None = None) -> dict:
    """The worker op `Worker.OPS[name]` on every rank (the ranks hold the config); `leader`: arguments only rank
    0's op takes."""
    return _tracked(run, parent, name, params, lambda: run.driver.call(name, leader=leader, **params))


@_stage("start", cached=False, on_ranks=True)
def start(run: Run, parent_run_id: str | None = None) -> dict:
    """`Worker.start`: load the run's latest checkpoint on every rank."""
    return _op(run, "start", parent_run_id, {})


@_stage("capture", cached=True, on_ranks=True)
def capture(run: Run, weights_version: str, step: int, group: int, epoch: int, routing_from: dict | None = None,
            parent_run_id: str | None = None) -> dict:
    """`Worker.capture`: capture the group's prompt and store its prefix state."""
    return _op(run, "capture", parent_run_id, dict(weights_version=weights_version, step=step, group=group,
                                                   epoch=epoch, routing_from=routing_from))


@_stage("rollout", cached=True, on_ranks=True)
def rollout(run: Run, weights_version: str, state: dict, step: int, group: int, parent_run_id: str | None = None
            ) -> dict:
    """`Worker.rollout`: sample the group's answers and store them. An agent's rollout logs its time in the
    environments and tools apart from the decode's (its result holds `env_seconds`, `tool_seconds`, ...)."""
    out = _op(run, "rollout", parent_run_id, dict(weights_version=weights_version, state=state, step=step,
                                                  group=group))
    if "env_seconds" in out:
        get_run_logger().info(
            "rollout step %d group %d: %.2f s, of which %.2f s waiting on the environments (tools: %d calls, %d "
            "errors, %.2f s summed over calls); %.2f turns per branch", step, group, out["seconds"],
            out["env_seconds"], out["tool_calls"], out["tool_errors"], out["tool_seconds"], out["turns_mean"])
    return out


@_stage("reference", cached=True, on_ranks=True)
def reference(run: Run, reference_version: str, state: dict, rollout: dict, step: int, group: int,
              parent_run_id: str | None = None) -> dict:
    """`Worker.reference`: the KL reference's log-probs of the answers, stored."""
    return _op(run, "reference", parent_run_id, dict(reference_version=reference_version, state=state,
                                                     rollout=rollout, step=step, group=group))


@_stage("reward", cached=True, on_ranks=False)
def reward(run: Run, rollout: dict, step: int, group: int, parent_run_id: str | None = None) -> dict:
    """`inputs.reward_stage` on rank 0 alone (read at call time, so that a test may wrap it)."""
    params = dict(rollout=rollout, step=step, group=group)
    return _tracked(run, parent_run_id, "reward", params,
                    lambda: measured(inputs.reward_stage, run.config, **params))


@_stage("advantages", cached=True, on_ranks=False)
def advantages(run: Run, rewards: list[dict], step: int, group: int, parent_run_id: str | None = None) -> dict:
    """`inputs.advantage_stage` on rank 0 alone, when an advantage needs every group's rewards (scale_rewards
    batch, normalize_then_sum)."""
    params = dict(rewards=rewards, step=step, group=group)
    return _tracked(run, parent_run_id, "advantages", params,
                    lambda: measured(inputs.advantage_stage, run.config, **params))


@_stage("replay", cached=False, on_ranks=True)
def replay(run: Run, weights_version: str, state: dict, rollout: dict, advantages: list[float],
           reference: dict | None, step: int, group: int, epoch: int, branches: list[list[int]],
           parent_run_id: str | None = None) -> dict:
    """`Worker.replay`: one slice of branches per data-parallel group, gradients accumulated in memory."""
    return _op(run, "replay", parent_run_id, dict(
        weights_version=weights_version, state=state, rollout=rollout, advantages=advantages, reference=reference,
        step=step, group=group, epoch=epoch, branches=branches))


@_stage("prompt", cached=False, on_ranks=True)
def prompt(run: Run, weights_version: str, state: dict, step: int, group: int, epoch: int,
           parent_run_id: str | None = None) -> dict:
    """`Worker.prompt`: exact mode's prompt backward of the group."""
    return _op(run, "prompt", parent_run_id, dict(weights_version=weights_version, state=state, step=step,
                                                  group=group, epoch=epoch))


@_stage("optimizer", cached=False, on_ranks=True)
def optimizer(run: Run, weights_version: str, update: int, step: int, record: dict | None = None,
              parent_run_id: str | None = None) -> dict:
    """`Worker.optimizer`: the optimizer step (and checkpoint). `record`, the step's metrics for its checkpoint,
    goes to rank 0's op alone: rank 0 writes the checkpoint's trainer record."""
    return _op(run, "optimizer", parent_run_id, dict(weights_version=weights_version, update=update, step=step),
               leader={"record": record})


def configured(stage: Task, cfg: TrainConfig) -> Task:
    """The stage's task with this run's result storage and retry settings: none for ops on several ranks (a failed
    rank ends the job), and none for a stage whose effect lives in the ranks' memory (start, replay, prompt,
    optimizer: the uncached ones), which may have been applied when it failed: a retry would add the gradients
    twice or step twice; `longstraw resume` reruns those from the last checkpoint."""
    p = cfg.pipeline
    retries = 0 if (stage.on_ranks and p.nproc > 1) or not stage.cached else p.retries
    return stage.with_options(
        result_storage=Path(cfg.run_dir).resolve() / "prefect-results",
        retries=retries,
        retry_delay_seconds=exponential_backoff(p.retry_delay_seconds) if retries else 0,
    )
