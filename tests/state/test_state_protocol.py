"""The state protocol: every built-in kind honours it, and a fourth kind plugs in without touching the engine,
rollout or store (one module and one registry line; here both live in this test)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import longstraw as ls
from longstraw.models.common.mixer import TokenMixer
from longstraw.state import STATE_KINDS, FixedState, LatentState, RecurrentState, Segment
from longstraw.sharded_state import load_state_shard, save_state
from tests.conftest import GLM, flat_grad, rel_err, tiny_model


def captured(arch: str, tokens: int = 30):
    torch.manual_seed(0)
    model = ls.build_model(GLM) if arch == "glm_moe_dsa" else tiny_model(arch)
    return model, ls.capture(model, torch.randint(0, 97, (tokens + 1,)), 8)


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


# ---- a fourth kind: a decaying running sum (a toy linear recurrence) --------------------------------------------


@dataclass
class DecayState(FixedState):
    kind = "decay"
    label = "decaying sum"
    grad_fields = ("h",)

    h: torch.Tensor


class DecayMixer(TokenMixer):
    """h_t = 0.9 h_{t-1} + W_in x_t, output W_out h_t; its prefix state is h after the prefix."""

    def __init__(self, layer_idx: int, hidden: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.in_proj = nn.Linear(hidden, hidden, bias=False)
        self.out_proj = nn.Linear(hidden, hidden, bias=False)

    def empty_state(self, tokens, dtype, device):
        return DecayState(torch.zeros(self.in_proj.in_features, dtype=dtype, device=device))

    def _scan(self, x, seg):
        init = seg.initial_state(self.layer_idx)
        h = x.new_zeros(x.shape[0], x.shape[2]) if init is None else init.h.expand(x.shape[0], -1)
        u, out = self.in_proj(x), []
        for t in range(x.shape[1]):
            h = 0.9 * h + u[:, t]
            out.append(h)
        return torch.stack(out, 1), DecayState(h)

    def forward(self, x, rope, seg: Segment):
        out, final = self._scan(x, seg)
        seg.emit(self.layer_idx, final)
        return self.out_proj(out)

    def emit_state(self, x, rope, seg: Segment):
        seg.emit(self.layer_idx, self._scan(x, seg)[1])


@pytest.fixture
def decay_model(monkeypatch):
    monkeypatch.setitem(STATE_KINDS, DecayState.kind, DecayState)  # the registry line
    model = tiny_model("qwen3", dtype=torch.float64)
    torch.manual_seed(3)
    model.model.layers[1].self_attn = DecayMixer(1, model.config.hidden_size).double()
    return model


def test_a_fourth_kind_gets_the_exact_gradient(decay_model):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 97, (30,), generator=g)
    responses = [torch.randint(0, 97, (n,), generator=g) for n in (4, 7, 2)]
    grads = {}
    for mode, engine in (("naive", None), ("exact", ls.EngineConfig(prompt_chunk=4, prompt_graph_budget=0,
                                                                    boundary_every=3))):
        decay_model.zero_grad(set_to_none=True)
        ls.grpo_backward(decay_model, prompt, responses, [1.0, -0.4, -0.6], mode=mode, engine=engine)
        grads[mode] = flat_grad(decay_model)
    assert rel_err(grads["exact"], grads["naive"]) <= 1e-10
    assert decay_model.model.layers[1].self_attn.in_proj.weight.grad.abs().max() > 0


def test_a_fourth_kind_is_stored_and_decoded(decay_model, tmp_path):
    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(1))
    state = ls.capture(decay_model, prompt, 6)
    assert isinstance(state.layers[1], DecayState)
    save_state(state, str(tmp_path / "s"), weights_version="w", shard_tokens=5)
    back = load_state_shard(str(tmp_path / "s"), model=decay_model, weights_version="w")
    assert isinstance(back.layers[1], DecayState) and torch.equal(back.layers[1].h, state.layers[1].h)
    samples = ls.rollout(decay_model, back, n=3, max_new_tokens=5, seed=0)
    # each branch's sampled log-probs equal a replay of its tokens on the captured state
    scored = ls.score(decay_model, state, [s.tokens for s in samples])
    for s, lp in zip(samples, scored):
        assert torch.allclose(s.logprobs.double(), lp, atol=1e-5)
