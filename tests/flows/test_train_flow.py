"""End to end through Prefect (ephemeral) and MLflow (sqlite), on one process (the N = 1 case of the resident
workers): a failed replay fails the flow; the re-run resumes from stored state without recapturing or rolling out
again, replays the step's branches again (their gradients lived in memory) and ends with the weights of an
uninterrupted run; MLflow holds one parent run with nested stage runs and the step metrics."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

import longstraw.train.worker as worker_module
from flows.cli import main
from flows.train import grpo_train
from longstraw.train import inputs
from longstraw.train.config import TrainConfig
from longstraw.train.worker import Worker
from tests.conftest import tiny_config

STEP_METRICS = ("reward_mean", "reward_std", "accuracy", "loss", "kl", "clip_frac", "entropy", "grad_norm",
                "response_len", "prefix_state_bytes", "peak_bytes", "step_seconds", "tokens_per_s", "capture_seconds",
                "rollout_seconds", "replay_seconds", "prompt_backward_seconds", "optimizer_seconds",
                "sampler_logp_diff_mean", "sampler_logp_diff_max", "sampler_kl")
OPS = ("start", "capture", "rollout", "replay", "prompt", "optimizer")


def config(run_dir, **kw) -> dict:
    model = tiny_config("qwen3", vocab_size=260, max_position_embeddings=1024, num_hidden_layers=2)
    base = dict(model={"random": model}, prompt_tokens=256, steps=2, groups=1, responses=4, max_new_tokens=6,
                reward="tests.flows.rewards:digit_share", engine={"prompt_chunk": 128}, run_dir=str(run_dir),
                optim={"lr": 1e-2}, pipeline={"branches_per_task": 1, "retries": 0})
    return TrainConfig.model_validate(base | kw).model_dump(mode="json")


@pytest.fixture
def counted(monkeypatch):
    """Count executions of every op of the resident worker and of the reward, and the models built or loaded."""
    calls: Counter = Counter()
    for name in OPS:
        fn = Worker.OPS[name]

        def wrapped(self, *a, _fn=fn, _name=name, **kw):
            calls[(_name, kw.get("step"))] += 1
            return _fn(self, *a, **kw)

        monkeypatch.setitem(Worker.OPS, name, wrapped)
    reward = inputs.reward_stage

    def counted_reward(cfg, *a, **kw):
        calls[("reward", kw.get("step"))] += 1
        return reward(cfg, *a, **kw)

    monkeypatch.setattr(inputs, "reward_stage", counted_reward)
    for name in ("load_model", "build_model"):  # what Worker.start calls to get its model
        fn = getattr(worker_module, name)

        def loading(*a, _fn=fn, **kw):
            calls[("model_load", None)] += 1
            return _fn(*a, **kw)

        monkeypatch.setattr(worker_module, name, loading)
    import longstraw.train.checkpoint as ckpt

    load = ckpt.load_model

    def loading_checkpoint(*a, **kw):
        calls[("model_load", None)] += 1
        return load(*a, **kw)

    monkeypatch.setattr(ckpt, "load_model", loading_checkpoint)
    return calls


def weights(out: dict) -> dict[str, torch.Tensor]:
    return load_file(f"{out['checkpoint']}/model.safetensors")


def _failing(monkeypatch, name: str, when):
    fn = Worker.OPS[name]

    def flaky(self, *a, **kw):
        if when(kw):
            raise RuntimeError(f"injected {name} fault")
        return fn(self, *a, **kw)

    monkeypatch.setitem(Worker.OPS, name, flaky)
    return fn


def test_fault_then_resume_matches_uninterrupted(tmp_path, counted, monkeypatch):
    cfg = config(tmp_path / "run")
    replay = _failing(monkeypatch, "replay", lambda kw: kw["step"] == 1 and kw["branches"] == [[2]])
    with pytest.raises(Exception, match="injected replay fault"):
        grpo_train(cfg, progress=False)
    assert counted[("rollout", 1)] == 1 and counted[("capture", 1)] == 1
    assert counted[("optimizer", 0)] == 1 and counted[("optimizer", 1)] == 0
    assert counted[("model_load", None)] == 1 and counted[("start", None)] == 1  # one load per worker start

    monkeypatch.setitem(Worker.OPS, "replay", replay)
    before = counted.copy()
    assert main(["resume", str(tmp_path / "run"), "--no-progress"]) == 0  # what a user types
    new = counted - before
    # step 0 was finished: nothing of it runs again; of step 1, what was stored comes from the store
    assert not any(step == 0 for _, step in new)
    assert new[("capture", 1)] == 0 and new[("rollout", 1)] == 0 and new[("reward", 1)] == 0  # never recaptured
    assert new[("replay", 1)] == 4  # the step's gradients lived in memory: all its branches replay again
    assert new[("prompt", 1)] == 1 and new[("optimizer", 1)] == 1
    assert new[("model_load", None)] == 1 and new[("start", None)] == 1

    clean = grpo_train(config(tmp_path / "clean"), progress=False)
    resumed = {"checkpoint": str(tmp_path / "run" / "checkpoints" / "update-000002")}
    got, want = weights(resumed), weights(clean)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    start = load_file(str(tmp_path / "run" / "checkpoints" / "update-000000" / "model.safetensors"))
    assert any(not torch.equal(start[k], want[k]) for k in want)  # training moved the weights
    assert not list((tmp_path / "run").rglob("replay-*"))  # no gradient files: gradients stay in memory
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert [h["step"] for h in history] == [0, 1]


def test_checkpoints_every_k_steps_and_resume_from_the_last(tmp_path, counted, monkeypatch):
    """checkpoint_every 2 of 3 steps: checkpoints after steps 1 and 2 only. A fault in step 2 resumes from
    update 2, recomputing nothing stored, and ends with the weights of an uninterrupted run."""
    cfg = config(tmp_path / "run", steps=3, pipeline={"checkpoint_every": 2, "retries": 0})
    prompt = _failing(monkeypatch, "prompt", lambda kw: kw["step"] == 2)
    with pytest.raises(Exception, match="injected prompt fault"):
        grpo_train(cfg, progress=False)
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["update-000000", "update-000002"]
    monkeypatch.setitem(Worker.OPS, "prompt", prompt)
    before = counted.copy()
    out = grpo_train(cfg, progress=False)
    new = counted - before
    assert new[("capture", 2)] == new[("rollout", 2)] == 0 and new[("replay", 2)] == 4
    assert not any(step in (0, 1) for _, step in new)
    clean = grpo_train(config(tmp_path / "clean", steps=3, pipeline={"checkpoint_every": 2, "retries": 0}),
                       progress=False)
    got, want = weights(out), weights(clean)
    assert out["checkpoint"].endswith("update-000003") and all(torch.equal(got[k], want[k]) for k in want)


def test_resume_after_a_library_change_recomputes_the_completed_stages(tmp_path, counted, monkeypatch):
    """Cache keys include the digest of the library's sources: a resume with the same code takes the stored
    stages from the cache, one after a change anywhere in the library computes them again."""
    import tasks.stages

    cfg = config(tmp_path / "run", steps=1)
    optimizer = _failing(monkeypatch, "optimizer", lambda kw: True)
    for _ in range(2):  # the first run, then a resume with the same code: it fails at the same place
        before = counted.copy()
        with pytest.raises(Exception, match="injected optimizer fault"):
            grpo_train(cfg, progress=False)
        new = counted - before
    assert new[("capture", 0)] == new[("rollout", 0)] == new[("reward", 0)] == 0  # cached
    assert new[("replay", 0)] == 4 and new[("prompt", 0)] == 1  # in memory only: computed again
    monkeypatch.setitem(Worker.OPS, "optimizer", optimizer)
    monkeypatch.setattr(tasks.stages, "code_digest", lambda: "0.1.0+changed")
    before = counted.copy()
    grpo_train(cfg, progress=False)
    new = counted - before
    assert new[("capture", 0)] == new[("rollout", 0)] == new[("reward", 0)] == 1
    assert new[("replay", 0)] == 4 and new[("prompt", 0)] == 1 and new[("optimizer", 0)] == 1


def test_a_cached_stage_whose_artefact_is_gone_runs_again(tmp_path, counted):
    """The user deletes the final checkpoint and the step's stored rollout; resume recomputes the step from
    update 0: the rollout runs again (cached, but its artefact is gone), the capture comes from the store, and
    the weights are the same."""
    import shutil

    cfg = config(tmp_path / "run", steps=1)
    first = weights(grpo_train(cfg, progress=False))
    final = tmp_path / "run" / "checkpoints" / "update-000001"
    shutil.rmtree(final)
    shutil.rmtree(tmp_path / "run" / "store" / "rollouts")
    before = counted.copy()
    assert main(["resume", str(tmp_path / "run"), "--no-progress"]) == 0
    new = counted - before
    assert final.is_dir() and new[("optimizer", 0)] == 1 and new[("rollout", 0)] == 1
    assert new[("replay", 0)] == 4 and new[("prompt", 0)] == 1
    assert new[("capture", 0)] == 0
    again = weights({"checkpoint": str(final)})
    assert all(torch.equal(again[k], first[k]) for k in first)


def test_a_corrupted_state_is_recomputed_not_stuck(tmp_path, counted, monkeypatch):
    """A state shard corrupted between capture and replay: resume drops it, recomputes the capture (cached, but
    its artefact is gone) and finishes with the weights of an uninterrupted run."""
    cfg = config(tmp_path / "run", steps=1)
    replay = _failing(monkeypatch, "replay", lambda kw: True)
    with pytest.raises(Exception, match="injected replay fault"):
        grpo_train(cfg, progress=False)
    monkeypatch.setitem(Worker.OPS, "replay", replay)
    shard = next(p for p in sorted((tmp_path / "run" / "store" / "states").rglob("*")) if p.is_file() and "/c/" in str(p))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = counted.copy()
    out = grpo_train(cfg, progress=False)
    new = counted - before
    assert new[("capture", 0)] == 1 and new[("rollout", 0)] == 0 and new[("optimizer", 0)] == 1
    clean = weights(grpo_train(config(tmp_path / "clean", steps=1), progress=False))
    got = weights(out)
    assert all(torch.equal(got[k], clean[k]) for k in clean)


def test_a_kill_after_the_commit_keeps_the_steps_record(tmp_path, counted, monkeypatch):
    """Killed between a step's checkpoint commit and its record (history, MLflow): resume takes the record that
    was committed with the checkpoint, recomputing nothing."""
    from tasks import tracking

    cfg = config(tmp_path / "run", steps=1)
    log = tracking.log_metrics

    def killed(c, run_id, metrics, step):
        if "step_seconds" in metrics:  # the step's record, after the optimizer committed its checkpoint
            raise KeyboardInterrupt("killed")
        return log(c, run_id, metrics, step)

    monkeypatch.setattr(tracking, "log_metrics", killed)
    with pytest.raises(BaseException, match="killed"):
        grpo_train(cfg, progress=False)
    assert (tmp_path / "run" / "checkpoints" / "update-000001").is_dir()
    assert not (tmp_path / "run" / "history.json").exists()
    monkeypatch.setattr(tracking, "log_metrics", log)
    before = counted.copy()
    out = grpo_train(cfg, progress=False)
    assert not [k for k in counted - before if k[0] not in ("start", "model_load")]  # nothing recomputed
    assert [h["step"] for h in out["history"]] == [0] and out["history"][0]["grad_norm"] > 0
    assert [h["step"] for h in json.loads((tmp_path / "run" / "history.json").read_text())] == [0]


def test_code_digest_covers_every_library_source(tmp_path):
    """A change deep in the library (the loss), not only in a stage function, changes the digest."""
    import shutil

    from longstraw.version import PACKAGE, code_digest, source_digest

    copy = tmp_path / "longstraw"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert source_digest(copy) == source_digest(PACKAGE) and code_digest().endswith(source_digest(copy)[:16])
    loss = copy / "grpo" / "loss.py"
    loss.write_text(loss.read_text() + "\n# a change\n")
    assert source_digest(copy) != source_digest(PACKAGE)


def test_mlflow_parent_run_has_nested_stage_runs_and_metrics(tmp_path):
    from mlflow import MlflowClient

    cfg = config(tmp_path / "run", steps=1, grpo={"kl_coef": 0.05})
    out = grpo_train(cfg, progress=False)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("longstraw")
    runs = client.search_runs([exp.experiment_id])
    parent = client.get_run(out["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    assert set(STEP_METRICS) <= set(parent.data.metrics)
    assert parent.data.metrics["kl"] >= 0 and parent.data.params["grpo.kl_coef"] == "0.05"
    # sampled at temperature 1 unfiltered, replayed on the same weights: the sampler's log-probs are the trainer's
    # up to rounding; no correction, no weight
    assert 0 <= parent.data.metrics["sampler_logp_diff_mean"] <= parent.data.metrics["sampler_logp_diff_max"] < 1e-4
    assert "correction_weight_mean" not in parent.data.metrics
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    stages = Counter(r.data.tags["stage"] for r in children)
    assert stages == {"capture": 1, "rollout": 1, "reference": 1, "reward": 1, "replay": 4, "prompt": 1,
                      "optimizer": 1}
    replay = next(r for r in children if r.data.tags["stage"] == "replay")
    assert {"loss", "seconds", "tokens_per_s", "peak_bytes"} <= set(replay.data.metrics)
    artefacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"reward_curve.png", "config.json"} <= artefacts


def test_a_resumed_lora_run_ends_bit_identical(tmp_path, counted, monkeypatch):
    """LoRA through the pipeline: a replay fault in step 1, then resume; the adapter equals an uninterrupted run's
    bit for bit. The base weights are written once (update 0); later checkpoints hold the adapter and name it."""
    lora = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    cfg = config(tmp_path / "run", lora=lora)
    replay = _failing(monkeypatch, "replay", lambda kw: kw["step"] == 1)
    with pytest.raises(Exception, match="injected replay fault"):
        grpo_train(cfg, progress=False)
    monkeypatch.setitem(Worker.OPS, "replay", replay)
    grpo_train(cfg, progress=False)
    clean = grpo_train(config(tmp_path / "clean", lora=lora), progress=False)
    final = tmp_path / "run" / "checkpoints" / "update-000002"
    got, want = load_file(str(final / "adapter_model.safetensors")), load_file(
        f"{clean['checkpoint']}/adapter_model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    first = load_file(str(tmp_path / "run" / "checkpoints" / "update-000000" / "adapter_model.safetensors"))
    assert any(not torch.equal(first[k], want[k]) for k in want)  # the adapter trained
    assert not (final / "model.safetensors").exists()
    assert json.loads((final / "trainer.json").read_text())["base_checkpoint"] == "../update-000000"
