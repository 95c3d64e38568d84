"""MLflow tracking for the pipeline: one parent run per flow run, one nested run per executed stage.

Everything goes through `MlflowClient` with explicit run ids (no fluent "active run"), so stages running in
parallel threads never log into each other's runs; one lock serialises writes to the sqlite store.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from longstraw.files import atomic_output
from longstraw.train.config import TrainConfig

_LOCK = threading.Lock()
# stage outputs that are numbers but not metrics
_NOT_METRICS = {"update", "group", "step", "epoch", "responses"}


def tracking_uri(cfg: TrainConfig) -> str:
    if cfg.tracking.uri:
        return cfg.tracking.uri
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    return cfg.paths().tracking_uri


def client(cfg: TrainConfig):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(cfg))


def _flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= _flatten(v, key + ".")
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


def metrics_of(out: dict) -> dict[str, float]:
    """The numeric entries of a stage's output (paths, hashes and counters left out)."""
    return {k: float(v) for k, v in out.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _NOT_METRICS}


def log_metrics(cfg: TrainConfig, run_id: str, metrics: dict[str, float], step: int) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
    with _LOCK:
        client(cfg).log_batch(run_id, metrics=batch)


def _end_orphans(c, exp_id: str, run_dir: str | None) -> None:
    """Mark KILLED the runs of this run directory that a killed process left RUNNING, with their nested stage
    runs. Only the holder of the run-directory lock starts a parent run, so none of them is alive."""
    if run_dir is None:
        return
    quoted = run_dir.replace("'", "\\'")
    for parent in c.search_runs([exp_id], f"attributes.status = 'RUNNING' and tags.run_dir = '{quoted}'"):
        pid = parent.info.run_id
        for child in c.search_runs([exp_id], f"attributes.status = 'RUNNING' and tags.`mlflow.parentRunId` = '{pid}'"):
            c.set_terminated(child.info.run_id, "KILLED")
        c.set_terminated(pid, "KILLED")


def start_parent(cfg: TrainConfig, name: str, tags: dict[str, str]) -> str:
    """Create the parent run of a flow run, with the whole config as params."""
    from mlflow.entities import Param

    with _LOCK:
        c = client(cfg)
        exp = c.get_experiment_by_name(cfg.tracking.experiment)
        where = None if cfg.tracking.uri else (Path(cfg.run_dir) / "mlartifacts").resolve().as_uri()
        if exp:
            exp_id = exp.experiment_id
            # a run directory moved or copied (its artefacts were beside its db, under mlartifacts)
            if where is not None and exp.artifact_location != where and exp.artifact_location.endswith(
                    "/mlartifacts"):
                _rehome_artifacts(cfg, exp_id, exp.artifact_location, where)
        else:  # artefacts beside the run's sqlite db, not in ./mlruns of whatever directory this runs in
            exp_id = c.create_experiment(cfg.tracking.experiment, artifact_location=where)
        _end_orphans(c, exp_id, tags.get("run_dir"))
        run = c.create_run(exp_id, run_name=name, tags=tags)
        params = [Param(k, v[:6000]) for k, v in _flatten(cfg.model_dump(mode="json")).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            c.log_batch(run.info.run_id, params=params[i : i + 100])
    return run.info.run_id


def _rehome_artifacts(cfg: TrainConfig, exp_id: str, old: str, new: str) -> None:
    """The run directory was moved or copied (its own sqlite db names artefacts under the old place): point the
    experiment and its runs at the artefacts under the directory as it is now, so that a resumed copy neither
    writes into the original nor recreates a moved-away directory. MLflow has no API to move an experiment's
    artefacts, hence SQL on the run's own db."""
    import sqlite3

    db = sqlite3.connect(Path(cfg.run_dir).resolve() / "mlflow.db")
    try:
        with db:
            db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (new, int(exp_id)))
            db.execute("UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) WHERE experiment_id = ? AND "
                       "substr(artifact_uri, 1, ?) = ?", (new, len(old) + 1, int(exp_id), len(old), old))
    finally:
        db.close()


def end_run(cfg: TrainConfig, run_id: str, status: str = "FINISHED") -> None:
    with _LOCK:
        client(cfg).set_terminated(run_id, status)


def log_artifact(cfg: TrainConfig, run_id: str, path: str | Path) -> None:
    with _LOCK:
        client(cfg).log_artifact(run_id, str(path))


def log_params(cfg: TrainConfig, run_id: str, params: dict) -> None:
    """Log a (nested) dict as the run's params, flattened to dotted names."""
    from mlflow.entities import Param

    with _LOCK:
        client(cfg).log_batch(run_id, params=[Param(k, v[:6000]) for k, v in _flatten(params).items()])


@contextmanager
def stage_run(cfg: TrainConfig, parent_id: str | None, stage: str, tags: dict):
    """A nested run for one stage execution; yields a function that records the stage's output dict."""
    if not parent_id:
        yield lambda out: None
        return
    with _LOCK:
        c = client(cfg)
        parent = c.get_run(parent_id)
        run = c.create_run(parent.info.experiment_id, run_name=f"{stage} " + " ".join(f"{k}={v}" for k, v in tags.items()),
                           tags={"mlflow.parentRunId": parent_id, "stage": stage, **{k: str(v) for k, v in tags.items()}})
    run_id = run.info.run_id
    outputs: list[dict] = []
    try:
        yield outputs.append
    except BaseException:
        end_run(cfg, run_id, "FAILED")
        raise
    if outputs:
        log_metrics(cfg, run_id, metrics_of(outputs[-1]), int(tags.get("step", 0)))
        if outputs[-1].get("plan"):  # the engine plan the op ran (engine/policy.py)
            log_params(cfg, run_id, {"plan": outputs[-1]["plan"]})
    end_run(cfg, run_id)


def reward_curve_png(history: list[dict], path: str | Path) -> Path:
    """Mean reward (and accuracy) per step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [h["reward_mean"] for h in history], marker="o", label="reward mean")
    ax.plot(steps, [h["accuracy"] for h in history], marker="s", linestyle="--", label="accuracy")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return Path(path)
