"""Every bench script runs in its smoke mode (`--quick` / `--smoke` / `--dry-run`, seconds each) and prints the table
and writes the JSON it is for, so a refactor of the library cannot break a benchmark unseen (issue 38, item 7).

The scripts are found, not listed: a `bench/*.py` or `bench/gpu/*.py` with a `__main__` block is a script, and one
without an entry in SMOKES (or COVERED, for one whose smoke has a test file of its own) fails here. Every JSON
goes to the test's tmp dir, never into bench/out or bench/results. A script fails only when it exits non-zero or
hangs (tests/progress.py), never for being slow on a loaded machine."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import progress

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def scripts() -> list[str]:
    """bench/ and bench/gpu/ Python files that run as scripts (relative paths)."""
    found = [*BENCH.glob("*.py"), *(BENCH / "gpu").glob("*.py")]
    return sorted(str(p.relative_to(BENCH)) for p in found if 'if __name__ == "__main__":' in p.read_text())


def finite(*xs: float) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


@dataclass(frozen=True)
class Smoke:
    args: Callable[[Path], list[str]]  # the smoke flag and where the JSON goes (tmp dir)
    check: Callable[[str, Path], None]  # (stdout, tmp dir): what the table and JSON must show


def _hashes(out: str, d: Path) -> None:
    assert out.splitlines()[1].split()[:2] == ["hash", "GB/s"]
    rows = json.loads((d / "r.json").read_text())["rows"]
    assert set(rows) == {"sha256", "blake2b", "crc32c", "zlib crc32"}
    assert all(finite(r["gb_per_s"], r["seconds"]) and r["gb_per_s"] > 0 for r in rows.values())


def _score_memory(out: str, d: Path) -> None:
    assert "score peak MiB" in out and "score peak growth" in out
    rows = json.loads((d / "r.json").read_text())
    assert [r["P"] for r in rows] == [128, 256]
    assert all(r["state_bytes"] > 0 and finite(r["score_peak_bytes"], r["capture_s"], r["score_s"]) for r in rows)
    assert rows[1]["state_bytes"] > rows[0]["state_bytes"]  # the prefix state grows with P


def _rollout(out: str, d: Path) -> None:
    assert "tokens/s" in out and "throughput n=2 / n=1" in out
    rows = json.loads((d / "r.json").read_text())
    assert [(r["n"], r["compile"]) for r in rows] == [(1, False), (2, False)]
    assert all(r["tokens_per_s"] > 0 and finite(r["seconds"], r["tokens_per_s"]) for r in rows)


def _dist_step(out: str, d: Path) -> None:
    assert "grad rel err vs N=1" in out
    rows = json.loads((d / "r.json").read_text())["rows"]
    assert [(r["N"], len(r["state_bytes_per_rank"])) for r in rows] == [(1, 1), (2, 2)]
    # two ranks hold half the state each and compute N = 1's gradient
    assert rows[1]["state_bytes_per_rank"][0] < rows[0]["state_bytes_per_rank"][0]
    assert rows[1]["grad_rel_err_vs_1_first_2048"] < 1e-4 and finite(rows[1]["wall_seconds"])


def _plan_vs_step(out: str, d: Path) -> None:
    assert "planned/RSS" in out
    rows = json.loads((d / "r.json").read_text())
    assert [r["N"] for r in rows] == [1, 2]
    assert all(r["planned_bytes"] > 0 and r["measured_bytes"] > 0 for r in rows)


def _work_per_rank(out: str, d: Path) -> None:
    assert "PROBLEM" not in out
    family = json.loads((d / "r.json").read_text())["families"]["dense"]
    rows = {r["N"]: r for r in family["rows"]}
    assert sorted(rows) == [1, 2] and rows[1]["sum_flops"] > 0 and rows[2]["busiest_flops"] < rows[1]["sum_flops"]


def _pipeline(out: str, d: Path) -> None:
    assert "orchestration" in out and "dState of one group" in out
    data = json.loads((d / "r.json").read_text())
    (run,) = data["runs"]
    assert run["nproc"] == 1 and {"capture", "rollout", "replay", "prompt", "optimizer"} <= set(run["stages"])
    assert finite(run["step_seconds"], run["orchestration_share"]) and data["dstate_io"]["bytes"] > 0


def _sharded_load(out: str, d: Path) -> None:
    assert "same weights both ways" in out
    rows = json.loads((d / "r.json").read_text())["rows"]
    assert sorted((r["way"], r["rank"]) for r in rows) == [("every rank", 0), ("every rank", 1), ("rank 0", 0),
                                                           ("rank 0", 1)]
    assert all(r["shard_mb"] > 0 and finite(r["seconds"]) for r in rows)


def _grpo_step(out: str, d: Path) -> None:
    assert "ERROR" not in out and "WARNING" not in out and "peak RSS growth" in out
    runs = json.loads((d / "r.json").read_text())["runs"]
    modes = ["naive", "detached", "exact", "exact-recompute"]
    assert sorted((r["mode"], r["G"]) for r in runs) == sorted((m, g) for m in modes for g in (2, 4))
    assert all(r["P"] == 256 and finite(r["seconds"], r["grad_norm"]) and r["grad_norm"] > 0 for r in runs)


def _convergence(out: str, d: Path) -> None:
    assert "gap to exact" in out and "smoke:" in out and "5 PNGs" in out
    summary = json.loads((d / "out" / "convergence_summary.json").read_text())
    rows = {r["mode"]: r for r in summary["summary"]}
    assert sorted(rows) == ["detached", "exact", "naive"] and all(r["seeds"] == 1 for r in rows.values())
    (same,) = rows["naive"]["same_as_exact"]  # naive trains exactly as exact does
    assert same["identical_steps"] == same["of"] == 2
    assert [s["model"] for s in summary["sweeps"]] == ["dense", "dense init"]
    assert all(-1.0 <= s["cos"] < 0.999 for s in summary["sweeps"])  # detaching drops part of the gradient
    runs = json.loads((d / "cache" / "convergence-smoke.json").read_text())["runs"]
    # 2 steps, then the final held-out evaluation
    assert all([h["step"] for h in r["history"]] == [0, 1, 2] and "held_out" in r["history"][-1] for r in runs)
    assert all(finite(h["grad_norm"], h["reward_mean"]) for r in runs for h in r["history"][:2])
    assert len(list((d / "out").glob("*.png"))) == 5


def _rehearse_goal(out: str, d: Path) -> None:
    assert "planner/rehearsal" in out
    (row,) = json.loads((d / "r.json").read_text())["rows"]
    assert row["checkpoint_layers"] and row["chunk"] == 32 and set(row["phases"]) >= {"replay", "prompt backward"}
    assert row["rehearsed_bytes"] > row["phases"]["model"] > 0 and finite(row["ratio"]) and row["ratio"] > 0


def _gpu_env(out: str, d: Path) -> None:
    report = json.loads((d / "env.json").read_text())
    assert report["torch"] and report["cuda_available"] is False and report["sdpa"]  # the CPU, reported


SMOKES: dict[str, Smoke] = {
    "hashes.py": Smoke(lambda d: ["--quick", "--out", str(d / "r.json")], _hashes),
    "score_memory.py": Smoke(lambda d: ["--quick", "--threads", "1", "--out", str(d / "r.json")], _score_memory),
    "rollout.py": Smoke(lambda d: ["--quick", "--threads", "1", "--out", str(d / "r.json")], _rollout),
    "dist_step.py": Smoke(lambda d: ["--quick", "--out", str(d / "r.json")], _dist_step),
    # reads dist_step.py's JSON: the smoke runs that first (below)
    "plan_vs_step.py": Smoke(lambda d: [str(d / "dist_step.json"), "--out", str(d / "r.json")], _plan_vs_step),
    "work_per_rank.py": Smoke(lambda d: ["--quick", "--json", str(d / "r.json")], _work_per_rank),
    "pipeline.py": Smoke(lambda d: ["--quick", "--out", str(d / "r.json")], _pipeline),
    "sharded_load.py": Smoke(lambda d: ["--quick", "--out", str(d / "r.json")], _sharded_load),
    # --quick's grid narrowed to one P and two G (8 workers instead of 16)
    "grpo_step.py": Smoke(lambda d: ["--quick", "--P", "256", "--G", "2", "4", "--R", "16", "--threads", "1",
                                     "--out", str(d / "r.json")], _grpo_step),
    # the CLI end to end at the smallest plan (--quick takes minutes: 3 warm starts, 5 cells, 2 seeds)
    "convergence.py": Smoke(lambda d: ["--smoke", "--no-progress", "--out", str(d / "out"), "--cache",
                                       str(d / "cache")], _convergence),
    "rehearse_goal.py": Smoke(lambda d: ["--smoke", "--out", str(d / "r.json")], _rehearse_goal),
    "gpu/env.py": Smoke(lambda d: ["--dry-run", "--out", str(d / "env.json")], _gpu_env),
}
# scripts whose smoke runs in a test file of its own (slower, with more checks): file -> what it must run
COVERED = {
    "gpu/bench.py": ("tests/bench/test_gpu_bench.py", '"--dry-run"'),
}


def run(script: str, args: list[str], tmp: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = progress.run([sys.executable, str(BENCH / script), *args], cwd=tmp, env=env)
    assert done.returncode == 0, f"{script} {' '.join(args)} exited {done.returncode}:\n" \
                                 f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def test_every_script_has_a_smoke():
    found = scripts()
    assert "grpo_step.py" in found and "gpu/bench.py" in found  # the discovery itself works
    missing = [s for s in found if s not in SMOKES and s not in COVERED]
    assert not missing, f"bench scripts without a smoke mode in {__file__}'s SMOKES: {missing}"
    stale = [s for s in [*SMOKES, *COVERED] if s not in found]
    assert not stale, f"SMOKES/COVERED name scripts that are gone: {stale}"


@pytest.mark.parametrize("script", sorted(COVERED))
def test_covered_smokes_exist(script):
    path, needle = COVERED[script]
    text = (ROOT / path).read_text()
    assert Path(script).stem in text and needle in text, f"{path} no longer runs {script}'s smoke ({needle})"


@pytest.mark.parametrize("script", sorted(SMOKES))
def test_smoke(script, tmp_path):
    if script == "plan_vs_step.py":
        run("dist_step.py", ["--quick", "--out", str(tmp_path / "dist_step.json")], tmp_path)
    smoke = SMOKES[script]
    out = run(script, smoke.args(tmp_path), tmp_path)
    smoke.check(out, tmp_path)
    assert not (tmp_path / "bench").exists()  # nothing went to a default bench/out path (cwd is tmp_path)
