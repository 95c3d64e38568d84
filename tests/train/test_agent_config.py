"""The run config's `agent` section (what cannot work together is one line naming the fix), the reserved reward
`env`, and rollouts with masks in the store: written and read back, and a rollout stored without them (before
agents) reading as one answer per branch with no masks."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from longstraw.files import Artefact
from longstraw.sampler import SAMPLERS
from longstraw.store import load_rollout, manifest_digest, save_rollout
from longstraw.train import inputs
from longstraw.train.answers import Answers
from tests.train.test_train_inputs import make_cfg

AGENT = {"env": "record-lookup", "max_turns": 2}


def test_agent_defaults_and_what_cannot_work_together(tmp_path, monkeypatch):
    monkeypatch.setitem(SAMPLERS, "server", object)  # another sampler backend, registered
    cfg = make_cfg(tmp_path, agent=AGENT)
    assert cfg.rewards == ["env"] and cfg.agent.tools is None and cfg.agent.tool_timeout == 10.0
    assert make_cfg(tmp_path).rewards == ["kv-retrieval"] and make_cfg(tmp_path).agent is None
    assert make_cfg(tmp_path, agent=AGENT, reward=["env", "exact_match"]).rewards == ["env", "exact_match"]
    # a dataset needs a reward unless the environment gives it
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    assert make_cfg(tmp_path, task=None, dataset=str(data), agent=AGENT).rewards == ["env"]
    cases = [
        (dict(reward="env"), "reward 'env' is the rewards an agent's environment gives, but no `agent` is set"),
        (dict(reward=["exact_match", "env"]), "no `agent` is set"),
        (dict(agent=AGENT, rollout={"backend": "server"}), "agent branches decode on LongStraw's own sampler"),
        (dict(agent={"env": " "}), "agent.env is empty"),
        (dict(agent={"env": "x:y", "max_turns": 0}), "greater than or equal to 1"),
        (dict(agent={"env": "x:y", "tool_timeout": 0}), "greater than 0"),
        (dict(agent={"env": "x:y", "stop": "?"}), "Extra inputs are not permitted"),
    ]
    for kw, match in cases:
        with pytest.raises(ValidationError, match=match):
            make_cfg(tmp_path, **kw)


def test_preflight_resolves_the_environment_and_its_tools(tmp_path):
    inputs.preflight(make_cfg(tmp_path, agent=AGENT))  # the built-in one
    for env, match in [("no-such-env", "unknown agent.env 'no-such-env'; built-in environments: record-lookup"),
                       ("no_such_module_x:make_env", "no module named 'no_such_module_x'")]:
        with pytest.raises(ValueError, match=match):
            inputs.preflight(make_cfg(tmp_path, agent={"env": env}))


def _tokens(*lengths: int) -> list[torch.Tensor]:
    return [torch.arange(n, dtype=torch.int64) + 3 for n in lengths]


def test_masks_are_stored_with_the_rollout_and_absent_ones_read_as_none(tmp_path):
    responses = _tokens(5, 3)
    logps = [-torch.rand(5), -torch.rand(3)]
    masks = [torch.tensor([True, True, False, False, True]), torch.tensor([True, True, True])]
    meta = {"finish_reasons": ["stop", "length"], "texts": ["a", "b"], "example": None}
    url = str(tmp_path / "with")
    save_rollout(url, responses, logps, meta, masks=masks)
    got = load_rollout(url)
    assert all(m.dtype == torch.bool and torch.equal(m, w) for m, w in zip(got.masks, masks, strict=True))
    assert Answers.stored(got).masks is got.masks
    with pytest.raises(ValueError, match="one mask per response token"):
        save_rollout(str(tmp_path / "bad"), responses, logps, meta, masks=[masks[0], masks[0]])
    # a rollout written before masks existed (no "masks" array): every token is the model's
    url = str(tmp_path / "without")
    save_rollout(url, responses, logps, meta)
    manifest = json.loads((tmp_path / "without" / "manifest.json").read_text())
    assert "masks" not in manifest["arrays"]
    assert load_rollout(url).masks is None and Answers.stored(load_rollout(url)).masks is None


def test_the_env_reward_reads_the_rollout_and_refuses_one_without_it(tmp_path):
    cfg = make_cfg(tmp_path, agent=AGENT, reward=["env", "tests.flows.rewards:digit_share"])
    responses, logps = _tokens(2, 2, 2, 2), [-torch.rand(2) for _ in range(4)]
    meta = {"finish_reasons": ["stop"] * 4, "texts": ["12", "ab", "1b", "a2"],
            "example": {"answer": "1", "meta": {}}, "agent": {"rewards": [1.0, None, 0.25, 0.0]}}
    url = str(tmp_path / "r")
    roll = Artefact(url, manifest_digest(save_rollout(url, responses, logps, meta))).to_json()
    out = inputs.reward_stage(cfg, roll, 0, 0)
    record = json.loads(open(out["path"]).read())
    assert record["rewards_per_function"]["env"] == [1.0, None, 0.25, 0.0]  # None: NaN, does not apply
    assert record["rewards_per_function"]["tests.flows.rewards:digit_share"] == [1.0, 0.0, 0.5, 0.5]
    assert record["rewards"] == [2.0, 0.0, 0.75, 0.5]  # nansum, as for any reward that does not apply
    assert out["rewards/env/mean"] == pytest.approx(1.25 / 3)
    # a branch cut short (budget or max_turns) before the environment rewarded it failed: 0, not "does not apply"
    meta["finish_reasons"] = ["stop", "length", "stop", "turns"]
    meta["agent"]["rewards"] = [1.0, None, None, None]
    url = str(tmp_path / "cut")
    roll = Artefact(url, manifest_digest(save_rollout(url, responses, logps, meta))).to_json()
    record = json.loads(open(inputs.reward_stage(cfg, roll, 0, 0)["path"]).read())
    assert record["rewards_per_function"]["env"] == [1.0, 0.0, None, 0.0]
    del meta["agent"]
    url = str(tmp_path / "plain")
    roll = Artefact(url, manifest_digest(save_rollout(url, responses, logps, meta))).to_json()
    with pytest.raises(ValueError, match="reward 'env' reads the environments' rewards stored with the rollout"):
        inputs.reward_stage(cfg, roll, 0, 0)
