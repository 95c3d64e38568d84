"""The table a finished `longstraw train` prints (rank 0 of a multi-rank run prints it too)."""

from __future__ import annotations

from pathlib import Path


def report(out: dict) -> None:
    rows = out["history"]
    print(f"\n{'step':>4} {'reward':>7} {'acc':>6} {'loss':>9} {'grad':>7} {'len':>5} {'sec':>6}")
    for h in rows:
        print(f"{h['step']:>4} {h['reward_mean']:>7.3f} {h['accuracy']:>6.3f} {h['loss']:>9.4f} {h['grad_norm']:>7.3f} "
              f"{h['response_len']:>5.1f} {h['step_seconds']:>6.1f}")
    print(f"final checkpoint: {out['checkpoint']}\nMLflow run {out['mlflow_run_id']}; "
          f"reward curve: {Path(out['run_dir']) / 'reward_curve.png'}")
