"""One Prefect task per stage of a GRPO step (`capture`, `rollout`, ... below): each wraps the library function
of the same name in `longstraw.train.stages`, with its parameters, and records a nested MLflow run.

Caching: a stage's cache key is its name, the digest of the whole `longstraw` package's sources (`code_digest`)
and its inputs (the config, which holds the run directory, and the URLs/hashes it reads), not the MLflow parent
run. Results (small JSON dicts) persist under `<run_dir>/prefect-results`, so re-running a failed flow run, or a
new run of the same step, skips every stage that completed with the same code; after any change to the library
(the engine, the ops, the loss, not only the stage function) the stages run again. Retries with exponential
backoff cover transient I/O errors only.
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

import longstraw.train.stages as lib
from longstraw.train.config import TrainConfig
from longstraw.version import code_digest

from . import tracking

TRANSIENT = (OSError, TimeoutError, ConnectionError)
_TAG_KEYS = ("step", "group", "epoch", "update")


def _cache_key(name: str):
    def key(_ctx, params: dict) -> str:
        inputs = {k: v for k, v in params.items() if k != "parent_run_id"}  # the tracking run is not an input
        blob = json.dumps(inputs, sort_keys=True, default=str)
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


def _stage(fn: Callable[..., dict], cached: bool = True) -> Task:
    """The Prefect task of one library stage. Its parameters are the stage's own, named and typed as the library
    function has them, with the run config as a JSON dict first and the MLflow parent run last."""
    name = fn.__name__
    lib_params = list(inspect.signature(fn).parameters.values())[1:]  # after cfg
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
            tags["branch"] = params["branches"][0]
        with tracking.stage_run(cfg, parent, name.removesuffix("_stage"), tags) as record:
            out = getattr(lib, name)(cfg, **params)  # looked up at call time: tests may wrap the library function
            record(out)
        return out

    run.__signature__ = signature
    run.__name__ = run.__qualname__ = name
    run.__doc__ = fn.__doc__
    return task(
        name=name.removesuffix("_stage"),
        retries=2,
        retry_delay_seconds=exponential_backoff(2),
        retry_condition_fn=_retry_transient,
        cache_policy=CacheKeyFnPolicy(cache_key_fn=_cache_key(name)) if cached else NO_CACHE,
        persist_result=cached,
        result_serializer="json",
    )(run)


init_run = _stage(lib.init_run, cached=False)
capture = _stage(lib.capture_stage)
rollout = _stage(lib.rollout_stage)
reference = _stage(lib.reference_stage)
reward = _stage(lib.reward_stage)
replay = _stage(lib.replay_stage)
prompt = _stage(lib.prompt_stage)
optimizer = _stage(lib.optimizer_stage)


def configured(stage: Task, cfg: TrainConfig) -> Task:
    """The stage's task with this run's result storage and retry settings."""
    p = cfg.pipeline
    return stage.with_options(
        result_storage=Path(cfg.run_dir).resolve() / "prefect-results",
        retries=p.retries,
        retry_delay_seconds=exponential_backoff(p.retry_delay_seconds) if p.retries else 0,
    )
