"""One Prefect task per stage of a GRPO step (`capture`, `rollout`, ... below), each recording a nested MLflow
run. A model stage (an op of `longstraw.train.worker.Worker`) runs on every rank of the run through this process's
`Driver` (`use_driver`): rank 0's task sends the op, all ranks execute it on their resident model. The reward is
computed here, on rank 0 alone.

Caching: a stage's cache key is its name, the digest of the whole `longstraw` package's sources (`code_digest`)
and its inputs (the config, which holds the run directory and the mesh, without the placement on nodes; the
weights' lineage id and the URLs/hashes it reads), not the MLflow parent run. Results (small JSON dicts) persist under
`<run_dir>/prefect-results`. Stages whose output is stored (capture, rollout, reference, reward, advantages) are
cached, so a resume never recomputes them; stages whose output lives in the ranks' memory (replay, prompt backward: the
gradients; the optimizer step) are never cached, since a fresh job holds none of it, and run again on resume from
the stored state and rollout. After any change to the library the cached stages run again too. Retries with
exponential backoff cover transient I/O errors in rank-0 stages, and every stage at nproc 1 (on N ranks a failed
op ends the job).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from pathlib import Path

from prefect import Task, task
from prefect.cache_policies import NO_CACHE, CacheKeyFnPolicy
from prefect.tasks import exponential_backoff

from longstraw.memory import measured
from longstraw.train import inputs
from longstraw.train.config import TrainConfig, without_placement
from longstraw.train.spmd import Driver
from longstraw.train.worker import Worker
from longstraw.version import code_digest

from . import tracking

TRANSIENT = (OSError, TimeoutError, ConnectionError)
_TAG_KEYS = ("step", "group", "epoch", "update")
_DRIVER: Driver | None = None


def use_driver(driver: Driver | None) -> None:
    """The driver of the run this process drives (set by the flow for its duration)."""
    global _DRIVER
    _DRIVER = driver


def _driver() -> Driver:
    if _DRIVER is None:
        raise RuntimeError("no training run is being driven in this process (the grpo-train flow sets one)")
    return _DRIVER


def _cache_key(name: str):
    def key(_ctx, params: dict) -> str:
        given = {k: v for k, v in params.items() if k != "parent_run_id"}  # the tracking run is not an input
        if "config" in given:  # nor are the machines the ranks run on (a resume may run on other nodes)
            given["config"] = without_placement(given["config"])
        blob = json.dumps(given, sort_keys=True, default=str)
        return hashlib.sha256(f"{name}\n{code_digest()}\n{blob}".encode()).hexdigest()

    return key


def _retry_transient(_task, _run, state) -> bool:
    try:
        state.result()
    except TRANSIENT:
        return True
    except BaseException:
        return False
    return False


def _stage(name: str, fn: Callable[..., dict], cached: bool, on_ranks: bool,
           execute: Callable[[TrainConfig, dict], dict]) -> Task:
    """The Prefect task of one stage, which runs `execute(cfg, params)`. Its parameters are those of `fn` (the
    library's function of the stage), named and typed as the library has them, with the run config as a JSON dict
    first and the MLflow parent run last."""
    lib_params = list(inspect.signature(fn).parameters.values())[1:]  # after self / cfg
    signature = inspect.Signature(
        [inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=dict), *lib_params,
         inspect.Parameter("parent_run_id", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=str | None)],
        return_annotation=dict)

    def run(*args, **kwargs) -> dict:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        params = dict(bound.arguments)
        cfg = TrainConfig.model_validate(params.pop("config"))
        parent = params.pop("parent_run_id")
        tags = {k: params[k] for k in _TAG_KEYS if k in params}
        if "branches" in params:
            tags["branch"] = params["branches"][0][0]
        with tracking.stage_run(cfg, parent, name, tags) as record:
            out = execute(cfg, params)
            record(out)
        return out

    run.__signature__ = signature
    run.__name__ = run.__qualname__ = name
    run.__doc__ = fn.__doc__
    t = task(
        name=name,
        retries=2,
        retry_delay_seconds=exponential_backoff(2),
        retry_condition_fn=_retry_transient,
        cache_policy=CacheKeyFnPolicy(cache_key_fn=_cache_key(name)) if cached else NO_CACHE,
        persist_result=cached,
        result_serializer="json",
    )(run)
    t.on_ranks = on_ranks
    return t


def _op(name: str, cached: bool) -> Task:
    """The task of the worker op `Worker.OPS[name]`: rank 0 sends it, every rank runs it on its resident model."""
    return _stage(name, Worker.OPS[name], cached, on_ranks=True,
                  execute=lambda _cfg, params: _driver().call(name, **params))  # the ranks hold the config


start = _op("start", cached=False)
capture = _op("capture", cached=True)
rollout = _op("rollout", cached=True)
reference = _op("reference", cached=True)
# rank 0 alone; the module's function read at call time, so that a test may wrap it
reward = _stage("reward", inputs.reward_stage, cached=True, on_ranks=False,
                execute=lambda cfg, params: measured(inputs.reward_stage, cfg, **params))
# rank 0 alone, when an advantage needs every group's rewards (scale_rewards batch, normalize_then_sum)
advantages = _stage("advantages", inputs.advantage_stage, cached=True, on_ranks=False,
                    execute=lambda cfg, params: measured(inputs.advantage_stage, cfg, **params))
replay = _op("replay", cached=False)
prompt = _op("prompt", cached=False)
optimizer = _op("optimizer", cached=False)


def configured(stage: Task, cfg: TrainConfig) -> Task:
    """The stage's task with this run's result storage and retry settings (none for ops on several ranks)."""
    p = cfg.pipeline
    retries = 0 if stage.on_ranks and p.nproc > 1 else p.retries
    return stage.with_options(
        result_storage=Path(cfg.run_dir).resolve() / "prefect-results",
        retries=retries,
        retry_delay_seconds=exponential_backoff(p.retry_delay_seconds) if retries else 0,
    )
