"""Parity of the Qwen3.5 hybrid (Gated DeltaNet + gated full attention) with transformers' implementation.

A tiny random transformers `Qwen3_5ForCausalLM` with 8 layers (linear, linear, linear, full, x2) has every
parameter re-randomised (zero-centred norms, the gated output norm, A_log, dt_bias and the conv included, so a
misplaced offset or a swapped parameter shows), is saved with save_pretrained and loaded with longstraw.load_model.
Besides full-sequence logits, the prefix-state path (capture + score) is compared with transformers' own
cache: prompt[:-1] into a DynamicCache, then each branch `[prompt[-1]] + response[:-1]` on a copy of it.
"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import longstraw as ls
from longstraw.state import AttentionState, RecurrentState
from tests.conftest import assert_same_parameters, rel_err, state_tensors


ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
HF_TINY = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # grouped: each key head serves 2 value heads
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters=ROPE,
)
VISION_TINY = dict(
    depth=1,
    hidden_size=16,
    num_heads=2,
    intermediate_size=32,
    out_hidden_size=64,
    patch_size=2,
    spatial_merge_size=1,
    temporal_patch_size=1,
    in_channels=3,
    num_position_embeddings=16,
)
P = 150  # prompt length: the state covers 149 tokens, more than two of the op's internal 64-token chunks
RESPONSE_LENGTHS = (1, 5, 9)


def text_config(**overrides) -> transformers.Qwen3_5TextConfig:
    cfg = transformers.Qwen3_5TextConfig(**{**HF_TINY, **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def randomise(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random; norm weights, A_log, dt_bias and the conv get noise too.

    Projections have gain 0.5: the logits are O(1) and still depend strongly on every norm, while the 8-layer
    model stays well-conditioned enough (fp32 vs fp64 ~1e-6) for a 1e-4 tolerance to separate bugs from noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if name.endswith("A_log"):
                p.copy_(0.5 * noise - 1.0)  # A ~ 0.4: the state carries information over many tokens
            elif name.endswith("dt_bias"):
                p.add_(0.5 * noise)
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * noise)
            elif p.dim() == 1:  # zero-centred norms (offset from 1) and the gated norm (ones)
                p.add_(0.2 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            else:
                p.copy_(0.5 * noise / p.shape[-1] ** 0.5)
    return model


def hf_causal_lm(seed: int = 0, **overrides) -> transformers.Qwen3_5ForCausalLM:
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(text_config(**overrides)).eval()
    return randomise(model, seed)


def random_ids(batch: int, seq: int, vocab: int = 101, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


def save(model, path) -> None:
    model.save_pretrained(path)
    assert list(path.glob("*.safetensors"))


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    hf = hf_causal_lm()
    path = tmp_path_factory.mktemp("qwen3_5")
    save(hf, path)
    return hf, ls.load_model(path), path


# --- loading and full-sequence parity -----------------------------------------------------------------------------


def test_layer_types_and_checkpoint_layout(hf_and_ours):
    hf, ours, path = hf_and_ours
    types = hf.config.layer_types
    assert types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text"
    for i, t in enumerate(types):
        layer = ours.model.layers[i]
        assert hasattr(layer, "linear_attn") == (t == "linear_attention")
        assert hasattr(layer, "self_attn") == (t == "full_attention")


def test_parameters_match_transformers(hf_and_ours):
    hf, ours, _ = hf_and_ours
    assert_same_parameters(ours, hf)
    assert all(p.dtype == torch.float32 for p in ours.parameters())


def test_full_pass_logits(hf_and_ours):
    hf, ours, _ = hf_and_ours
    ids = random_ids(2, P)
    want = hf_logits(hf, ids)
    with torch.no_grad():
        got = ours(ids)
    assert got.shape == want.shape == (2, P, 101)
    assert max_abs(got, want) <= 1e-4
    assert float(want.abs().max()) > 0.5  # the logits are O(1), so the tolerance means something
    # the randomised norms matter: with them reset the logits move far
    plain = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if name.endswith("layernorm.weight"):
                p.zero_()
    assert max_abs(hf_logits(plain, ids), want) > 1e-2


def test_build_model_matches_architecture(hf_and_ours):
    hf, _, path = hf_and_ours
    built = ls.build_model(json.loads((path / "config.json").read_text()))
    got = [(n, tuple(p.shape)) for n, p in built.named_parameters()]
    assert got == [(n, tuple(p.shape)) for n, p in hf.named_parameters()]


# --- the prefix state: capture + score vs transformers' cache ----------------------------------------------------


@pytest.fixture(scope="module")
def continuation(hf_and_ours):
    """transformers: prompt[:-1] into a DynamicCache, then each branch on a deep copy of it."""
    hf, _, _ = hf_and_ours
    prompt = random_ids(1, P, seed=1)[0]
    gen = torch.Generator().manual_seed(2)
    responses = [torch.randint(0, 101, (n,), generator=gen) for n in RESPONSE_LENGTHS]
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(input_ids=prompt[None, :-1], cache=cache, use_cache=True)
        want = []
        for r in responses:
            branch = torch.cat([prompt[-1:], r[:-1]])[None]
            pos = torch.arange(P - 1, P - 1 + r.numel())[None]
            logits = hf(input_ids=branch, position_ids=pos, cache=copy.deepcopy(cache), use_cache=True).logits
            want.append(torch.log_softmax(logits[0].float(), -1).gather(-1, r[:, None])[:, 0])
        # the same log-probs from a single full forward over prompt + response, without any cache
        for r, w in zip(responses, want):
            full = hf_logits(hf, torch.cat([prompt, r[:-1]])[None])[0, P - 1 :]
            assert max_abs(torch.log_softmax(full, -1).gather(-1, r[:, None])[:, 0], w) <= 1e-4
    return prompt, responses, cache, want


@pytest.mark.parametrize("chunk", [37, 64, 1000])
@pytest.mark.parametrize("branch_batch", [1, 3])
def test_continuation_logprobs(hf_and_ours, continuation, chunk, branch_batch):
    _, ours, _ = hf_and_ours
    prompt, responses, _, want = continuation
    state = ls.capture(ours, prompt, ls.EngineConfig(prompt_chunk=chunk))
    assert state.length == P - 1
    assert state.chunks[0] == (0, min(chunk, P - 1)) and state.chunks[-1][1] == P - 1
    got = ls.score(ours, state, responses, engine=ls.EngineConfig(branch_batch=branch_batch))
    assert [g.shape for g in got] == [(n,) for n in RESPONSE_LENGTHS]
    for g, w in zip(got, want):
        assert max_abs(g, w) <= 1e-4
    # log-probs, and not all alike
    all_w = torch.cat(want)
    assert float(all_w.max()) <= 0 and float(all_w.std()) > 0.1


def test_continuation_depends_on_prompt(hf_and_ours, continuation):
    """The state carries the prompt: another prompt ending in the same token scores the responses differently."""
    _, ours, _ = hf_and_ours
    prompt, responses, _, want = continuation
    other = prompt.clone()
    other[:10] = (other[:10] + 1) % 101  # only the first tokens differ; they reach the end through the state
    got = ls.score(ours, ls.capture(ours, other, ls.EngineConfig(prompt_chunk=64)), responses)
    assert max(max_abs(g, w) for g, w in zip(got, want)) > 1e-3


def test_prefix_state_matches_cache(hf_and_ours, continuation):
    hf, ours, _ = hf_and_ours
    prompt, responses, cache, _ = continuation
    cfg = hf.config
    state = ls.capture(ours, prompt, ls.EngineConfig(prompt_chunk=37))
    kernel = cfg.linear_conv_kernel_dim
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
    conv_dim += cfg.linear_num_value_heads * cfg.linear_value_head_dim
    assert len(state.layers) == cfg.num_hidden_layers
    for i, t in enumerate(cfg.layer_types):
        s, c = state.layers[i], cache.layers[i]
        if t == "full_attention":
            assert isinstance(s, AttentionState)
            assert s.k.shape == s.v.shape == (cfg.num_key_value_heads, P - 1, cfg.head_dim)
            assert c.keys.shape == (1, cfg.num_key_value_heads, P - 1, cfg.head_dim)
            assert max_abs(s.k, c.keys[0]) <= 1e-4, i
            assert max_abs(s.v, c.values[0]) <= 1e-4, i
        else:
            assert isinstance(s, RecurrentState)
            assert s.conv.shape == (conv_dim, kernel - 1)
            assert s.conv.dtype == torch.float32
            assert s.ssm.shape == (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            assert s.ssm.dtype == torch.float32
            hf_conv, hf_ssm = c.conv_states[0], c.recurrent_states[0]
            # transformers keeps the last `kernel` conv inputs; the conv only needs the last kernel-1
            assert hf_conv.shape == (1, conv_dim, kernel)
            assert torch.allclose(s.conv, hf_conv[0, :, 1:], rtol=1e-5, atol=1e-5), i
            assert max_abs(s.ssm, hf_ssm[0]) <= 1e-4, i
            assert float(hf_ssm.abs().max()) > 1e-2


def test_state_unchanged_by_score(hf_and_ours, continuation):
    _, ours, _ = hf_and_ours
    prompt, responses, _, want = continuation
    state = ls.capture(ours, prompt, ls.EngineConfig(prompt_chunk=64))
    snapshot = state_tensors(state)
    first = ls.score(ours, state, responses)
    for bb in (3, 2, 1):
        again = ls.score(ours, state, responses, engine=ls.EngineConfig(branch_batch=bb))
        for a, b in zip(again, first):
            assert max_abs(a, b) <= 1e-5
    after = state_tensors(state)
    assert len(after) == len(snapshot)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, after))


# --- the multimodal checkpoint layout --------------------------------------------------------------------------------


def test_conditional_generation_layout(tmp_path, caplog):
    text = {**HF_TINY}
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=dict(VISION_TINY))
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = randomise(transformers.Qwen3_5ForConditionalGeneration(cfg).eval(), seed=3)
    mm_dir = tmp_path / "mm"
    save(hf, mm_dir)
    f = mm_dir / "model.safetensors"
    tensors = load_file(str(f))
    keys = sorted(tensors)
    assert "lm_head.weight" in keys
    assert any(k.startswith("model.language_model.layers.0.linear_attn.") for k in keys)
    assert any(k.startswith("model.visual.") for k in keys)
    assert not any(k.startswith("model.layers.") for k in keys)
    # an MTP head as the released checkpoints carry: not part of the text model
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, str(f), metadata={"format": "pt"})
    n_ignored = sum(k.startswith(("model.visual.", "mtp.")) for k in tensors)

    with caplog.at_level(logging.INFO, logger="longstraw"):
        ours = ls.load_model(mm_dir)
    msgs = [r.getMessage() for r in caplog.records if r.name.startswith("longstraw")]
    assert any("ignor" in m.lower() and str(n_ignored) in m for m in msgs), msgs

    # the same text weights as a plain Qwen3_5ForCausalLM checkpoint
    lm_dir = tmp_path / "lm"
    text_only = transformers.Qwen3_5ForCausalLM(text_config()).eval()
    lm_state = {
        "model." + k[len("model.language_model.") :]: v
        for k, v in hf.state_dict().items()
        if k.startswith("model.language_model.")
    }
    lm_state["lm_head.weight"] = hf.lm_head.weight.detach()
    missing, unexpected = text_only.load_state_dict(lm_state, strict=False)
    assert not unexpected and not missing
    save(text_only, lm_dir)
    ours_lm = ls.load_model(lm_dir)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ours_lm.named_parameters()]

    ids = random_ids(2, 80, seed=4)
    with torch.no_grad():
        got = ours(ids)
        assert max_abs(got, ours_lm(ids)) <= 1e-5
        want = hf(input_ids=ids).logits
    assert max_abs(got, want) <= 1e-4
    assert max_abs(got, hf_logits(text_only, ids)) <= 1e-4
    assert float(want.abs().max()) > 0.5


# --- variants and errors ---------------------------------------------------------------------------------------------


def test_tied_embeddings(tmp_path):
    hf = hf_causal_lm(seed=5, tie_word_embeddings=True)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    save(hf, tmp_path)
    ours = ls.load_model(tmp_path)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(ours.named_parameters())
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in hf.named_parameters()]
    ids = random_ids(2, 70, seed=6)
    with torch.no_grad():
        assert max_abs(ours(ids), hf_logits(hf, ids)) <= 1e-4


def test_load_bfloat16(hf_and_ours):
    hf, ours, path = hf_and_ours
    ours16 = ls.load_model(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours16.parameters())
    ids = random_ids(2, 100, seed=7)
    with torch.no_grad():
        got = ours16(ids)
    want = hf_logits(hf, ids)
    assert got.dtype == torch.bfloat16
    assert torch.isfinite(got).all()
    assert rel_err(got.float(), want) <= 5e-2
    assert max_abs(got, want) > 0  # bf16 really in use
    # the delta-rule state stays fp32 in a bf16 model, the conv tail follows the model dtype
    state = ls.capture(ours16, ids[0], ls.EngineConfig(prompt_chunk=37))
    lin = [s for s in state.layers if isinstance(s, RecurrentState)]
    assert lin and all(s.ssm.dtype == torch.float32 and s.conv.dtype == torch.bfloat16 for s in lin)
    ref_state = ls.capture(ours, ids[0], ls.EngineConfig(prompt_chunk=37))
    for s16, s32 in zip(state.layers, ref_state.layers):
        if isinstance(s32, RecurrentState):
            assert rel_err(s16.ssm, s32.ssm) <= 5e-2


def _config_dict(**overrides) -> dict:
    return {**json.loads(text_config().to_json_string()), **overrides}


@pytest.mark.parametrize(
    "layer_types",
    [
        ["linear_attention", "sliding_attention"] * 4,  # a layer type we do not implement
        ["linear_attention", "full_attention"] * 3,  # wrong length
    ],
)
def test_bad_layer_types(tmp_path, layer_types):
    cfg = _config_dict(layer_types=layer_types)
    with pytest.raises(ValueError, match="layer_types"):
        ls.build_model(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="layer_types"):
        ls.load_model(tmp_path)


def test_full_attention_interval_without_layer_types():
    """Configs without layer_types get every 4th layer full attention, as transformers does."""
    cfg = _config_dict()
    cfg.pop("layer_types")
    model = ls.build_model(cfg)
    kinds = ["self_attn" if hasattr(layer, "self_attn") else "linear_attn" for layer in model.model.layers]
    assert kinds == ["linear_attn"] * 3 + ["self_attn"] + ["linear_attn"] * 3 + ["self_attn"]
