"""MLflow runs that a kill -9 left RUNNING are marked KILLED when their run directory is next used; runs of
other run directories in the same tracking store are left alone."""

from __future__ import annotations

from longstraw.train.config import TrainConfig
from tasks import tracking
from tests.flows.test_train_flow import config


def test_orphaned_runs_are_marked_killed_on_resume(tmp_path):
    shared = {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    cfg, elsewhere = (TrainConfig.model_validate(config(tmp_path / d, steps=1, tracking=shared)) for d in ("run", "other"))
    tags = lambda c: {"run_dir": str((tmp_path / c.run_dir).resolve())}  # noqa: E731
    dead = tracking.start_parent(cfg, "killed run", tags(cfg))
    other = tracking.start_parent(elsewhere, "a live run elsewhere", tags(elsewhere))
    c = tracking.client(cfg)
    with tracking.stage_run(cfg, dead, "replay", {"step": 0}):  # a stage that was running when the kill came
        exp = c.get_run(dead).info.experiment_id
        (child,) = c.search_runs([exp], f"tags.`mlflow.parentRunId` = '{dead}'")
        new = tracking.start_parent(cfg, "resumed", tags(cfg))
        assert c.get_run(dead).info.status == "KILLED" and c.get_run(child.info.run_id).info.status == "KILLED"
    assert c.get_run(new).info.status == "RUNNING" and c.get_run(other).info.status == "RUNNING"
