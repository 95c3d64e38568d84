"""The state protocol: every built-in kind honours it. A new kind, with its mixer, plugs in without touching the
engine, rollout or store: tests/segment/test_toy_mixer.py."""

from __future__ import annotations

import pytest
import torch

import longstraw as ls
from longstraw.state import STATE_KINDS, LatentState, RecurrentState
from tests.conftest import GLM, tiny_model


def captured(arch: str, tokens: int = 30):
    torch.manual_seed(0)
    model = ls.build_model(GLM) if arch == "glm_moe_dsa" else tiny_model(arch)
    return model, ls.capture(model, torch.randint(0, 97, (tokens + 1,)), ls.EngineConfig(prompt_chunk=8))


@pytest.mark.parametrize("arch", ["qwen3_5_text", "glm_moe_dsa"])
def test_builtin_kinds_honour_the_protocol(arch):
    _, state = captured(arch)
    kinds = {type(s) for s in state.layers}
    assert kinds <= set(STATE_KINDS.values()) and len(kinds) == {"qwen3_5_text": 2, "glm_moe_dsa": 1}[arch]
    for s in state.layers:
        assert STATE_KINDS[s.kind] is type(s)
        assert s.bytes_per_token * 30 + s.fixed_bytes == s.nbytes
        # shards along the tokens join back to the whole, bitwise
        parts = [s.narrow(a, b) for a, b in ((0, 7), (7, 20), (20, 30))]
        joined = type(s).concat(parts)
        assert all(torch.equal(x, y) for x, y in zip(joined.tensors(), s.tensors()))
        if s.token_axis is None:  # a fixed-size state has no rows: it is the state after all of them
            assert s.narrow(3, 9) is s and s.boundary() is s and s.decode_buffer(4) is None
        else:
            assert parts[1].tokens == 13 and s.boundary() is None and s.for_branches(4) is s
            assert s.decode_buffer(4).tensors()[0].shape == (4, *s.tensors()[0].shape)
        g = s.grad_buffer()
        assert [n for n, _ in g.named_tensors().items()] == list(s.grad_fields)
        assert all(not t.any() for t in g.tensors())
        back = type(s).from_tensors(s.named_tensors())
        assert all(a is b for a, b in zip(back.tensors(), s.tensors()))
        assert s.to("meta").tensors()[0].device.type == "meta"


def test_latent_indexer_keys_get_no_gradient_buffer():
    _, state = captured("glm_moe_dsa")
    full = next(s for s in state.layers if isinstance(s, LatentState) and s.index_k is not None)
    assert full.grad_buffer().index_k is None and full.grad_buffer().kv.shape == full.kv.shape


def test_fixed_state_leaves_collect_their_gradient():
    _, state = captured("qwen3_5_text")
    rec = next(s for s in state.layers if isinstance(s, RecurrentState))
    leaf = rec.leaf()
    assert leaf.ssm.data_ptr() == rec.ssm.data_ptr() and leaf.ssm.requires_grad  # a view, not a copy
    (leaf.ssm.sum() * 2 + leaf.conv.sum()).backward()
    g = leaf.leaf_grad()
    assert torch.equal(g.ssm, torch.full_like(rec.ssm, 2.0)) and torch.equal(g.conv, torch.ones_like(rec.conv))
