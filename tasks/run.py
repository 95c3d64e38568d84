"""`Run`: a training run as its flow and stage tasks see it, made once per run: the config, resolved from its YAML
or JSON once, the digest of what it computes (the config part of every cached stage's key), and the driver of the
run's ranks."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

from longstraw.train.config import TrainConfig, without_placement
from longstraw.train.spmd import Driver

RUN_DIR = "{run_dir}"  # in a portable path, where the run directory is


def config_digest(cfg: TrainConfig) -> str:
    """The sha256 of the config without its placement on nodes (a resume may run on other machines and take the
    stored stages from the cache) and without where the run directory is (a run moved or copied, then resumed,
    takes its stored stages from the cache too: the README's promise that a resume never recaptures a prompt)."""
    data = without_placement(cfg.model_dump(mode="json"))
    data.pop("run_dir")
    blob = json.dumps(portable(data, cfg.run_dir), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _root(run_dir: str) -> str:
    return str(Path(run_dir)).rstrip("/") + "/"


def _strings(x: Any, fn: Callable[[str], str]) -> Any:
    """`x` (JSON) with `fn` applied to every string in it."""
    if isinstance(x, str):
        return fn(x)
    if isinstance(x, dict):
        return {k: _strings(v, fn) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strings(v, fn) for v in x]
    return x


def portable(x: Any, run_dir: str) -> Any:
    """`x` (JSON) with every path under `run_dir` written as `{run_dir}/...`: a stage's stored result and its cache
    key stay valid when the run directory is moved or copied (`longstraw resume <copy>`)."""
    root = _root(run_dir)
    return _strings(x, lambda s: RUN_DIR + "/" + s[len(root):] if s.startswith(root) and root != "./" else s)


def rooted(x: Any, run_dir: str) -> Any:
    """`portable`'s inverse: `{run_dir}/...` as a path under this run's directory, wherever it is now."""
    root = _root(run_dir)
    return _strings(x, lambda s: root + s[len(RUN_DIR) + 1:] if s.startswith(RUN_DIR + "/") else s)


class Run(BaseModel):
    """What every stage of a run takes. A pydantic model so that Prefect records a step's config with its flow run
    (the driver, a private attribute, is neither recorded nor hashed)."""

    model_config = ConfigDict(frozen=True)

    config: TrainConfig
    digest: str
    _driver: Driver | None = PrivateAttr(default=None)

    @classmethod
    def resolve(cls, cfg: TrainConfig, driver: Driver | None = None) -> "Run":
        run = cls(config=cfg, digest=config_digest(cfg))
        run._driver = driver
        return run

    @property
    def driver(self) -> Driver:
        """The driver of the run's ranks (model stages run through it)."""
        if self._driver is None:
            raise RuntimeError("this run drives no ranks (the grpo-train flow resolves the run with its driver); a "
                               "model stage cannot run")
        return self._driver
