"""Exact mode's graph budget: autograd-saved bytes per token are measured, linear in the chunk, and the probe
leaves no trace (no parameter gradients)."""

from __future__ import annotations

import pytest
import torch

import longstraw as ls
from longstraw.engine import budget
from longstraw.engine.budget import activation_bytes_per_token
from longstraw.segment import PrefixView, Segment
from tests.conftest import GLM, tiny_model


def saved_bytes(model, tokens: int) -> int:
    """Every saved tensor's storage, once, of one chunk at position 1 (an independent count: plain walk)."""
    state = ls.capture(model, torch.arange(2))
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    seg = Segment(start=1, prefix=PrefixView(state.layers, 1), collect=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.emit_states((torch.arange(1, 1 + tokens) % 97)[None], seg)
    return sum(seen.values())


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text", "glm_moe_dsa"])
def test_measured_bytes_predict_a_longer_chunk(arch):
    torch.manual_seed(0)
    model = ls.build_model(GLM) if arch == "glm_moe_dsa" else tiny_model(arch)
    per = activation_bytes_per_token(model)
    assert all(p.grad is None for p in model.parameters())
    # whole delta-rule chunks (64), and beyond GLM's index_topk (20), as real prompt chunks are
    grown = saved_bytes(model, 320) - saved_bytes(model, 64)
    assert grown == pytest.approx(per * 256, rel=0.05)


def test_measured_once_per_model_and_dtype(monkeypatch):
    model = tiny_model("qwen3")
    calls = []
    real = budget._saved_bytes
    monkeypatch.setattr(budget, "_saved_bytes", lambda *a: calls.append(1) or real(*a))
    first = activation_bytes_per_token(model)
    assert activation_bytes_per_token(model) == first and len(calls) == 2
    model.double()
    assert activation_bytes_per_token(model) == 2 * first and len(calls) == 4
