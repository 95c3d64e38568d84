"""The engine plan a worker op ran reaches MLflow: the op's stage run (tasks/tracking.stage_run) holds it as
`plan.*` params, with the values of the plan the op reported."""

from __future__ import annotations

from longstraw.train.config import TrainConfig
from longstraw.train.worker import Worker
from tasks import tracking
from tests.flows.test_train_flow import config


def test_the_ops_plan_is_logged_as_params(tmp_path):
    cfg = TrainConfig.model_validate(config(tmp_path / "run", steps=1, mode="exact",
                                            engine={"prompt_chunk": 64, "boundary_every": 2},
                                            tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}))
    w = Worker(cfg)
    version = w.start()["weights_version"]
    parent = tracking.start_parent(cfg, "plan params", {"run_dir": str(tmp_path / "run")})
    with tracking.stage_run(cfg, parent, "capture", {"step": 0, "group": 0, "epoch": 0}) as record:
        out = w.capture(version, step=0, group=0, epoch=0)
        record(out)
    c = tracking.client(cfg)
    (child,) = c.search_runs([c.get_run(parent).info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'")
    logged = {k.removeprefix("plan."): v for k, v in child.data.params.items() if k.startswith("plan.")}
    plan = out["plan"]
    assert plan["prompt_chunk"] == 64 and plan["boundary_every"] == 2  # the config's, as resolved
    assert logged == {k: str(v) for k, v in plan.items()}
    assert {"prompt_chunk", "branch_batch", "head_chunk", "prompt_order", "checkpoint_layers", "boundary_every",
            "kept_graphs"} <= logged.keys()
