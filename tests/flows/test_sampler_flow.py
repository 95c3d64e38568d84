"""The rollout seam through the `grpo-train` flow: a run whose `rollout.backend` names a sampler registered here
trains on that sampler's answers (stored as the step's rollout, scored by the reward, replayed)."""

from __future__ import annotations

import json

import torch

from flows.train import grpo_train
from longstraw.data.tokenizer import load_tokenizer
from longstraw.sampler import SAMPLERS
from longstraw.store import load_rollout
from longstraw.train.config import TrainConfig
from tests.flows.test_train_flow import config
from tests.train.test_sampler_backend import FAKE, FakeSampler


def test_a_registered_sampler_drives_the_flow(tmp_path, monkeypatch):
    fake = FakeSampler()
    monkeypatch.setitem(SAMPLERS, "fake", lambda options: fake)
    cfg = config(tmp_path / "run", steps=1, rollout={"backend": "fake"})
    out = grpo_train(cfg, progress=False)
    assert len(fake.calls) == 1  # one group, one rollout
    run = TrainConfig.model_validate(cfg)
    want = [list(t) for t in FAKE]
    want[-1][-1] = load_tokenizer(run.tokenizer).eos_id
    stored = load_rollout(f"{run.paths().store_url}/rollouts/step-000000/group-000")
    assert [r.tolist() for r in stored.responses] == want
    (step,) = out["history"]
    assert step["response_len"] == sum(map(len, FAKE)) / len(FAKE)
    record = json.loads((run.paths().step(0) / "rewards-g000.json").read_text())  # what the reward scored
    assert record["texts"] == [load_tokenizer(run.tokenizer).decode(t) for t in want]
    assert torch.isfinite(torch.tensor(step["loss"])) and torch.isfinite(torch.tensor(step["grad_norm"]))
