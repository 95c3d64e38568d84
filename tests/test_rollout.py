"""rollout(): batched sampling of n branches from one shared prefix state."""

import math

import pytest
import torch

import longstraw as ls
from longstraw.rollout import _filter_logits
from tests.conftest import GLM, tiny_model



def model_for(arch: str):
    if arch == "glm_moe_dsa":  # index_topk 20 < prompt: decoding runs the sparse path
        torch.manual_seed(0)
        return ls.build_model(GLM)
    return tiny_model(arch)


def sharpen(model):
    """Random tiny models are near-uniform; a larger LM head makes the distribution peaked, so greedy and
    top-k/top-p runs are not dominated by near-ties."""
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


ARCHS = ["qwen3", "qwen3_5_text", "glm_moe_dsa"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 20, 0.9)])
def test_batched_equals_independent_branches(arch, temperature, top_k, top_p):
    model = sharpen(model_for(arch))
    state = ls.capture(model, torch.randint(0, 97, (40,)), ls.EngineConfig(prompt_chunk=16))
    settings = ls.SamplingSettings(max_new_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=[3])
    batch = ls.rollout(model, state, settings, ls.Draw(n=4, seed=11))
    singles = [ls.rollout(model, state, settings, ls.Draw(n=1, seed=11 + i))[0] for i in range(4)]
    for a, b in zip(batch, singles):
        assert torch.equal(a.tokens, b.tokens)
        assert a.finish_reason == b.finish_reason
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.sampler_logprobs, b.sampler_logprobs, atol=1e-5, rtol=0)
    if temperature > 0:
        assert len({tuple(s.tokens.tolist()) for s in batch}) > 1  # branches really differ


@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_logprobs_equal_score(arch):
    model = model_for(arch)
    state = ls.capture(model, torch.randint(0, 97, (40,)), ls.EngineConfig(prompt_chunk=16))
    samples = ls.rollout(model, state, ls.SamplingSettings(max_new_tokens=12, temperature=1.0), ls.Draw(n=3, seed=3))
    scored = ls.score(model, state, [s.tokens for s in samples])
    for s, ref in zip(samples, scored):
        assert s.tokens.shape == s.logprobs.shape
        torch.testing.assert_close(s.logprobs, ref, atol=1e-5, rtol=0)


def test_greedy_is_argmax_of_full_forward():
    model = sharpen(tiny_model())
    prompt = torch.randint(0, 97, (30,))
    sample = ls.rollout(model, ls.capture(model, prompt), ls.SamplingSettings(max_new_tokens=6, temperature=0),
                        ls.Draw(n=2))[0]
    ids = prompt.clone()
    for _ in range(6):
        with torch.no_grad():
            ids = torch.cat([ids, model(ids[None])[0, -1].argmax()[None]])
    assert torch.equal(sample.tokens, ids[30:])


def test_same_seed_same_samples_and_stop_handling():
    model = tiny_model()
    state = ls.capture(model, torch.randint(0, 97, (20,)))
    settings = ls.SamplingSettings(max_new_tokens=30, stop_ids=[1, 2, 3])
    a = ls.rollout(model, state, settings, ls.Draw(n=3, seed=5))
    b = ls.rollout(model, state, settings, ls.Draw(n=3, seed=5))
    assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b))
    for s in a:
        stops = [i for i, t in enumerate(s.tokens.tolist()) if t in (1, 2, 3)]
        if s.finish_reason == "stop":
            assert stops == [len(s.tokens) - 1]
        else:
            assert stops == [] and len(s.tokens) == 30


def test_prefix_is_shared_not_copied(monkeypatch):
    """Every decoding step reads the per-token state objects of the capture itself (no per-branch copies)."""
    model = tiny_model("qwen3_5_text")
    state = ls.capture(model, torch.randint(0, 97, (25,)))
    seen = []
    forward = type(model).forward

    def spy(self, input_ids, seg=None, logits_from=0):
        seen.append(seg)
        return forward(self, input_ids, seg, logits_from)

    monkeypatch.setattr(type(model), "forward", spy)
    ls.rollout(model, state, ls.SamplingSettings(max_new_tokens=4), ls.Draw(n=5, seed=0))
    per_token = [i for i, s in enumerate(state.layers) if isinstance(s, ls.AttentionState)]
    assert per_token and len(seen) == 4
    for seg in seen:
        assert all(seg.prefix[i] is state.layers[i] for i in per_token)
        assert all(seg.cache[i].k.shape[0] == 5 for i in per_token)  # only the branches' own tokens are per-branch


def test_top_k_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda f: torch.isfinite(f)[0].tolist()  # noqa: E731
    assert keep(_filter_logits(logits, 1.0, 2, 1.0)) == [True, True, False, False]
    assert keep(_filter_logits(logits, 1.0, 0, 0.7)) == [True, True, False, False]
    assert keep(_filter_logits(logits, 1.0, 0, 0.5)) == [True, False, False, False]
    assert keep(_filter_logits(logits, 1.0, 0, 0.96)) == [True, True, True, True]


def test_bad_arguments():
    model = tiny_model(max_position_embeddings=64)
    state = ls.capture(model, torch.randint(0, 97, (50,)))
    with pytest.raises(ValueError, match="exceeds the model.s 64 positions; extend them with RoPE scaling"):
        ls.rollout(model, state, ls.SamplingSettings(max_new_tokens=20), ls.Draw(n=2))
    with pytest.raises(ValueError, match="n >= 1"):
        ls.rollout(model, state, ls.SamplingSettings(max_new_tokens=2), ls.Draw(n=0))
    with pytest.raises(ValueError, match="top_p"):
        ls.rollout(model, state, ls.SamplingSettings(max_new_tokens=2, top_p=0.0), ls.Draw(n=1))
    with pytest.raises(ValueError, match="stop_ids"):
        ls.rollout(model, state, ls.SamplingSettings(max_new_tokens=2, stop_ids=[500]), ls.Draw(n=1))
    with pytest.raises(ValueError, match="different model"):
        ls.rollout(tiny_model(num_hidden_layers=2), state, ls.SamplingSettings(max_new_tokens=2), ls.Draw(n=1))


def test_sampling_without_host_sync_draws_from_the_distribution():
    """The exponential race picks token j with probability p_j (20,000 draws, within 0.015 of each p_j), the
    same generator state gives the same draw, and tokens of probability 0 are never drawn."""
    from longstraw.rollout import sample_no_sync

    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).repeat(20_000, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(20_000)]
    draws = sample_no_sync(probs, gens)
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    assert torch.allclose(freq, probs[0].double(), atol=0.015) and freq[3] == 0
    again = sample_no_sync(probs[:5], [torch.Generator().manual_seed(i) for i in range(5)])
    assert torch.equal(again, draws[:5])


def test_stop_checks_every_k_tokens_give_the_same_samples():
    """Asking whether all branches stopped only every k tokens decodes a little longer, never differently."""
    model = sharpen(model_for("qwen3"))
    state = ls.capture(model, torch.randint(0, 97, (40,)), ls.EngineConfig(prompt_chunk=16))
    args = (ls.SamplingSettings(max_new_tokens=12, temperature=1.0, stop_ids=[3, 5, 7]), ls.Draw(n=4, seed=5))
    every = ls.rollout(model, state, *args, decode=ls.DecodeOptions(stop_check_every=1))
    sparse = ls.rollout(model, state, *args, decode=ls.DecodeOptions(stop_check_every=8))
    assert any(s.finish_reason == "stop" for s in every)
    for a, b in zip(every, sparse):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
        assert torch.equal(a.sampler_logprobs, b.sampler_logprobs) and a.finish_reason == b.finish_reason
    with pytest.raises(ValueError, match="stop_check_every"):
        ls.rollout(model, state, *args, decode=ls.DecodeOptions(stop_check_every=0))


def test_branch_slices_draw_what_one_call_draws():
    """Data-parallel groups each sample a slice of a GRPO group (`first_branch`): together, the same answers."""
    model = model_for("qwen3_5_text")
    state = ls.capture(model, torch.randint(0, 97, (40,)), ls.EngineConfig(prompt_chunk=16))
    settings = ls.SamplingSettings(max_new_tokens=10, temperature=1.0, stop_ids=[3])
    whole = ls.rollout(model, state, settings, ls.Draw(n=4, seed=7))
    slices = (ls.rollout(model, state, settings, ls.Draw(n=2, seed=7))
              + ls.rollout(model, state, settings, ls.Draw(n=2, seed=7, first_branch=2)))
    for a, b in zip(whole, slices, strict=True):
        assert torch.equal(a.tokens, b.tokens) and a.finish_reason == b.finish_reason
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.sampler_logprobs, b.sampler_logprobs, atol=1e-5, rtol=0)
    assert not torch.equal(slices[0].tokens, slices[2].tokens)  # the second slice did not redraw the first
    with pytest.raises(ValueError, match="first_branch"):
        ls.rollout(model, state, settings, ls.Draw(n=2, seed=7, first_branch=-1))


def drawn_logprobs(logits: list[float], temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """The sampling distribution of one step written out plainly, in float64: {token: log-prob} over the tokens it
    keeps. Tempered logits; the top_k largest; of those (renormalised), the fewest most likely whose mass reaches
    top_p."""
    scaled = [x / temperature for x in logits]
    ranked = sorted(range(len(scaled)), key=lambda j: -scaled[j])
    kept = ranked[:top_k] if top_k else ranked
    z = sum(math.exp(scaled[j] - scaled[kept[0]]) for j in kept)
    nucleus, mass = [], 0.0
    for j in kept:
        if mass >= top_p:
            break
        nucleus.append(j)
        mass += math.exp(scaled[j] - scaled[kept[0]]) / z
    log_z = scaled[nucleus[0]] + math.log(sum(math.exp(scaled[j] - scaled[nucleus[0]]) for j in nucleus))
    return {j: scaled[j] - log_z for j in nucleus}


@pytest.mark.parametrize("arch", ARCHS)
def test_sampler_logprobs_are_those_of_the_filtered_distribution(arch):
    """Each token's sampler log-prob is its log-prob under the tempered, top-k and top-p filtered distribution
    of its step: recomputed from a plain forward of prompt + response and the filter written out above."""
    model = model_for(arch)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # peaked enough that top-p 0.8 cuts the vocab, not so much as to break ties
    prompt = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(2))
    state = ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=16))
    temperature, top_k, top_p = 0.7, 20, 0.8
    samples = ls.rollout(model, state, ls.SamplingSettings(max_new_tokens=8, temperature=temperature, top_k=top_k,
                                                           top_p=top_p), ls.Draw(n=3, seed=1))
    cut = []
    for s in samples:
        with torch.no_grad():
            logits = model(torch.cat([prompt, s.tokens[:-1]])[None])[0, len(prompt) - 1 :].double()
        want = []
        for row, token in zip(logits.tolist(), s.tokens.tolist(), strict=True):
            dist = drawn_logprobs(row, temperature, top_k, top_p)
            assert token in dist  # never drawn outside the filter
            want.append(dist[token])
            cut.append(len(dist))
        assert s.sampler_logprobs.dtype == torch.float32 and s.sampler_logprobs.shape == s.tokens.shape
        torch.testing.assert_close(s.sampler_logprobs.double(), torch.tensor(want, dtype=torch.float64),
                                   atol=1e-4, rtol=0)
        assert not torch.allclose(s.sampler_logprobs, s.logprobs, atol=1e-2)  # not the temperature-1 log-probs
    assert max(cut) <= top_k and min(cut) < top_k  # top-k and top-p both cut somewhere


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_sampler_logprobs_at_temperature_1_unfiltered_and_greedy(arch):
    """Drawn from the model's own distribution, the sampler's log-probs are the model's; greedy draws from a point
    mass: 0 for every token (the temperature-1 log-probs stay the model's)."""
    model = model_for(arch)
    state = ls.capture(model, torch.randint(0, 97, (30,)), ls.EngineConfig(prompt_chunk=16))
    for s in ls.rollout(model, state, ls.SamplingSettings(max_new_tokens=8, temperature=1.0), ls.Draw(n=3, seed=4)):
        torch.testing.assert_close(s.sampler_logprobs, s.logprobs, atol=1e-6, rtol=0)
    for s in ls.rollout(model, state, ls.SamplingSettings(max_new_tokens=8, temperature=0.0, stop_ids=[3]),
                        ls.Draw(n=2)):
        assert torch.equal(s.sampler_logprobs, torch.zeros(len(s.tokens)))
        assert (s.logprobs < 0).all()
