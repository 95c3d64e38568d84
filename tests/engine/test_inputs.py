"""Bad input gets a ValueError that names the problem, before any compute."""

import pytest
import torch

import longstraw as ls
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_position_embeddings=64)


def call(model, prompt=None, responses=None, advantages=None, **kw):
    prompt = torch.randint(0, 97, (20,)) if prompt is None else prompt
    responses = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])] if responses is None else responses
    advantages = [1.0, -1.0] if advantages is None else advantages
    return ls.grpo_backward(model, prompt, responses, advantages, **kw)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(responses=[torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)]), "response 1 is empty"),
        (dict(responses=[]), "responses is empty"),
        (dict(responses=[torch.tensor([1, 97]), torch.tensor([1])]), "token id 97 outside the model vocab"),
        (dict(prompt=torch.tensor([3, -1, 4])), "token id -1"),
        (dict(prompt=torch.tensor([], dtype=torch.long)), "prompt is empty"),
        (dict(prompt=torch.randint(0, 97, (60,)), responses=[torch.ones(5, dtype=torch.long)] * 2),
         "exceeds the model.s 64 positions; extend them with RoPE scaling"),
        (dict(advantages=[1.0, 0.0, -1.0]), "advantages has 3 values for 2 responses"),
        (dict(advantages=[[1.0, -1.0], [0.5, 0.5]]), r"advantages must be 1-D, one per response, got shape \(2, 2\)"),
        (dict(advantages=[float("nan"), 1.0]), "advantages hold non-finite values"),
        (dict(advantages=[float("inf"), 1.0]), "advantages hold non-finite values"),
        (dict(old_logprobs=[torch.zeros(3), torch.tensor([0.0, float("nan")])]),
         r"old_logprobs\[1\] holds non-finite values"),
        (dict(old_logprobs=[torch.zeros(3)]), "old_logprobs has 1 entries"),
        (dict(old_logprobs=[torch.zeros(3), torch.zeros(3)]), r"old_logprobs\[1\] has 3 values"),
        (dict(config=ls.GRPOConfig(kl_coef=0.1)), "needs ref_logprobs"),
        (dict(mode="fast"), "mode 'fast' unknown"),
        (dict(prompt=torch.rand(5)), "integer token ids"),
    ],
)
def test_bad_input(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        call(model, **kwargs)
    assert all(p.grad is None for p in model.parameters())


def test_config_validation():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="loss_agg' is now loss_type"):
        ls.GRPOConfig(loss_agg="token_mean")
    with pytest.raises(ValidationError):
        ls.GRPOConfig(loss_type="sum")
    with pytest.raises(ValidationError):
        ls.GRPOConfig(clip_low=1.5)
    with pytest.raises(ValidationError):
        ls.EngineConfig(prompt_chunk=0)
    with pytest.raises(ValidationError):
        ls.EngineConfig(boundary_every=True)
    with pytest.raises(ValidationError):
        ls.GRPOConfig(unknown_knob=1)


def test_score_checks_responses(model):
    state = ls.capture(model, torch.randint(0, 97, (10,)))
    with pytest.raises(ValueError, match="outside the model vocab"):
        ls.score(model, state, [torch.tensor([200])])
    with pytest.raises(ValueError, match="70 tokens exceeds the model.s 64 positions"):
        ls.score(model, state, [torch.ones(60, dtype=torch.long)])


def test_an_int_engine_is_refused(model):
    """The int shorthand for the prompt chunk is gone: every entry point names EngineConfig and the fix."""
    prompt = torch.randint(0, 97, (10,))
    with pytest.raises(TypeError, match=r"capture's engine must be an EngineConfig, got int 8: pass "
                                        r"EngineConfig\(prompt_chunk=8\)"):
        ls.capture(model, prompt, 8)
    state = ls.capture(model, prompt)
    with pytest.raises(TypeError, match="score's engine must be an EngineConfig"):
        ls.score(model, state, [torch.tensor([1, 2])], engine=8)
    with pytest.raises(TypeError, match="grpo_backward's engine must be an EngineConfig"):
        call(model, engine=8)
    assert all(p.grad is None for p in model.parameters())
