"""Several reward functions through the pipeline: a YAML config with two weighted rewards and batch scaling runs
through `longstraw train`; each group's record holds each function's rewards, the advantages the replays read
equal the formula over the whole step's rewards, and each function's mean reaches the step's metrics. The order
that batch advantages need (score every group, then replay) gives the same update as the usual group-by-group
order."""

from __future__ import annotations

import json

import torch
import yaml

import flows.train
from flows.cli import main
from longstraw.train import inputs
from longstraw.train.worker import Worker
from tests.flows.rewards import digit_share, letter_share
from tests.flows.test_train_flow import config, weights
from tests.grpo.test_advantages import reference

REWARDS = ["tests.flows.rewards:digit_share", "tests.flows.rewards:letter_share"]


def _calls(monkeypatch) -> list[tuple[str, int]]:
    """(stage, group) of every replay, reward and advantages call, in order."""
    calls: list[tuple[str, int]] = []
    fn = Worker.OPS["replay"]
    monkeypatch.setitem(Worker.OPS, "replay", lambda self, *a, **kw: calls.append(("replay", kw["group"]))
                        or fn(self, *a, **kw))
    for name in ("reward_stage", "advantage_stage"):
        stage = getattr(inputs, name)
        monkeypatch.setattr(inputs, name, lambda cfg, *a, _s=stage, _n=name, **kw: calls.append((_n, kw["group"]))
                            or _s(cfg, *a, **kw))
    return calls


def test_two_weighted_rewards_with_batch_scaling_through_longstraw_train(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    cfg = config(run_dir, steps=1, groups=2, reward=REWARDS,
                 grpo={"reward_weights": [1.0, 0.5], "scale_rewards": "batch"})
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**cfg, "grpo": {"reward_weights": [1.0]}}))
    assert main(["train", "--config", str(bad), "--no-progress"]) == 2
    assert "grpo.reward_weights has 1 weight(s) for 2 reward function(s)" in capsys.readouterr().err
    assert not run_dir.exists()

    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    calls = _calls(monkeypatch)
    assert main(["train", "--config", str(path), "--no-progress"]) == 0
    # every group scored before any advantage, every advantage before any replay
    assert calls[:4] == [("reward_stage", 0), ("reward_stage", 1), ("advantage_stage", 0), ("advantage_stage", 1)]
    assert {c for c in calls[4:]} == {("replay", 0), ("replay", 1)} and len(calls) == 4 + 2 * 4

    step = run_dir / "steps" / "step-000000"
    records = [json.loads((step / f"rewards-g{g:03d}.json").read_text()) for g in range(2)]
    rows = []
    for rec in records:
        per = rec["rewards_per_function"]
        assert list(per) == REWARDS and "advantages" not in rec  # batch advantages come from their own stage
        assert per[REWARDS[0]] == [digit_share({}, t) for t in rec["texts"]]
        assert per[REWARDS[1]] == [letter_share({}, t) for t in rec["texts"]]  # None: null in the record
        rows += [list(r) for r in zip(*per.values())]
    want = reference(rows, 4, [1.0, 0.5], "batch", "sum_then_normalize")
    got = [a for g in range(2) for a in json.loads((step / f"advantages-g{g:03d}.json").read_text())["advantages"]]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-12, atol=1e-12)
    assert max(map(abs, got)) > 0.1

    history = json.loads((run_dir / "history.json").read_text())[0]
    for name, fn in zip(REWARDS, (digit_share, letter_share)):
        means = []
        for rec in records:
            present = [v for v in (fn({}, t) for t in rec["texts"]) if v is not None]
            if present:
                means.append(sum(present) / len(present))
        key = inputs.reward_metric(name)
        assert abs(history[key] - sum(means) / len(means)) < 1e-12, key
    assert history["grad_norm"] > 0


def test_scoring_every_group_first_gives_the_group_by_group_update(tmp_path, monkeypatch):
    """The batch order (rewards of all groups, then replays, each state read back from the store) against the
    usual one, both with group scaling: the same weights, bit for bit, in exact mode. Two epochs: the second
    replays group by group on the advantages' records."""
    usual = weights(flows.train.grpo_train(config(tmp_path / "usual", steps=1, groups=2, epochs=2), progress=False))
    calls = _calls(monkeypatch)
    monkeypatch.setattr(flows.train, "needs_batch_advantages", lambda cfg: True)
    deferred = weights(flows.train.grpo_train(config(tmp_path / "deferred", steps=1, groups=2, epochs=2),
                                              progress=False))
    assert calls[:4] == [("reward_stage", 0), ("reward_stage", 1), ("advantage_stage", 0), ("advantage_stage", 1)]
    assert len(calls) == 4 + 2 * 2 * 4  # each epoch replays both groups' 4 branches
    assert all(torch.equal(deferred[k], usual[k]) for k in usual)
    start = weights({"checkpoint": str(tmp_path / "usual" / "checkpoints" / "update-000000")})
    assert any(not torch.equal(start[k], usual[k]) for k in usual)  # the update moved the weights
