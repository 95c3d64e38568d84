"""`longstraw train | resume | serve | ui`: the pipeline commands (the library's CLI hands these over to here, so
that `longstraw` itself never imports Prefect or MLflow)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from longstraw.cli import build_parser, rope_overrides, run  # noqa: E402
from longstraw.config import load_config, with_overrides  # noqa: E402
from longstraw.train.artifacts import load_json  # noqa: E402
from longstraw.train.config import PLACEMENT, TrainConfig, without_placement  # noqa: E402
from longstraw.train.lock import RunDirLocked  # noqa: E402


def _config(args: argparse.Namespace) -> TrainConfig:
    return load_config(args.config, TrainConfig, _overrides(args))


def _overrides(args: argparse.Namespace) -> dict:
    """The command line's overrides; under torchrun, its world size is the number of ranks. A DeepSpeed config
    named by $LONGSTRAW_DEEPSPEED_CONFIG (`infra/launch.sh --deepspeed`) comes first: the fields it honours
    (longstraw/train/ds_config.py) override the YAML, the command line overrides both."""
    from longstraw.train.ds_config import deepspeed_overrides

    out = deepspeed_overrides()
    out |= {key: getattr(args, key) for key in ("run_dir", "steps") if getattr(args, key, None) is not None}
    nproc = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else getattr(args, "nproc", None)
    pipeline = {key: getattr(args, key) for key in PLACEMENT if getattr(args, key, None) is not None}
    if nproc is not None:
        pipeline["nproc"] = nproc
    if pipeline:
        out["pipeline"] = pipeline
    if getattr(args, "rope_scaling", None):
        out.update(rope_overrides(args))
    return out


def _under_torchrun() -> bool:
    from longstraw.train.spmd import under_torchrun

    return under_torchrun()


def _train_here_or_launch(cfg: TrainConfig, progress: bool) -> int:
    """Train in this process (one rank), as one rank of the torchrun job this process belongs to, or start a
    job of `pipeline.nproc` ranks."""
    if _under_torchrun():
        from .ranks import run_rank

        run_rank(cfg, progress)  # never returns
    from longstraw.train.preflight import check_before_start

    # before the Prefect server, the run lock, the run dir and torchrun: a bad input is one line, not a traceback
    check_before_start(cfg)
    _where(cfg)
    if cfg.pipeline.nproc > 1:
        from .launch import launch_ranks

        if not (failure := launch_ranks(cfg, progress)):
            return 0
        # the cause a rank recorded: exit 2 for a user's error, else 1
        print(f"longstraw: {failure.line}", file=sys.stderr)
        return failure.code
    from .train import grpo_train

    from .report import report

    report(grpo_train(cfg.model_dump(mode="json"), progress=progress))
    return 0


def _where(cfg: TrainConfig) -> None:
    from tasks.tracking import tracking_uri

    print(f"run dir: {Path(cfg.run_dir).resolve()}\nMLflow: {tracking_uri(cfg)} (experiment {cfg.tracking.experiment!r})"
          f"\nstate store: {cfg.paths().store_url}", flush=True)


def train(args: argparse.Namespace) -> int:
    return _train_here_or_launch(_config(args), not args.no_progress)


def _resume_config(target: str) -> dict:
    """The config of a run, from its run directory or from the parameters of one of its Prefect flow runs."""
    path = Path(target)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a run directory written by `longstraw train`")
        # the directory given wins over the run_dir recorded in it (the run may have been moved or copied); the
        # nodes it ran on are the command line's (default one machine), not those of the run that stopped
        return {**without_placement(load_json(path / "config.json")), "run_dir": str(path.resolve())}
    if path.suffix in (".yaml", ".yml"):
        raise ValueError(f"{target} is a config file; resume takes a run directory or a flow-run id "
                         f"(`longstraw train --config {target}` also continues its run directory)")
    from uuid import UUID

    try:
        run_id = UUID(target)
    except ValueError:
        raise ValueError(f"{target!r} is neither a run directory nor a Prefect flow-run id") from None
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        params = client.read_flow_run(run_id).parameters
    if "config" not in params:
        raise ValueError(f"flow run {target} is not a grpo-train run (it has no `config` parameter)")
    return without_placement(params["config"])


def resume(args: argparse.Namespace) -> int:
    data = with_overrides(_resume_config(args.target), _overrides(args))
    return _train_here_or_launch(TrainConfig.model_validate(data), not args.no_progress)


def serve(args: argparse.Namespace) -> int:
    """Register the grpo-train deployment with the config's nightly cron and run its scheduled/triggered runs."""
    from prefect.schedules import Cron

    from .train import grpo_train

    cfg = _config(args)
    s = cfg.schedule
    cron = args.cron or s.cron
    print(f"serving deployment grpo-train/{s.deployment}: cron {cron!r} ({s.timezone}); trigger runs from the Prefect UI "
          f"or `prefect deployment run grpo-train/{s.deployment}`", flush=True)
    grpo_train.serve(
        name=s.deployment,
        schedules=[Cron(cron, timezone=s.timezone)],
        parameters={"config": cfg.model_dump(mode="json"), "progress": False},
        tags=["longstraw"],
        description="GRPO training (LongStraw); config: " + str(Path(args.config).resolve()),
        limit=args.limit,
    )
    return 0


def ui(args: argparse.Namespace) -> int:
    from .ui import ServerStartError, serve_forever, start_ui

    try:
        servers = start_ui(prefect_port=args.prefect_port, mlflow_port=args.mlflow_port, host=args.host,
                           backend_store_uri=args.mlflow_store)
    except ServerStartError as e:  # a busy port or a server that did not come up: its log tail, not a traceback
        print(f"longstraw ui: error: {e}", file=sys.stderr)
        return 1
    return serve_forever(servers)


def _add_placement(p: argparse.ArgumentParser) -> None:
    """The machines of a multi-node run: every node runs the same command with its own --node-rank."""
    p.add_argument("--nnodes", type=int, help="machines the ranks run on (pipeline.nnodes; default 1)")
    p.add_argument("--node-rank", type=int, help="this machine, 0..nnodes-1 (pipeline.node_rank)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="torchrun's c10d rendezvous, the same on every node, "
                   "e.g. node 0's host name and a free port (pipeline.rdzv_endpoint)")


def parser() -> argparse.ArgumentParser:
    """The `longstraw` command line: the library's commands plus the pipeline's."""
    parser, sub = build_parser()
    p = sub.add_parser("train", help="GRPO training run (Prefect flow, MLflow tracking); continues its run dir")
    p.add_argument("--config", default="configs/train-tiny.yaml", help="YAML TrainConfig")
    p.add_argument("--run-dir", help="override the config's run_dir")
    p.add_argument("--steps", type=int, help="override the number of steps")
    p.add_argument("--nproc", type=int, help="ranks of the run, on all nodes together (started with torchrun; "
                   "overrides pipeline.nproc)")
    _add_placement(p)
    p.add_argument("--rope-scaling", metavar="TYPE:FACTOR", help="extend the model's positions by RoPE scaling, "
                   "e.g. yarn:8 (overrides model.rope_scaling)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=train)
    p = sub.add_parser("resume", help="continue a failed run from its stored state (completed stages are skipped)")
    p.add_argument("target", help="run directory, or the id of one of its Prefect flow runs")
    p.add_argument("--nproc", type=int, help="ranks, on all nodes together (default: the run's pipeline.nproc)")
    _add_placement(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=resume)
    p = sub.add_parser("serve", help="register the nightly grpo-train deployment and run its flow runs")
    p.add_argument("--config", default="configs/train-tiny.yaml", help="YAML TrainConfig (schedule: cron, timezone)")
    p.add_argument("--cron", help="override the config's schedule.cron")
    p.add_argument("--run-dir", help="override the config's run_dir")
    p.add_argument("--limit", type=int, help="most flow runs at once")
    p.set_defaults(func=serve)
    p = sub.add_parser("ui", help="start a Prefect server and an MLflow server on 127.0.0.1 and print their URLs")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--prefect-port", type=int, default=4200)
    p.add_argument("--mlflow-port", type=int, default=5000)
    p.add_argument("--mlflow-store", help="MLflow backend store URI (default: sqlite under ./runs)")
    p.set_defaults(func=ui)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `longstraw` script."""
    return run(parser(), argv, user_errors=(RunDirLocked,))


if __name__ == "__main__":
    sys.exit(main())
