"""rollout(decode=DecodeOptions(compile=...)): the decode step under torch.compile draws the same tokens as the
eager model, as one graph per step (no graph breaks), and compiles a bounded number of graphs however many tokens
it decodes. The static decode (static_shapes=True)
draws the same tokens as the dynamic one, and compiles one graph for all steps.

The slow part is compilation (tens of seconds per model on the CPU), so each family compiles once. `aot_eager`
traces and partitions exactly what inductor would get, without generating code; the dense model also runs inductor.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import longstraw as ls
from tests.conftest import GLM, tiny_model

CASES = [
    ("qwen3", torch.float32, "inductor"),
    ("qwen3_5_text", torch.float32, "aot_eager"),
    ("glm_moe_dsa", torch.bfloat16, "aot_eager"),  # grouped experts trace in bf16 only (what checkpoints hold)
]


def _model(arch: str, dtype: torch.dtype):
    if arch == "glm_moe_dsa":  # index_topk 20 < prompt: decoding runs the sparse path
        torch.manual_seed(0)
        return ls.build_model(GLM, dtype=dtype)
    return tiny_model(arch, dtype=dtype)


@pytest.mark.parametrize("arch,dtype,backend", CASES)
def test_compiled_decode_equals_eager(arch, dtype, backend):
    torch._dynamo.reset()
    counters.clear()
    model = _model(arch, dtype)
    state = ls.capture(model, torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(2)),
                       ls.EngineConfig(prompt_chunk=16))
    settings = ls.SamplingSettings(max_new_tokens=24, temperature=1.0)
    eager = ls.rollout(model, state, settings, ls.Draw(n=3, seed=5))
    compiled = ls.rollout(model, state, settings, ls.Draw(n=3, seed=5), decode=ls.DecodeOptions(compile=backend))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(eager, compiled):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=tol, rtol=0)
    assert dict(counters["graph_break"]) == {}
    # the first token, the second, then one graph with symbolic sizes for the other 22: not one per token
    assert counters["stats"]["unique_graphs"] <= 3
    # a second rollout (other prompt, other seed) reuses them
    again = ls.capture(model, torch.randint(0, 97, (33,), generator=torch.Generator().manual_seed(3)),
                       ls.EngineConfig(prompt_chunk=16))
    graphs = counters["stats"]["unique_graphs"]
    draw = ls.Draw(n=3, seed=6)
    for a, b in zip(ls.rollout(model, again, settings, draw),
                    ls.rollout(model, again, settings, draw, decode=ls.DecodeOptions(compile=backend))):
        assert torch.equal(a.tokens, b.tokens)
    assert counters["stats"]["unique_graphs"] == graphs


def _nan_cache(model):
    """Decode buffers full of NaN: what raw memory may hold, and what the static decode must never let through."""
    empty = model.empty_cache

    def poisoned(*args):
        return {i: s.map(lambda t: t.fill_(float("nan"))) for i, s in empty(*args).items()}
    model.empty_cache = poisoned
    return model


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text", "glm_moe_dsa"])
def test_static_decode_equals_the_dynamic_one(arch):
    model = _model(arch, torch.float32)
    state = ls.capture(model, torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(2)),
                       ls.EngineConfig(prompt_chunk=16))
    args = (ls.SamplingSettings(max_new_tokens=16, temperature=1.0, stop_ids=[3]), ls.Draw(n=3, seed=5))
    dynamic = ls.rollout(model, state, *args)
    static = ls.rollout(_nan_cache(model), state, *args, decode=ls.DecodeOptions(static_shapes=True))
    for a, b in zip(dynamic, static, strict=True):
        assert torch.equal(a.tokens, b.tokens) and a.finish_reason == b.finish_reason
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch,backend", [("qwen3_5_text", "aot_eager"), ("qwen3", "inductor")])
def test_static_decode_compiles_one_graph(arch, backend):
    """inductor takes the static decode in mode reduce-overhead (CUDA graphs; on a CPU the graph just runs)."""
    torch._dynamo.reset()
    counters.clear()
    model = _nan_cache(_model(arch, torch.float32))
    state = ls.capture(model, torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(2)),
                       ls.EngineConfig(prompt_chunk=16))
    args = (ls.SamplingSettings(max_new_tokens=16, temperature=1.0), ls.Draw(n=3, seed=5))
    static = ls.DecodeOptions(compile=backend, static_shapes=True)
    for a, b in zip(ls.rollout(model, state, *args), ls.rollout(model, state, *args, decode=static)):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
