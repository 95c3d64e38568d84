"""A new mixing primitive plugs in at exactly the places the extension guide (docs/extending.md, "Adding a layer
kind") lists, all of them in this file and none in the library: a decayed running sum h_t = a * h_{t-1} + u_t
(a scalar linear recurrence per channel, a toy Mamba), as

1. its state class (a `FixedState`) and its line in `STATE_KINDS`;
2. its op and the op's split variant (the ranks of a group compose their blocks of a prompt chunk);
3. its segment module: a function of the `Segment` that reads the layer's fixed-size state and picks the op;
4. the model layer (a `TokenMixer`) and a family that uses it;
5. the family's planner profile (`FamilyPlanner`: its layer kinds, proxy configs, attention geometry) and its
   line in `FAMILIES`.

Then capture -> replay -> the exact prompt backward give naive mode's gradient (fp64), on one process and on two
ranks of a sequence-parallel group, the state goes through the store, and decoding matches scoring.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import longstraw as ls
from longstraw.models.common.attention import Attention
from longstraw.models.common.decoder import CausalLM, DecoderLayer
from longstraw.models.common.mixer import TokenMixer
from longstraw.models.common.mlp import SwiGLU
from longstraw.models.common.norm import RMSNorm
from longstraw.models.config import ModelConfig
from longstraw.models.planner import FamilyPlanner, HeadAttention
from longstraw.models.registry import FAMILIES, Family
from longstraw.parallel import SequenceGroup, SequenceParallel
from longstraw.segment import Segment
from longstraw.sharded_state import load_state_shard, save_state
from longstraw.state import STATE_KINDS, FixedState
from longstraw.tools.activations import activation_profile
from tests.conftest import TINY, flat_grad, rel_err
from tests.parallel.launch import run_ranks

Tensor = torch.Tensor


# ---- 1. the state class (longstraw/state/<kind>.py) and its line in STATE_KINDS -----------------------------------
@dataclass
class DecayState(FixedState):
    """h: the running sum after the prefix, [dim] (with a batch dim in front inside a forward)."""

    kind = "toy_decay"
    label = "decayed running sum"
    grad_fields = ("h",)

    h: Tensor


# ---- 2. the op and its split variant (longstraw/ops/<op>.py) -----------------------------------------------------
def decayed_sum(u: Tensor, a: Tensor, h0: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(h_1..h_T [B, T, D], h_T [B, D]) of h_t = a * h_{t-1} + u_t over u [B, T, D], a [D] in (0, 1), from h0
    [B, D] (None: zeros)."""
    h = u.new_zeros(u.shape[0], u.shape[2]) if h0 is None else h0
    out = []
    for t in range(u.shape[1]):
        h = a * h + u[:, t]
        out.append(h)
    return (torch.stack(out, 1) if out else u.new_zeros(u.shape)), h


def split_decayed_sum(u: Tensor, a: Tensor, h0: Tensor | None, group: SequenceGroup, order: list[int]
                      ) -> tuple[Tensor, Tensor]:
    """`decayed_sum` over a chunk whose consecutive blocks the ranks of `group` hold (this rank: u of its block;
    `order`: the ranks in position order). Over a block the recurrence is affine in its start, h_end = a^T h_in +
    s (s: the block run from zeros), so the ranks all-gather (a^T, s), compose them in position order for each
    block's h_in and the chunk's final h (the same on every rank), and add a^t h_in to their outputs."""
    b, t, d = u.shape
    local, s = decayed_sum(u, a)
    summaries = group.gather_blocks(torch.stack([(a ** t).expand(b, d), s], dim=1), [b] * group.size, dim=0,
                                    autograd=True)
    state = u.new_zeros(b, d) if h0 is None else h0
    mine = state
    for r in order:
        if r == group.rank:
            mine = state
        carry, block_sum = summaries[r].unbind(1)
        state = carry * state + block_sum
    powers = a ** torch.arange(1, t + 1, dtype=u.dtype, device=u.device)[:, None]  # [T, D]
    return local + powers * mine[:, None], state


# ---- 3. the segment module (longstraw/segment/<primitive>.py) ----------------------------------------------------
def decay(seg: Segment, layer: int, u: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """The decayed sum over the segment from the layer's fixed-size state (zeros at the sequence start); on a
    split chunk the ranks compose their blocks. Decoding needs nothing more: a branch carries its own state."""
    init = seg.initial_state(layer)
    h0 = None if init is None else init.h.expand(u.shape[0], -1)
    if seg.split is None:
        return decayed_sum(u, a, h0)
    return split_decayed_sum(u, a, h0, seg.split.group, seg.split.order)


# ---- 4. the model layer (models/common/<mixer>.py) and the family (models/<family>/, models/registry.py) ----------
class DecayMixer(TokenMixer):
    """out = W_out h, h_t = a * h_{t-1} + W_in x_t with a learnt decay a = sigmoid(decay_logit) per channel."""

    def __init__(self, layer_idx: int, hidden: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.in_proj = nn.Linear(hidden, hidden, bias=False)
        self.decay_logit = nn.Parameter(torch.linspace(-1.0, 2.0, hidden))
        self.out_proj = nn.Linear(hidden, hidden, bias=False)

    def empty_state(self, tokens, dtype, device) -> DecayState:
        return DecayState(torch.zeros(self.in_proj.in_features, dtype=dtype, device=device))

    def _run(self, x: Tensor, seg: Segment) -> tuple[Tensor, DecayState]:
        out, h = decay(seg, self.layer_idx, self.in_proj(x), torch.sigmoid(self.decay_logit))
        return out, DecayState(h)

    def forward(self, x, rope, seg: Segment) -> Tensor:
        out, final = self._run(x, seg)
        seg.emit(self.layer_idx, final)
        return self.out_proj(out)

    def emit_state(self, x, rope, seg: Segment) -> None:
        seg.emit(self.layer_idx, self._run(x, seg)[1])


@dataclass(frozen=True, kw_only=True)
class ToyConfig(ModelConfig):
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]  # "decay" or "attention" per layer

    @classmethod
    def from_hf(cls, cfg: dict) -> "ToyConfig":
        heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        alternating = [("decay", "attention")[i % 2] for i in range(layers)]  # a hybrid, as Qwen3.5
        return cls(**cls.common(cfg, "toy_decay"), model_type="toy_decay", raw=cfg,
                   num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   layer_types=tuple(cfg.get("layer_types") or alternating))


class ToyDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ToyConfig, idx: int) -> None:
        super().__init__()
        self.self_attn = DecayMixer(idx, cfg.hidden_size) if cfg.layer_types[idx] == "decay" else \
            Attention.from_config(cfg, idx, o_bias=False, qk_norm=None)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class ToyForCausalLM(CausalLM):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__(cfg, ToyDecoderLayer, RMSNorm, cfg.head_dim)


# ---- 5. the planner profile (models/<family>/planner.py) and the registry lines -----------------------------------
class ToyPlanner(FamilyPlanner):
    def layer_kinds(self, cfg: ToyConfig) -> tuple[str, ...]:
        return cfg.layer_types

    def proxy_config(self, hf_config: dict, kind: str, layers: int) -> dict:
        return {**hf_config, "num_hidden_layers": layers, "layer_types": [kind] * layers}

    def attention(self, cfg: ToyConfig) -> HeadAttention:
        return HeadAttention(cfg.num_attention_heads, cfg.head_dim)


TOY = dict(TINY, model_type="toy_decay", num_hidden_layers=4)


@contextmanager
def registered():
    """The two registry lines: the state kind (for the store) and the family (for build_model and the planner)."""
    STATE_KINDS[DecayState.kind] = DecayState
    FAMILIES["toy_decay"] = Family(ToyConfig, ToyForCausalLM, ToyPlanner())
    try:
        yield
    finally:
        del STATE_KINDS[DecayState.kind], FAMILIES["toy_decay"]


# ---- the checks --------------------------------------------------------------------------------------------------
PROMPT, CHUNK, LENGTHS, ADV = 23, 4, (4, 7, 2), [1.0, -0.4, -0.6]


def group() -> tuple[Tensor, list[Tensor]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 97, (PROMPT,), generator=g), [torch.randint(0, 97, (n,), generator=g) for n in LENGTHS]


def toy_model() -> nn.Module:
    torch.manual_seed(3)
    model = ls.build_model(TOY, dtype=torch.float64)
    with torch.no_grad():  # build_model draws every matrix at std 0.02: make the toy mixer's part of the output count
        for layer in model.model.layers[::2]:
            layer.self_attn.in_proj.weight.normal_(0.0, 0.3)
            layer.self_attn.out_proj.weight.normal_(0.0, 0.3)
    return model


def naive_grad(model: nn.Module) -> Tensor:
    prompt, responses = group()
    model.zero_grad(set_to_none=True)
    ls.grpo_backward(model, prompt, responses, ADV, mode="naive")
    return flat_grad(model)


@pytest.fixture
def toy():
    with registered():
        yield toy_model()


def test_the_op_is_the_closed_form():
    """h_t = sum_{s <= t} a^(t - s) u_s + a^t h0: the loop and the split composition against the sum written out."""
    g = torch.Generator().manual_seed(1)
    u, h0 = torch.randn(2, 6, 3, generator=g, dtype=torch.float64), torch.randn(2, 3, generator=g, dtype=torch.float64)
    a = torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)
    t = torch.arange(1, 7, dtype=torch.float64)
    lags = (t[:, None] - t[None, :]).clamp(min=0)[..., None]  # [T, S, 1]
    seen = (t[:, None] >= t[None, :])[..., None]
    weights = torch.where(seen, a ** lags, torch.zeros((), dtype=torch.float64))  # [T, S, D]
    want = torch.einsum("tsd,bsd->btd", weights, u) + a ** t[:, None] * h0[:, None]
    out, final = decayed_sum(u, a, h0)
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12) and torch.equal(final, out[:, -1])
    # one rank: the split composition of a single block is the plain op
    out1, final1 = split_decayed_sum(u, a, h0, SequenceGroup(), [0])
    assert torch.allclose(out1, want, rtol=1e-12, atol=1e-12) and torch.allclose(final1, final, rtol=1e-12)


def test_exact_prompt_backward_gives_the_naive_gradient(toy):
    prompt, responses = group()
    want = naive_grad(toy)
    toy.zero_grad(set_to_none=True)
    ls.grpo_backward(toy, prompt, responses, ADV, mode="exact",
                     engine=ls.EngineConfig(prompt_chunk=CHUNK, prompt_graph_budget=0, boundary_every=2))
    got = flat_grad(toy)
    assert rel_err(got, want) <= 1e-10
    decay_grad = toy.model.layers[0].self_attn.decay_logit.grad
    assert decay_grad is not None and decay_grad.abs().max() > 1e-6  # the toy mixer is in the gradient
    # the prompt's part of it: a detached replay (no gradient through the prompt) gives another one
    toy.zero_grad(set_to_none=True)
    ls.grpo_backward(toy, prompt, responses, ADV, mode="detached", engine=ls.EngineConfig(prompt_chunk=CHUNK))
    assert rel_err(flat_grad(toy), want) > 1e-3


def test_the_state_is_stored_and_decoded(toy, tmp_path):
    prompt, _ = group()
    state = ls.capture(toy, prompt, ls.EngineConfig(prompt_chunk=CHUNK))
    assert [type(s) for s in state.layers] == [DecayState, ls.AttentionState] * 2
    save_state(state, str(tmp_path / "s"), weights_version="w", shard_tokens=5)
    back = load_state_shard(str(tmp_path / "s"), model=toy, weights_version="w")
    assert isinstance(back.layers[0], DecayState) and torch.equal(back.layers[0].h, state.layers[0].h)
    samples = ls.rollout(toy, back, ls.SamplingSettings(max_new_tokens=5), ls.Draw(n=3, seed=0))
    # each branch's sampled log-probs equal a replay of its tokens on the captured state
    for s, lp in zip(samples, ls.score(toy, state, [s.tokens for s in samples])):
        assert torch.allclose(s.logprobs.double(), lp, atol=1e-5)


def split_rank(rank: int, world: int) -> dict[str, Tensor]:
    """One rank of a sequence-parallel group: the prompt's chunks split over the ranks (the split variant)."""
    with registered():
        model = toy_model()
        prompt, responses = group()
        ls.grpo_backward(model, prompt, responses, ADV, mode="exact", parallel=SequenceParallel(),
                         engine=ls.EngineConfig(prompt_chunk=CHUNK, prompt_graph_budget=0))
        return {"grad": flat_grad(model)}


def test_two_ranks_give_the_naive_gradient():
    with registered():
        want = naive_grad(toy_model())
    for r in run_ranks(2, split_rank, timeout=120):
        assert rel_err(r["grad"], want) <= 1e-10


def test_the_planner_measures_each_layer_kind():
    with registered():
        profile = activation_profile(TOY, gpu=False, dtype=torch.float32)
    assert [(k.name, k.count) for k in profile.kinds] == [("decay", 2), ("attention", 2)]
    assert all(k.bytes_per_token > 0 for k in profile.kinds)
