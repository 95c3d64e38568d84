"""One Prefect task per stage of a GRPO step; each wraps the library function of the same name in
`longstraw.train.stages` and records a nested MLflow run.

Caching: a stage's cache key is its name, the digest of the whole `longstraw` package's sources (`code_digest`)
and its inputs (the config, which holds the run directory, and the URLs/hashes it reads), not the MLflow parent
run. Results (small JSON dicts) persist under `<run_dir>/prefect-results`, so re-running a failed flow run, or a
new run of the same step, skips every stage that completed with the same code; after any change to the library
(the engine, the ops, the loss, not only the stage function) the stages run again. Retries with exponential
backoff cover transient I/O errors only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from prefect import Task, task
from prefect.cache_policies import NO_CACHE, CacheKeyFnPolicy
from prefect.tasks import exponential_backoff

import longstraw.train.stages as lib
from longstraw.train.config import TrainConfig
from longstraw.version import code_digest

from . import tracking

STAGES = ("init_run", "capture_stage", "rollout_stage", "reference_stage", "reward_stage", "replay_stage",
          "prompt_stage", "optimizer_stage")
TRANSIENT = (OSError, TimeoutError, ConnectionError)
_TAG_KEYS = ("step", "group", "epoch", "update")


def _cache_key(name: str):
    def key(_ctx, params: dict) -> str:
        inputs = {"config": params["config"], "args": params["args"]}
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


def _make(name: str, cached: bool = True) -> Task:
    def run(config: dict, args: dict, parent_run_id: str | None = None) -> dict:
        cfg = TrainConfig.model_validate(config)
        tags = {k: args[k] for k in _TAG_KEYS if k in args}
        if "branches" in args:
            tags["branch"] = args["branches"][0]
        with tracking.stage_run(cfg, parent_run_id, name.removesuffix("_stage"), tags) as record:
            out = getattr(lib, name)(cfg, **args)  # looked up at call time: tests may wrap the library function
            record(out)
        return out

    return task(
        name=name.removesuffix("_stage"),
        retries=2,
        retry_delay_seconds=exponential_backoff(2),
        retry_condition_fn=_retry_transient,
        cache_policy=CacheKeyFnPolicy(cache_key_fn=_cache_key(name)) if cached else NO_CACHE,
        persist_result=cached,
        result_serializer="json",
    )(run)


STAGE_TASKS: dict[str, Task] = {name: _make(name, cached=name != "init_run") for name in STAGES}


def configured(name: str, cfg: TrainConfig) -> Task:
    """The stage's task with this run's result storage and retry settings."""
    p = cfg.pipeline
    return STAGE_TASKS[name].with_options(
        result_storage=Path(cfg.run_dir).resolve() / "prefect-results",
        retries=p.retries,
        retry_delay_seconds=exponential_backoff(p.retry_delay_seconds) if p.retries else 0,
    )
