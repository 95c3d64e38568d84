"""`Run`: a training run as its flow and stage tasks see it, made once per run: the config, resolved from its YAML
or JSON once, the digest of what it computes (the config part of every cached stage's key), and the driver of the
run's ranks."""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict, PrivateAttr

from longstraw.train.config import TrainConfig, without_placement
from longstraw.train.spmd import Driver


def config_digest(cfg: TrainConfig) -> str:
    """The sha256 of the config without its placement on nodes (a resume may run on other machines and take the
    stored stages from the cache)."""
    blob = json.dumps(without_placement(cfg.model_dump(mode="json")), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


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
