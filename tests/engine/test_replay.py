"""score() on a captured state equals log-softmax of a full forward at the response positions."""

import pytest
import torch

import longstraw as ls
from tests.conftest import state_tensors, tiny_model


def full_pass_logprobs(model, prompt, response):
    ids = torch.cat([prompt, response])[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].float(), -1)
    return logp[prompt.numel() - 1 : -1].gather(-1, response[:, None])[:, 0]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("prompt_len,chunk", [(2, 4), (23, 5), (40, 7), (33, 64), (150, 37)])
@pytest.mark.parametrize("branch_batch", [1, 3])
def test_score_equals_full_pass(model_type, prompt_len, chunk, branch_batch):
    model = tiny_model(model_type)
    prompt = torch.randint(0, 97, (prompt_len,))
    responses = [torch.randint(0, 97, (n,)) for n in (6, 1, 11, 3)]
    state = ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=chunk))
    assert state.length == prompt_len - 1
    assert len(state.chunks) == -(-(prompt_len - 1) // chunk)
    scores = ls.score(model, state, responses, engine=ls.EngineConfig(branch_batch=branch_batch))
    for r, s in zip(responses, scores):
        assert s.shape == r.shape
        torch.testing.assert_close(s, full_pass_logprobs(model, prompt, r), atol=1e-5, rtol=0)


def test_single_token_prompt_has_empty_state():
    model = tiny_model()
    prompt = torch.tensor([5])
    state = ls.capture(model, prompt)
    assert state.length == 0 and state.nbytes == 0
    r = torch.randint(0, 97, (4,))
    torch.testing.assert_close(ls.score(model, state, [r])[0], full_pass_logprobs(model, prompt, r), atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_replays_leave_state_bitwise_unchanged(model_type):
    model = tiny_model(model_type)
    state = ls.capture(model, torch.randint(0, 97, (30,)), ls.EngineConfig(prompt_chunk=8))
    before = state_tensors(state)
    responses = [torch.randint(0, 97, (n,)) for n in (5, 9)]
    ls.score(model, state, responses, engine=ls.EngineConfig(branch_batch=2))
    model.zero_grad()
    ls.grpo_backward(model, state.prompt_ids, responses, [1.0, -1.0], mode="detached")
    ls.score(model, state, responses)
    assert all(not t.requires_grad for layer in state.layers for t in layer.tensors())
    for a, b in zip(before, state_tensors(state)):
        assert torch.equal(a, b)


def test_state_size_is_kv_only():
    model = tiny_model()
    state = ls.capture(model, torch.randint(0, 97, (50,)))
    cfg = model.config
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * cfg.num_hidden_layers
    assert state.nbytes == 49 * per_token
    assert all(layer.k.shape == (cfg.num_key_value_heads, 49, cfg.head_dim) for layer in state.layers)


def test_state_from_other_model_is_refused():
    state = ls.capture(tiny_model(num_hidden_layers=2), torch.randint(0, 97, (10,)))
    with pytest.raises(ValueError, match="different model"):
        ls.score(tiny_model(), state, [torch.tensor([1, 2])])


@pytest.mark.parametrize("off_policy", [False, True])
def test_filler_branches_add_nothing(off_policy):
    """`Branches.padded` (how a group's ranks get equal shares of G branches): the fillers change neither the
    gradient (dState and parameters) nor any loss statistic, with the KL term and off-policy ratios on."""
    from longstraw.engine import capture, new_dstate, replay
    from longstraw.engine.branches import Branches

    model = tiny_model("qwen3_5_text", dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 97, (30,), generator=g)
    responses = [torch.randint(0, 97, (n,), generator=g) for n in (5, 2, 7)]
    logps = [-torch.rand(r.numel(), generator=g, dtype=torch.float64) for r in responses]
    loss = ls.GRPOConfig(kl_coef=0.1)
    branches = Branches.group(responses, [0.9, -0.4, -0.5], loss, vocab_size=97, ref_logprobs=logps,
                              old_logprobs=[lp - 0.3 for lp in logps] if off_policy else None)
    out = []
    for b in (branches, branches.padded(8)):
        model.zero_grad(set_to_none=True)
        state = capture(model, prompt, ls.EngineConfig(prompt_chunk=8), exact=True)
        dstate = new_dstate(state)
        stats = replay(model, state, b, loss, dstate, engine=ls.EngineConfig(branch_batch=2))
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        out.append((stats, grads, torch.cat([t.flatten() for s in dstate.values() for t in s.tensors()])))
    (s1, g1, d1), (s2, g2, d2) = out
    assert len(branches.padded(8)) == 8 and s1["loss"] != 0 and s1["kl_sum"] > 0
    assert s1 == pytest.approx(s2, abs=1e-12)
    # (equal up to rounding: a filler in a batch changes its padded length)
    assert torch.allclose(g1, g2, rtol=1e-12, atol=1e-14) and torch.allclose(d1, d2, rtol=1e-12, atol=1e-14)
