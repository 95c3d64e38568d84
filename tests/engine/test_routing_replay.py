"""MoE routing replay (engine/routing.py): the gradient is computed on the recorded experts, not a re-routing.

With the routers perturbed so that re-routing picks other experts (asserted), exact mode with the recorded routing
equals naive mode forced to the same routing (fp64 <= 1e-10) in every way the prompt's chunks are recomputed, and
differs from the re-routed gradient; on 2 gloo ranks, sharded and expert-parallel, too. Independently of the
forcing code: after capture and rollout, only the routers' score-correction bias moves (it changes which experts
are chosen, never their weights), so the replayed gradient must be the unperturbed model's plain naive gradient.
What capture and rollout record is what a plain forward's routers choose (read by hooks on the routers).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import longstraw as ls
from longstraw.engine import Branches, new_dstate, prompt_backward, replay
from longstraw.engine.routing import Routing, check_replay, joined, prompt_moe_layers
from longstraw.engine.chunks import held_rows, prompt_chunks
from longstraw.models.common.moe import moe_layers
from longstraw.parallel import SequenceGroup, SequenceParallel, full_tensor, shard_model
from longstraw.segment import Segment
from longstraw.sharded_state import load_state_shard, save_state
from tests.conftest import GLM, flat_grad, rel_err
from tests.parallel.launch import run_ranks

CHUNK = 7
LENGTHS = (6, 1, 4, 3)
ROUTED = ls.SamplingSettings(max_new_tokens=max(LENGTHS), record_routing=True)  # the rollouts' settings
ADV = [1.0, -0.5, 0.7, -1.2]


def glm() -> torch.nn.Module:
    torch.manual_seed(0)
    return ls.build_model(GLM, dtype=torch.float64)


def recorded(model: torch.nn.Module, prompt_len: int = 40) -> tuple[torch.Tensor, list[torch.Tensor], Routing]:
    """A prompt, responses sampled from it, and the routing capture and rollout recorded (the responses cut to
    LENGTHS: a sample's first tokens and their routing rows are a response too)."""
    prompt = torch.randint(0, 97, (prompt_len,), generator=torch.Generator().manual_seed(0))
    state = ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=CHUNK), record_routing=True)
    samples = ls.rollout(model, state, ROUTED, ls.Draw(n=len(LENGTHS), seed=3))
    responses = [s.tokens[:n] for s, n in zip(samples, LENGTHS)]
    branches = [{j: ids[:n] for j, ids in s.routing.items()} for s, n in zip(samples, LENGTHS)]
    return prompt, responses, Routing(state.routing, branches)


def routers_choice(model: torch.nn.Module, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """The experts [T, top_k] each MoE layer's router picks for a plain forward of `ids`, read off the routers."""
    seen, hooks = {}, []
    for j, router in moe_layers(model).items():
        hooks.append(router.register_forward_hook(lambda _m, _i, out, j=j: seen.__setitem__(j, out[1].clone())))
    try:
        with torch.no_grad():
            model(ids[None])
    finally:
        for h in hooks:
            h.remove()
    return seen


def same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, whether two routings name the same experts (in any order)."""
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


def rerouted(model, prompt, responses, routing: Routing) -> tuple[int, int]:
    """How many prompt rows and branch rows the model's routers now send elsewhere than `routing`."""
    p = prompt.numel() - 1
    choices = [routers_choice(model, torch.cat([prompt, r[:-1]])) for r in responses]
    prompt_moved = sum(int((~same_experts(choices[0][j][:p], ids)).sum()) for j, ids in routing.prompt.items())
    branch_moved = sum(int((~same_experts(choice[j][p:], ids)).sum())
                       for choice, branch in zip(choices, routing.branches) for j, ids in branch.items())
    return prompt_moved, branch_moved


def perturb_routers(model: torch.nn.Module, part: str, scale: float) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for router in moe_layers(model).values():
            t = router.weight if part == "weight" else router.e_score_correction_bias
            t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * scale)


def grad_of(model, mode, prompt, responses, **kw) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    ls.grpo_backward(model, prompt, responses, ADV, mode=mode, **kw)
    return flat_grad(model)


ENGINES = {
    "kept graphs": dict(prompt_chunk=CHUNK),
    "recomputed": dict(prompt_chunk=CHUNK, prompt_graph_budget=0, branch_batch=3),
    "checkpointed layers": dict(prompt_chunk=CHUNK, prompt_graph_budget=0, checkpoint_layers=True, branch_batch=4),
    "layer-major": dict(prompt_chunk=CHUNK, prompt_graph_budget=0, prompt_order="layers"),
    "sparse boundaries": dict(prompt_chunk=5, prompt_graph_budget=0, boundary_every=3),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_exact_with_recorded_routing_equals_naive_with_the_same_forced_routing(engine):
    model = glm()
    prompt, responses, routing = recorded(model)
    perturb_routers(model, "weight", 0.5)
    prompt_moved, branch_moved = rerouted(model, prompt, responses, routing)
    assert prompt_moved > 0 and branch_moved > 0  # the perturbed routers would route elsewhere
    want = grad_of(model, "naive", prompt, responses, routing=routing)
    got = grad_of(model, "exact", prompt, responses, routing=routing, engine=ls.EngineConfig(**ENGINES[engine]))
    assert rel_err(got, want) <= 1e-10
    # the control: re-routing gives another gradient, in naive and in exact mode
    free = grad_of(model, "naive", prompt, responses)
    assert rel_err(free, want) > 1e-3
    assert rel_err(grad_of(model, "exact", prompt, responses, engine=ls.EngineConfig(**ENGINES[engine])), free) <= 1e-10


def test_routers_still_get_their_gradient_under_replay():
    """The replayed experts are weighed by the router's own scores: its weight has a gradient, and it is the
    forced naive one."""
    model = glm()
    prompt, responses, routing = recorded(model)
    perturb_routers(model, "weight", 0.5)
    grad_of(model, "exact", prompt, responses, routing=routing, engine=ls.EngineConfig(prompt_chunk=CHUNK))
    got = {j: r.weight.grad.clone() for j, r in moe_layers(model).items()}
    grad_of(model, "naive", prompt, responses, routing=routing)
    for j, r in moe_layers(model).items():
        assert float(got[j].abs().max()) > 0
        assert rel_err(got[j], r.weight.grad) <= 1e-10


@pytest.mark.parametrize("order", ["chunks", "layers"])
def test_routing_kept_with_the_state_beats_a_moved_bias(order):
    """The pipeline's order: capture (recording), rollout (recording), then the routers' choice moves (their
    score-correction bias only, which never enters the experts' weights), then replay and the prompt backward on
    the captured state with the recorded routing: the unperturbed model's own naive gradient."""
    model = glm()
    prompt, responses, routing = recorded(model)
    want = grad_of(model, "naive", prompt, responses)
    engine = ls.EngineConfig(prompt_chunk=CHUNK, prompt_graph_budget=0, prompt_order=order, branch_batch=2)
    state = ls.capture(model, prompt, engine, exact=True, record_routing=True)
    for j, ids in routing.prompt.items():  # the same routing as the recording capture's
        assert torch.equal(state.routing[j], ids)
    perturb_routers(model, "bias", 0.5)
    prompt_moved, branch_moved = rerouted(model, prompt, responses, routing)
    assert prompt_moved > 0 and branch_moved > 0
    model.zero_grad(set_to_none=True)
    loss = ls.GRPOConfig()
    branches = replace(Branches.group(responses, ADV, loss, vocab_size=97), routing=routing.branches)
    dstate = new_dstate(state)
    replay(model, state, branches, loss, dstate, engine=engine)
    prompt_backward(model, state, dstate, engine=engine)
    assert rel_err(flat_grad(model), want) <= 1e-10
    # the control: the moved bias re-routes, and the gradient moves with it
    assert rel_err(grad_of(model, "exact", prompt, responses, engine=engine), want) > 1e-3


@pytest.mark.parametrize("order", ["chunks", "layers"])
def test_capture_and_rollout_record_what_the_routers_choose(order):
    model = glm()
    prompt, responses, routing = recorded(model)
    state = ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=CHUNK, prompt_order=order), record_routing=True)
    samples = ls.rollout(model, state, ROUTED, ls.Draw(n=len(LENGTHS), seed=3))
    p = prompt.numel() - 1
    last = GLM["num_hidden_layers"] - 1  # its MLP never runs on the prompt at capture
    assert set(state.routing) == set(prompt_moe_layers(model)) == set(moe_layers(model)) - {last}
    for s in samples:
        assert set(s.routing) == set(moe_layers(model))
        choice = routers_choice(model, torch.cat([prompt, s.tokens[:-1]]))
        for j, ids in s.routing.items():
            assert ids.dtype == torch.uint8 and ids.shape == (s.tokens.numel(), GLM["num_experts_per_tok"])
            assert torch.equal(ids.long(), choice[j][p:])
        for j, ids in state.routing.items():
            assert torch.equal(ids.long(), choice[j][:p])


def test_routing_is_stored_with_the_state(tmp_path):
    model = glm()
    prompt = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(0))
    state = ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=CHUNK), exact=True, record_routing=True)
    save_state(state, str(tmp_path / "s"), weights_version="w", shard_tokens=8)
    loaded = load_state_shard(str(tmp_path / "s"), model=model, weights_version="w")
    assert set(loaded.routing) == set(state.routing)
    for j, ids in state.routing.items():
        assert loaded.routing[j].dtype == torch.uint8 and torch.equal(loaded.routing[j], ids)
    plain = ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=CHUNK), exact=True)
    save_state(plain, str(tmp_path / "p"), weights_version="w")
    assert plain.routing is None
    assert load_state_shard(str(tmp_path / "p"), model=model, weights_version="w").routing is None


def test_bad_routing_is_refused_clearly():
    model = glm()
    prompt, responses, routing = recorded(model, prompt_len=20)
    p = prompt.numel() - 1
    check_replay(model, routing, p, responses)  # the recorded one passes
    branch = routing.branches[0]
    bad = {
        "model's MoE layers": Routing(branches=[{1: branch[1]}] + routing.branches[1:]),
        "expected expert ids of shape": Routing(prompt={j: ids[:-1] for j, ids in routing.prompt.items()}),
        r"must lie in \[0, 8\)": Routing(branches=[{j: ids.long() + 8 for j, ids in branch.items()}]
                                         + routing.branches[1:]),
        "same expert twice": Routing(branches=[{j: ids[:, :1].expand(-1, 2) for j, ids in branch.items()}]
                                     + routing.branches[1:]),
        "must be integers": Routing(branches=[{j: ids.double() for j, ids in branch.items()}] + routing.branches[1:]),
        "2 branches for 4 responses": Routing(branches=routing.branches[:2]),
    }
    for message, r in bad.items():
        with pytest.raises(ValueError, match=message):
            check_replay(model, r, p, responses)
    # a prompt routing may carry the last layer's (a full forward records it): it is left out
    last = GLM["num_hidden_layers"] - 1
    full = {**routing.prompt, last: routing.prompt[1]}
    assert set(check_replay(model, Routing(prompt=full), p, responses).prompt) == set(routing.prompt)


RANK_ENGINE = dict(prompt_chunk=CHUNK, prompt_graph_budget=0)


def replay_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    """On a sequence-parallel group: the routing capture and rollout record (this rank's prompt rows), and the
    exact gradient with the perturbed routers, the routing replayed (the prompt's given, or recorded at capture),
    also with checkpointed layers, and with the experts split over the ranks under ZeRO-3."""
    sp = SequenceParallel()
    model = glm()
    prompt, responses, routing = recorded(model)  # in one process, alike on every rank
    state = ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=CHUNK), parallel=sp, record_routing=True)
    samples = ls.rollout(model, state, ROUTED, ls.Draw(n=len(LENGTHS), seed=3), parallel=sp)
    out = {f"state.{j}": ids for j, ids in state.routing.items()}
    out |= {f"sample.{i}.{j}": ids for i, s in enumerate(samples) for j, ids in s.routing.items()}
    perturb_routers(model, "weight", 0.5)
    cases = {"given": (routing, RANK_ENGINE), "checkpointed": (routing, {**RANK_ENGINE, "checkpoint_layers": True}),
             "recorded prompt": (Routing(branches=routing.branches), RANK_ENGINE)}
    for name, (r, engine) in cases.items():
        model.zero_grad(set_to_none=True)
        ls.grpo_backward(model, prompt, responses, ADV, mode="exact", routing=r, engine=ls.EngineConfig(**engine),
                         parallel=sp)
        out[f"grad.{name}"] = flat_grad(model)
    # 3 branches on 2 ranks: a filler pads rank 1's share, routed by the model
    model.zero_grad(set_to_none=True)
    ls.grpo_backward(model, prompt, responses[:3], ADV[:3], mode="exact", routing=Routing(routing.prompt,
                     routing.branches[:3]), engine=ls.EngineConfig(**RANK_ENGINE), parallel=sp)
    out["grad.with a filler"] = flat_grad(model)
    model.zero_grad(set_to_none=True)
    ep = shard_model(model, 3, sp, expert_parallel=True)
    ls.grpo_backward(ep, prompt, responses, ADV, mode="exact", routing=routing, engine=ls.EngineConfig(**RANK_ENGINE),
                     parallel=sp)
    out["grad.expert parallel"] = torch.cat([(full_tensor(p.grad) if p.grad is not None else torch.zeros(p.shape))
                                             .flatten() for p in ep.parameters()])
    return out


def test_routing_replay_on_two_ranks_equals_one_process():
    model = glm()
    prompt, responses, routing = recorded(model)
    perturb_routers(model, "weight", 0.5)
    want = {"given": grad_of(model, "naive", prompt, responses, routing=routing),
            "recorded prompt": grad_of(model, "naive", prompt, responses, routing=Routing(branches=routing.branches))}
    assert rel_err(want["given"], want["recorded prompt"]) > 1e-3  # the prompt's routing counts
    model.zero_grad(set_to_none=True)
    ls.grpo_backward(model, prompt, responses[:3], ADV[:3], mode="naive",
                     routing=Routing(routing.prompt, routing.branches[:3]))
    want["with a filler"] = flat_grad(model)
    ranks = run_ranks(2, replay_rank, timeout=300)
    for rank, r in enumerate(ranks):
        g = SequenceGroup()
        g.rank, g.size = rank, 2
        positions = held_rows(prompt_chunks(prompt.numel() - 1, CHUNK, g), g).positions()
        for j, ids in routing.prompt.items():
            assert torch.equal(r[f"state.{j}"], ids.index_select(0, positions))
        for i, branch in enumerate(routing.branches):
            for j, ids in branch.items():
                assert torch.equal(r[f"sample.{i}.{j}"][: ids.shape[0]], ids)
        for name in ("given", "checkpointed", "expert parallel"):
            assert rel_err(r[f"grad.{name}"], want["given"]) <= 1e-10, name
        for name in ("recorded prompt", "with a filler"):
            assert rel_err(r[f"grad.{name}"], want[name]) <= 1e-10, name


@pytest.mark.parametrize("how", ["compiled", "static"])
def test_compiled_and_static_decodes_record_the_eager_routing(how):
    """The MoE layers write their routing into the segment inside the compiled step (a side effect torch.compile
    replays) and, for the static decode, out of buffers the next step overwrites: copied out each step."""
    torch.manual_seed(0)
    model = ls.build_model(GLM, dtype=torch.float32)
    state = ls.capture(model, torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(2)), ls.EngineConfig(prompt_chunk=16))
    args = (ls.SamplingSettings(max_new_tokens=8, record_routing=True), ls.Draw(n=3, seed=5))
    eager = ls.rollout(model, state, *args)
    other = ls.rollout(model, state, *args, decode=ls.DecodeOptions(compile="eager") if how == "compiled"
                       else ls.DecodeOptions(static_shapes=True))
    for a, b in zip(eager, other, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        assert a.routing.keys() == b.routing.keys() and all(torch.equal(a.routing[j], b.routing[j]) for j in a.routing)


def test_entropy_options_and_score_take_the_replayed_routing():
    """The entropy options' group pre-pass and `score` route as the loss does: with perturbed routers, exact with
    the top-entropy mask and bonus equals naive forced alike, and score's log-probs follow the routing given."""
    model = glm()
    prompt, responses, routing = recorded(model)
    perturb_routers(model, "weight", 3.0)
    assert rerouted(model, prompt, responses, routing)[1] > 0
    cfg = ls.GRPOConfig(top_entropy_quantile=0.5, entropy_coef=0.1, loss_type="dapo")
    g_naive = grad_of(model, "naive", prompt, responses, routing=routing, config=cfg)
    g_exact = grad_of(model, "exact", prompt, responses, routing=routing, config=cfg,
                      engine=ls.EngineConfig(prompt_chunk=CHUNK, branch_batch=2))
    assert rel_err(g_exact, g_naive) <= 1e-10
    state = ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=CHUNK), routing=routing.prompt)
    batched = ls.EngineConfig(branch_batch=2)
    forced = ls.score(model, state, responses, engine=batched, routing=routing.branches)
    free = ls.score(model, state, responses, engine=batched)
    checked = check_replay(model, routing, prompt.numel() - 1, responses)
    for i, r in enumerate(responses):  # a full forward of prompt + response, forced to the same routing
        seg = Segment(routing=joined(checked.prompt, checked.branches[i], prompt.numel() - 1, r.numel(), "cpu"))
        with torch.no_grad():
            want = model.token_logprobs(torch.cat([prompt, r[:-1]])[None], r[None], seg,
                                        logits_from=prompt.numel() - 1)[0]
        assert torch.allclose(forced[i], want, rtol=0, atol=1e-10)
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(forced, free))


def test_multi_turn_branches_replay_their_recorded_routing():
    """An agent's branches on a MoE model: multi-turn rollout (observation tokens fed between the model's turns)
    records the routing of every token, the observations' too; after the routers' bias moves, the exact gradient
    of the masked branches with that routing is the unperturbed model's plain naive gradient."""
    from longstraw.agents import rollout_turns
    from tests.agents.test_turns import SCRIPTS, STOPS, ScriptedEnv

    model = glm()
    prompt = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(1))
    engine = ls.EngineConfig(prompt_chunk=CHUNK, prompt_graph_budget=0, branch_batch=2)
    state = ls.capture(model, prompt, engine, exact=True, record_routing=True)
    settings = ls.SamplingSettings(max_new_tokens=24, temperature=1.0, stop_ids=STOPS, record_routing=True)
    samples = rollout_turns(model, state, settings, ls.Draw(n=len(SCRIPTS), seed=1),
                            [ScriptedEnv(s) for s in SCRIPTS], max_turns=3)
    assert all(not s.mask.all() for s in samples)  # every branch holds observation tokens
    responses, masks = [s.tokens for s in samples], [s.mask for s in samples]
    routing = Routing(state.routing, [s.routing for s in samples])
    adv = ADV[: len(samples)]

    def grad(mode: str, **kw) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        ls.grpo_backward(model, prompt, responses, adv, mode=mode, masks=masks, engine=engine, **kw)
        return flat_grad(model)

    want = grad("naive")
    perturb_routers(model, "bias", 0.5)
    prompt_moved, branch_moved = rerouted(model, prompt, responses, routing)
    assert prompt_moved > 0 and branch_moved > 0
    p = prompt.numel() - 1
    observed_moved = sum(int((~same_experts(routers_choice(model, torch.cat([prompt, r[:-1]]))[j][p:][~m],
                                            ids[~m])).sum())
                         for r, m, branch in zip(responses, masks, routing.branches) for j, ids in branch.items())
    assert observed_moved > 0  # the observation tokens' rows too
    assert rel_err(grad("exact", routing=routing), want) <= 1e-10
    assert rel_err(grad("exact"), want) > 1e-3  # the control: re-routed, the gradient moves
