"""MoE routing replay through `longstraw train` (`moe_routing_replay: true`, a tiny GLM-5-shaped model, two updates
per rollout, two groups): the rollouts store their answers' routing, each group's epoch-1 state holds its epoch-0
routing (the flow hands epoch 0's state to the later capture), and on 2 sequence-parallel gloo ranks (the state and
its routing sharded, epoch 1 reading it back from both shards) the weights equal one process's (float64)."""

from __future__ import annotations

import json

import torch
import yaml
from safetensors.torch import load_file

from longstraw.sharded_state import load_state_routing
from longstraw.store import load_rollout
from tests.conftest import GLM
from tests.flows.test_ranks import _cli
from tests.flows.test_train_flow import config


def test_routing_replay_through_longstraw_train_on_two_ranks_equals_one(tmp_path):
    finals = {}
    for ranks in (1, 2):
        name = f"ranks{ranks}"
        cfg = config(tmp_path / name, dtype="float64", threads=1, steps=1, groups=2, epochs=2,
                     moe_routing_replay=True, model={"random": {**GLM, "vocab_size": 260}},
                     engine={"prompt_chunk": 100})
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        done = _cli(["train", "--config", str(path), "--nproc", str(ranks)], tmp_path)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        assert json.loads((tmp_path / name / "history.json").read_text())[0]["grad_norm"] > 0
        store = tmp_path / name / "store"
        for g in range(2):
            rollout = load_rollout(str(store / "rollouts" / "step-000000" / f"group-{g:03d}"))
            assert rollout.routing is not None and len(rollout.routing) == 4
            assert all(sorted(r) == [1, 2, 3] and r[1].shape == (t.numel(), 2)
                       for r, t in zip(rollout.routing, rollout.responses))
            states = store / "states" / "step-000000" / f"group-{g:03d}"
            first, later = (load_state_routing(str(states / f"epoch-{e:02d}")) for e in (0, 1))
            assert sorted(first) == [1, 2] and all(torch.equal(later[j], ids) for j, ids in first.items())
        finals[ranks] = load_file(str(tmp_path / name / "checkpoints" / "update-000002" / "model.safetensors"))
    start = load_file(str(tmp_path / "ranks1" / "checkpoints" / "update-000000" / "model.safetensors"))
    assert any(not torch.equal(finals[1][k], start[k]) for k in start)
    for k in finals[1]:
        assert torch.allclose(finals[2][k], finals[1][k], rtol=0, atol=1e-6), k
