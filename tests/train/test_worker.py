"""The ops of the resident worker, run by hand on one process (no Prefect): their gradients, accumulated in memory
over replay slices and the prompt backward, equal `grpo_backward`'s naive mode; the optimizer op equals a
hand-written AdamW step; what they store is verified when read; a stored state carries what the prompt backward
needs, so a fresh worker continues from it without recapturing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import longstraw as ls
from longstraw.data.tokenizer import load_tokenizer
from longstraw.files import Artefact, CorruptArtefact
from longstraw.grpo.rewards import get_reward
from longstraw.train import inputs
from longstraw.train.artifacts import load_json
from longstraw.train.checkpoint import load_checkpoint, read_trainer
from longstraw.train.data import prompt_ids, step_example
from longstraw.train.optim import build_optimizer
from longstraw.train.worker import Worker, next_version
from tests.conftest import flat_grad, rel_err
from tests.train.test_train_inputs import make_cfg

ADV = [1.0, -0.5, 0.7, -1.2]


def step_group(cfg) -> tuple[Worker, dict, dict, dict, dict]:
    """A started worker, its capture and rollout, and fixed, non-zero advantages."""
    w = Worker(cfg)
    init = w.start()
    cap = w.capture(init["weights_version"], step=0, group=0, epoch=0)
    state = {"url": cap["url"], "sha256": cap["sha256"]}
    out = w.rollout(init["weights_version"], state, step=0, group=0)
    return w, init, state, {"path": out["path"], "sha256": out["sha256"]}, list(ADV)


def replay(w: Worker, state, roll, advantages, slices, epoch=0) -> list[dict]:
    return [w.replay(w.weights_version, state, roll, advantages, None, 0, 0, epoch, [b]) for b in slices]


def reference_grad(cfg, init, roll, mode, old=None) -> torch.Tensor:
    """grpo_backward in one call on the same prompt, responses and advantages."""
    model = ls.load_model(init["checkpoint"])
    tok = load_tokenizer(cfg.tokenizer)
    prompt = prompt_ids(tok, step_example(cfg, tok, 0, 0))
    responses = inputs.read_rollout(cfg, Artefact.from_json(roll)).responses
    model.zero_grad(set_to_none=True)
    ls.grpo_backward(model, prompt, responses, ADV, mode=mode, config=cfg.grpo, engine=cfg.engine, old_logprobs=old)
    return flat_grad(model)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_exact_ops_equal_naive(tmp_path, model_type):
    cfg = make_cfg(tmp_path, model_type)
    w, init, state, roll, rew = step_group(cfg)
    replay(w, state, roll, rew, ([0, 1], [2], [3]))  # uneven slices, as separate replay tasks take them
    detached = flat_grad(w.model).clone()
    w.prompt(w.weights_version, state, 0, 0, 0)
    want = reference_grad(cfg, init, roll, "naive")
    assert want.norm() > 0
    assert rel_err(flat_grad(w.model), want) <= 1e-5
    # the replays alone are the detached gradient, which differs from naive: the prompt op is not a no-op
    assert rel_err(detached, want) > 1e-2


def test_a_fresh_worker_continues_from_the_stored_state(tmp_path):
    """The prompt backward of a worker that did not capture (a resumed job): the state, its boundary states
    included, comes from the store; the gradient is the same as the capturing worker's, bitwise."""
    cfg = make_cfg(tmp_path, "qwen3_5_text", engine={"prompt_chunk": 48, "boundary_every": 2})
    w, init, state, roll, rew = step_group(cfg)
    replay(w, state, roll, rew, ([0, 1, 2, 3],))
    w.prompt(w.weights_version, state, 0, 0, 0)
    fresh = Worker(cfg)
    fresh.start()
    replay(fresh, state, roll, rew, ([0, 1, 2, 3],))
    fresh.prompt(fresh.weights_version, state, 0, 0, 0)
    assert torch.equal(flat_grad(fresh.model), flat_grad(w.model))


def test_detached_and_naive_modes(tmp_path):
    for mode in ("detached", "naive"):
        cfg = make_cfg(tmp_path / mode, mode=mode)
        w, init, state, roll, rew = step_group(cfg)
        replay(w, state, roll, rew, ([0, 2], [1, 3]))
        assert rel_err(flat_grad(w.model), reference_grad(cfg, init, roll, mode)) <= 1e-5, mode


def test_optimizer_op_is_one_adamw_step_and_commits_a_checkpoint(tmp_path):
    cfg = make_cfg(tmp_path, optim={"lr": 1e-3, "grad_clip": 0.05, "weight_decay": 0.1})
    w, init, state, roll, rew = step_group(cfg)
    replay(w, state, roll, rew, ([0, 1, 2, 3],))
    w.prompt(w.weights_version, state, 0, 0, 0)
    model = ls.load_model(init["checkpoint"])
    for p, q in zip(model.parameters(), w.model.parameters()):
        p.grad = q.grad.clone()
    out = w.optimizer(init["weights_version"], update=0, step=0, record={"reward_mean": 0.5})

    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    opt.step()
    assert out["grad_norm"] == pytest.approx(float(norm), rel=1e-6)
    assert out["grad_norm"] > 0.05  # the clip was active
    new = ls.load_model(out["checkpoint"])
    for (n, p), q in zip(model.named_parameters(), new.parameters()):
        assert torch.equal(p, q), n
    meta = read_trainer(out["checkpoint"])
    assert meta["update"] == 1 and meta["record"]["reward_mean"] == 0.5 and meta["record"]["grad_norm"] > 0
    assert meta["weights_version"] == out["weights_version"] == next_version(init["weights_version"], 1)
    # optimizer moments come back with the checkpoint
    _, reloaded, _ = load_checkpoint(out["checkpoint"], lambda m: build_optimizer(m, cfg.optim))
    want = [opt.state[p]["exp_avg_sq"] for p in model.parameters()]
    got = [reloaded.state[p]["exp_avg_sq"] for p in reloaded.param_groups[0]["params"]]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_ops_in_the_wrong_order_or_on_other_weights_are_refused(tmp_path):
    cfg = make_cfg(tmp_path)
    w, init, state, roll, rew = step_group(cfg)
    with pytest.raises(ValueError, match="no replay of step 0 group 0"):
        w.prompt(w.weights_version, state, 0, 0, 0)
    replay(w, state, roll, rew, ([0, 1, 2, 3],))
    with pytest.raises(ValueError, match="prompt backward of .* did not run"):
        w.optimizer(w.weights_version, 0, 0, {})
    with pytest.raises(ValueError, match="the ranks hold weights"):
        w.capture("0" * 64, step=0, group=0, epoch=0)


def test_corrupted_artefacts_are_refused(tmp_path):
    cfg = make_cfg(tmp_path)
    w, init, state, roll, rew = step_group(cfg)
    shard = Path(roll["path"]) / "tokens" / "c" / "0"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    fresh = Worker(cfg)  # a resumed job's worker: it reads the stored rollout, verified
    fresh.start()
    with pytest.raises(ValueError, match="rollout at .* is corrupted"):
        replay(fresh, state, roll, rew, ([0],))
    # the sampling worker kept its answers in memory (the store is there for a resume): it reads nothing
    assert replay(w, state, roll, rew, ([0],))[0]["tokens"] > 0
    weights = tmp_path / "run" / "checkpoints" / "update-000000" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors does not match"):
        Worker(cfg).start()  # verified once per worker start


def test_the_prompt_is_made_once_per_step(tmp_path, monkeypatch):
    """The capture op makes the example; the state stores it, the rollout carries it to the reward, which
    scores with it instead of making the prompt again."""
    cfg = make_cfg(tmp_path)
    made = []
    real = inputs.step_example
    monkeypatch.setattr(inputs, "step_example", lambda *a: made.append(a[2:]) or real(*a))
    w = Worker(cfg)
    v = w.start()["weights_version"]
    cap = w.capture(v, step=0, group=0, epoch=0)
    roll = w.rollout(v, {"url": cap["url"], "sha256": cap["sha256"]}, 0, 0)
    rew = inputs.reward_stage(cfg, roll, 0, 0)
    assert made == [(0, 0)]
    ex = real(cfg, load_tokenizer(cfg.tokenizer), 0, 0)
    texts = json.loads((Path(roll["path"]) / "manifest.json").read_text())["meta"]["texts"]
    fn = get_reward(cfg.task)
    assert load_json(rew["path"], rew["sha256"])["rewards"] == [fn(ex.meta | {"answer": ex.answer}, t) for t in texts]


def test_edited_manifests_are_refused(tmp_path):
    """A manifest's own fields (a state's chunks, a rollout's texts) are covered by the digest a stage hands on:
    an edit is refused by the next stage, as corruption it can recompute."""
    cfg = make_cfg(tmp_path)
    w, init, state, roll, rew = step_group(cfg)
    replay(w, state, roll, rew, ([0],))  # as written: fine
    for path, edit in ((Path(roll["path"]) / "manifest.json", lambda m: m["meta"]["texts"].reverse()),
                       (Path(state["url"]) / "manifest.json", lambda m: m["chunks"].pop())):
        manifest = json.loads(path.read_text())
        edit(manifest)
        path.write_text(json.dumps(manifest))
    with pytest.raises(CorruptArtefact, match="rollout at .* is not the one this stage was given"):
        inputs.reward_stage(cfg, roll, 0, 0)
    fresh = Worker(cfg)  # nothing resident: it reads the state
    fresh.start()
    with pytest.raises(CorruptArtefact, match="sharded prefix state at .* is not the one this stage was given"):
        fresh.rollout(fresh.weights_version, state, 0, 0)


def test_state_from_other_weights_is_refused(tmp_path):
    cfg = make_cfg(tmp_path)
    w, init, state, roll, rew = step_group(cfg)
    replay(w, state, roll, rew, ([0, 1, 2, 3],))
    w.prompt(w.weights_version, state, 0, 0, 0)
    w.optimizer(w.weights_version, 0, 0, {})
    with pytest.raises(ValueError, match="other weights"):  # the state was captured with the update-0 weights
        replay(w, state, roll, rew, ([0],))


def test_second_epoch_replays_against_the_rollout_logprobs(tmp_path):
    """epochs > 1: the ratio's denominator is the sampling log-prob from the rollout, so after one update the
    replay clips, and its gradient equals naive grpo_backward given those old log-probs."""
    cfg = make_cfg(tmp_path, epochs=2, optim={"lr": 0.05, "grad_clip": None},
                   grpo={"clip_low": 0.02, "clip_high": 0.02})
    w, init, state, roll, rew = step_group(cfg)
    r0 = replay(w, state, roll, rew, ([0, 1, 2, 3],))
    assert r0[0]["clipped_tokens"] == 0  # same weights as the sampler: ratios are 1 up to rounding
    w.prompt(w.weights_version, state, 0, 0, 0)
    out = w.optimizer(w.weights_version, update=0, step=0, record={})
    assert out["checkpoint"] is None  # mid-step: no checkpoint
    cap1 = w.capture(w.weights_version, step=0, group=0, epoch=1)
    state1 = {"url": cap1["url"], "sha256": cap1["sha256"]}
    r1 = replay(w, state1, roll, rew, ([0, 1, 2, 3],), epoch=1)
    w.prompt(w.weights_version, state1, 0, 0, 1)
    assert r1[0]["clipped_tokens"] > 0
    got = flat_grad(w.model)

    model = ls.load_model(init["checkpoint"])
    with torch.no_grad():
        for p, q in zip(model.parameters(), w.model.parameters()):
            p.copy_(q)
    tok = load_tokenizer(cfg.tokenizer)
    stored = inputs.read_rollout(cfg, Artefact.from_json(roll))
    responses, old = stored.responses, stored.logprobs
    ls.grpo_backward(model, prompt_ids(tok, step_example(cfg, tok, 0, 0)), responses, ADV, mode="naive",
                     old_logprobs=old, config=cfg.grpo)
    assert rel_err(got, flat_grad(model)) <= 1e-5


def test_ops_are_run_from_the_table_by_name(tmp_path):
    """The driver sends an op by its name in `Worker.OPS` and every rank runs that entry: a name outside the table
    is refused before anything is sent, and the entry (not an attribute looked up by the name) is what runs. The
    `leader` arguments reach rank 0's op alone: they are not in the command sent to the other ranks."""
    from longstraw.train.spmd import Driver, OneProcess

    class Sending(OneProcess):
        def __init__(self) -> None:
            super().__init__()
            self.sent: list = []

        def broadcast(self, value):
            self.sent.append(value)
            return value

    assert Worker.OPS["capture"] is Worker.__dict__["capture"]
    w = Worker(make_cfg(tmp_path), Sending())
    driver = Driver(w)
    with pytest.raises(ValueError, match="unknown op '_load'"):
        driver.call("_load", ref={})
    init = driver.call("start")
    assert init["weights_version"] == w.weights_version and init["read_bytes"] >= 0  # measured, one process
    ran = []
    table = dict(Worker.OPS, capture=lambda self, **kw: ran.append(kw) or {"seen": True})
    w.OPS = table  # this worker's table only
    assert driver.call("capture", weights_version=w.weights_version, step=0, group=0, epoch=0)["seen"]
    assert ran == [{"weights_version": w.weights_version, "step": 0, "group": 0, "epoch": 0}]
    assert driver.call("capture", leader={"record": {"loss": 1.0}}, step=1)["seen"]
    assert ran[-1] == {"step": 1, "record": {"loss": 1.0}}
    assert w.ranks.sent[-1] == {"op": "capture", "params": {"step": 1}}


def test_resident_rollout_and_reference_equal_the_stored_ones(tmp_path):
    """The sampling worker replays from the answers, sampling log-probs (two epochs: they enter the ratio) and KL
    reference log-probs it keeps in memory; a fresh worker (a resumed job) reads them from the store. The same
    gradient, bitwise: what stays in memory is what the store holds."""
    cfg = make_cfg(tmp_path, epochs=2, grpo={"kl_coef": 0.1})
    w, init, state, roll, rew = step_group(cfg)
    out = w.reference(init["reference_version"], state, roll, 0, 0)
    ref = {"path": out["path"], "sha256": out["sha256"]}
    for worker in (w, fresh := Worker(cfg)):
        if worker is fresh:
            fresh.start()
            assert fresh._rollout.value is None and fresh._reference_logps.value is None  # nothing resident: it reads them
        worker.replay(worker.weights_version, state, roll, rew, ref, 0, 0, 0, [[0, 1, 2, 3]])  # rew: advantages
        worker.prompt(worker.weights_version, state, 0, 0, 0)
    assert fresh._reference is None  # the reference model was never needed to replay
    assert flat_grad(w.model).norm() > 0
    assert torch.equal(flat_grad(fresh.model), flat_grad(w.model))
