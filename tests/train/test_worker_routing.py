"""MoE routing replay in the pipeline (`moe_routing_replay`), run op by op on one process (no Prefect): the capture
keeps the prompt's routing with the state and the rollout stores each answer's with it; after the routers'
choice moves (their score-correction bias, which never weighs an expert), the replay and prompt ops still compute
the unperturbed model's gradient, which is also `grpo_backward` given the recorded routing, and not the re-routed
one; a fresh worker reading the store computes it bitwise; a later epoch's capture takes epoch 0's routing from
its stored state. A rollout or a state stored without routing, and a model without experts, fail naming the fix.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import longstraw as ls
from longstraw.data.tokenizer import load_tokenizer
from longstraw.engine.routing import Routing
from longstraw.files import Artefact
from longstraw.rollout import Sample
from longstraw.sharded_state import load_state_routing
from longstraw.store import manifest_digest, save_rollout
from longstraw.train import inputs
from longstraw.train.config import TrainConfig
from longstraw.train.data import prompt_ids, step_example
from longstraw.train.answers import gather_samples, sampled_answers
from longstraw.train.spmd import Ranks
from longstraw.train.worker import Worker
from tests.conftest import GLM, flat_grad, rel_err
from tests.engine.test_routing_replay import perturb_routers, rerouted
from tests.parallel.launch import run_ranks
from tests.train.test_train_inputs import make_cfg
from tests.train.test_worker import ADV, replay, step_group


def glm_cfg(tmp_path, **kw) -> TrainConfig:
    """A tiny GLM-5-shaped run in fp64 (MLA, DSA, MoE layers 1..3), 3 prompt chunks, routing replay on."""
    base = dict(model={"random": {**GLM, "vocab_size": 260}}, dtype="float64", prompt_tokens=200, groups=1,
                responses=4, max_new_tokens=5, engine={"prompt_chunk": 80}, run_dir=str(tmp_path / "run"),
                optim={"lr": 1e-3}, moe_routing_replay=True)
    return TrainConfig.model_validate(base | kw)


def prompt_of(cfg: TrainConfig) -> torch.Tensor:
    tok = load_tokenizer(cfg.tokenizer)
    return torch.tensor(prompt_ids(tok, step_example(cfg, tok, 0, 0)))


def grad(model, prompt, responses, mode="naive", **kw) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    ls.grpo_backward(model, prompt, responses, ADV, mode=mode, **kw)
    return flat_grad(model)


@pytest.mark.parametrize("mode", ["exact", "naive"])
def test_replay_and_prompt_ops_route_as_the_rollout_did(tmp_path, mode):
    cfg = glm_cfg(tmp_path, mode=mode)
    w, init, state, roll, rew = step_group(cfg)
    stored = inputs.read_rollout(cfg, Artefact.from_json(roll))
    resident = w._rollout.value
    for kept, read, tokens in zip(resident.routing, stored.routing, stored.responses, strict=True):
        assert sorted(read) == [1, 2, 3] and all(ids.shape == (tokens.numel(), 2) for ids in read.values())
        assert all(kept[j].dtype == read[j].dtype == torch.uint8 and torch.equal(kept[j], read[j]) for j in read)
    prompt = prompt_of(cfg)
    recorded = Routing(load_state_routing(state["url"], digest=state["sha256"]), stored.routing)
    assert all(torch.equal(w._load(state).routing[j], ids) for j, ids in recorded.prompt.items())  # one process

    model = ls.load_model(init["checkpoint"], dtype=torch.float64)
    want = grad(model, prompt, stored.responses)  # the unperturbed model, routed by itself: as it sampled
    perturb_routers(model, "bias", 0.5)
    prompt_moved, branch_moved = rerouted(model, prompt, stored.responses, recorded)
    assert prompt_moved > 0 and branch_moved > 0  # the moved routers would route elsewhere
    forced = grad(model, prompt, stored.responses, routing=recorded)
    free = grad(model, prompt, stored.responses)
    assert rel_err(forced, want) <= 1e-10
    assert rel_err(free, want) > 1e-3  # the control: re-routing changes the gradient

    perturb_routers(w.model, "bias", 0.5)  # between rollout and replay
    replay(w, state, roll, rew, ([0, 1], [2, 3]))
    if mode == "exact":
        w.prompt(w.weights_version, state, 0, 0, 0)
    got = flat_grad(w.model)
    assert rel_err(got, want) <= 1e-10
    if mode == "exact":  # a resumed job: the routing of the answers and of the prompt come from the store
        fresh = Worker(cfg)
        fresh.start()
        perturb_routers(fresh.model, "bias", 0.5)
        replay(fresh, state, roll, rew, ([0, 1, 2, 3],))
        fresh.prompt(fresh.weights_version, state, 0, 0, 0)
        assert fresh._rollout.value.routing is not None
        assert torch.equal(flat_grad(fresh.model), got)


def test_a_later_epoch_captures_the_prompt_with_epoch_0s_routing(tmp_path):
    """epochs 2: after the update (and a moved bias), epoch 1's capture routes the prompt as epoch 0's state
    says, not as the routers now would; its gradient is grpo_backward's given the recorded routing."""
    cfg = glm_cfg(tmp_path, epochs=2, optim={"lr": 0.05, "grad_clip": None})
    w, init, state0, roll, rew = step_group(cfg)
    replay(w, state0, roll, rew, ([0, 1, 2, 3],))
    w.prompt(w.weights_version, state0, 0, 0, 0)
    w.optimizer(w.weights_version, update=0, step=0, record={})
    perturb_routers(w.model, "bias", 0.5)
    with pytest.raises(ValueError, match="epoch 1's capture under moe_routing_replay .* pass routing_from"):
        w.capture(w.weights_version, step=0, group=0, epoch=1)
    with pytest.raises(ValueError, match="routing_from is for later epochs"):
        w.capture(w.weights_version, step=0, group=0, epoch=0, routing_from=state0)
    cap1 = w.capture(w.weights_version, step=0, group=0, epoch=1, routing_from=state0)
    state1 = {"url": cap1["url"], "sha256": cap1["sha256"]}
    prompt0 = load_state_routing(state0["url"], digest=state0["sha256"])
    assert all(torch.equal(w._load(state1).routing[j], ids) for j, ids in prompt0.items())
    assert all(torch.equal(ids, prompt0[j]) for j, ids in load_state_routing(state1["url"]).items())  # stored
    prompt = prompt_of(cfg)
    free = ls.capture(w.model, prompt, cfg.engine, record_routing=True).routing
    assert any(not torch.equal(free[j], ids) for j, ids in prompt0.items())  # the routers now choose otherwise

    replay(w, state1, roll, rew, ([0, 1, 2, 3],), epoch=1)
    w.prompt(w.weights_version, state1, 0, 0, 1)
    model = ls.load_model(init["checkpoint"], dtype=torch.float64)
    model.load_state_dict(w.model.state_dict())  # the updated weights and the moved bias
    stored = inputs.read_rollout(cfg, Artefact.from_json(roll))
    want = grad(model, prompt, stored.responses, routing=Routing(prompt0, stored.routing),
                old_logprobs=stored.logprobs, config=cfg.grpo)
    assert rel_err(flat_grad(w.model), want) <= 1e-10
    # the control: epoch 0's routing of the prompt matters (the answers' alone differ)
    assert rel_err(grad(model, prompt, stored.responses, routing=Routing(branches=stored.routing),
                        old_logprobs=stored.logprobs, config=cfg.grpo), want) > 1e-3


def test_a_rollout_or_state_stored_without_routing_fails_naming_the_fix(tmp_path):
    cfg = glm_cfg(tmp_path)
    _, _, state, roll, rew = step_group(cfg)
    old = inputs.read_rollout(cfg, Artefact.from_json(roll))
    # the same rollout as a run without routing replay (or an older longstraw) stored it
    bare = {"path": roll["path"], "sha256": manifest_digest(save_rollout(
        roll["path"], old.responses, old.logprobs, old.meta, sampler_logprobs=old.sampler_logprobs))}
    fresh = Worker(cfg)
    fresh.start()
    with pytest.raises(ValueError, match=r"rollout at .* was stored without its MoE routing, which "
                                         r"moe_routing_replay replays: delete it .* or set moe_routing_replay: false"):
        replay(fresh, state, bare, rew, ([0, 1, 2, 3],))

    off = Worker(glm_cfg(tmp_path, moe_routing_replay=False))  # the same run directory
    off.start()
    cap = off.capture(off.weights_version, step=0, group=0, epoch=0)
    plain = {"url": cap["url"], "sha256": cap["sha256"]}
    assert off._load(plain).routing is None
    assert replay(off, plain, bare, rew, ([0, 1, 2, 3],))[0]["tokens"] > 0  # without the option: replays
    routed = {"path": roll["path"], "sha256": manifest_digest(save_rollout(  # with its routing again
        roll["path"], old.responses, old.logprobs, old.meta, sampler_logprobs=old.sampler_logprobs,
        routing=old.routing))}
    fresh = Worker(cfg)
    fresh.start()
    with pytest.raises(ValueError, match=r"prefix state at .* was captured without its MoE routing.*delete it"):
        replay(fresh, plain, routed, rew, ([0, 1, 2, 3],))
    with pytest.raises(ValueError, match=r"prefix state at .* was captured without its MoE routing.*later epochs"):
        fresh.capture(fresh.weights_version, step=0, group=0, epoch=1, routing_from=plain)
    with pytest.raises(ValueError, match="moe_routing_replay is off; leave routing_from unset"):
        off.capture(off.weights_version, step=0, group=0, epoch=1, routing_from=plain)


def test_a_model_without_experts_is_refused_at_preflight(tmp_path):
    with pytest.raises(ValueError, match="this qwen3 model has no MoE layer; set moe_routing_replay: false"):
        inputs.preflight(make_cfg(tmp_path, moe_routing_replay=True))
    inputs.preflight(glm_cfg(tmp_path))  # a MoE model passes


def gather_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Two data-parallel groups of one rank each: each sampled one answer (its routing made up here, distinct
    per rank); `gather_samples` and `sampled_answers` hand every rank both, in branch order, rank 0's values."""
    ranks = Ranks(SimpleNamespace(dp_rank=rank, rank=0), None, rank, world)
    g = torch.Generator().manual_seed(rank)
    n = 2 + rank
    sample = Sample(torch.arange(n) + 10 * rank, torch.randn(n, generator=g), torch.randn(n, generator=g), "length",
                    {j: (torch.arange(n * 2).reshape(n, 2) + 100 * rank + j).to(torch.uint8) for j in (1, 3)})
    gathered = gather_samples(ranks, [sample])
    _, answers = sampled_answers(ranks, Artefact("x", "0" * 64) if rank == 0 else None, gathered, with_routing=True)
    return {f"{how}.{i}.{j}": ids for how, routings in (("gathered", [s.routing for s in gathered]),
                                                       ("kept", answers.routing))
            for i, r in enumerate(routings) for j, ids in r.items()}


def test_routing_is_gathered_over_data_parallel_groups_and_kept():
    ranks = run_ranks(2, gather_rank, timeout=120)
    for got in ranks:
        assert len(got) == 8
        for i in range(2):  # branch i is rank i's sample
            n = 2 + i
            for j in (1, 3):
                want = (torch.arange(n * 2).reshape(n, 2) + 100 * i + j).to(torch.uint8)
                for how in ("gathered", "kept"):
                    ids = got[f"{how}.{i}.{j}"]
                    assert ids.dtype == torch.uint8 and torch.equal(ids, want), (how, i, j)
