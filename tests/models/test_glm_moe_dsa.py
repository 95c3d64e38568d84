"""GLM-5 (`glm_moe_dsa`): parity with transformers' `GlmMoeDsaForCausalLM`, the latent prefix state, DSA selection
(ties included), per-expert checkpoint keys, absorbed MLA vs the expanded form, and exact == naive gradients.

Tiny random transformers models (4 layers: 1 dense MLP + 3 MoE, MLA with q/kv LoRA, DSA indexer) have every
parameter and the router's score-correction bias re-randomised, are saved with save_pretrained and loaded with
longstraw.load_model. "dense" checkpoints have index_topk above every sequence length (DSA keeps every position);
"sparse" ones select 12 positions per query out of up to ~60, so the indexer decides what each query sees.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import longstraw as ls
import longstraw.models.common.mla as mla_module
import longstraw.ops.sparse_attention as sparse_module
from longstraw.engine import activation_bytes_per_token
from longstraw.segment import PrefixView, Segment
from longstraw.state import LatentState
from longstraw.tools.state_size import state_size
from tests.conftest import assert_same_parameters, flat_grad, rel_err, state_tensors

HF_TINY = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    index_head_dim=16,
    index_n_heads=32,  # many indexer heads: no two index scores tie (all-zero relu terms are ~2^-32 rare)
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=1024,
    routed_scaling_factor=2.5,
)
DENSE_K, SPARSE_K = 1024, 12
SHARED_TYPES = ["full", "shared", "full", "shared"]
P = 50  # prompt length: the state covers 49 tokens; chunks of 16 leave a partial last chunk
RESPONSE_LENGTHS = (1, 7, 12)
VOCAB = HF_TINY["vocab_size"]
RANK, ROPE = HF_TINY["kv_lora_rank"], HF_TINY["qk_rope_head_dim"]
FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")


def hf_config(index_topk: int, **overrides) -> transformers.GlmMoeDsaConfig:
    cfg = transformers.GlmMoeDsaConfig(**{**HF_TINY, "index_topk": index_topk, **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def randomise(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random (norms get noise around their init) and the router's correction bias too, so a
    swapped, skipped or misplaced tensor shows. Projections have gain 0.5 (O(1) logits, well conditioned)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
            if p.dim() == 1:  # RMSNorm / LayerNorm weights, the LayerNorm bias of the indexer key
                p.add_(0.2 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            else:
                p.copy_(0.5 * noise / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float64).to(b.dtype))
    return model


def hf_model(index_topk: int, seed: int = 0, **overrides) -> transformers.GlmMoeDsaForCausalLM:
    torch.manual_seed(seed)
    return randomise(transformers.GlmMoeDsaForCausalLM(hf_config(index_topk, **overrides)).eval(), seed)


def our_config(index_topk: int, **overrides) -> dict:
    return {"model_type": "glm_moe_dsa", **HF_TINY, "index_topk": index_topk, **overrides}

def random_ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def first_k_mask(seq: int, k: int) -> torch.Tensor:
    """Additive 4D mask [1, 1, S, S] that lets query t see positions j <= t with j < k (the k lowest visible)."""
    j = torch.arange(seq)
    keep = (j[None, :] <= j[:, None]) & (j[None, :] < k)
    return torch.zeros(seq, seq).masked_fill(~keep, torch.finfo(torch.float32).min)[None, None]


def save(model, path: Path) -> Path:
    model.save_pretrained(path)
    assert list(path.glob("*.safetensors"))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Three configs: dense DSA, sparse DSA (the same random weights), sparse with shared-indexer layers."""
    out = {}
    for name, k, extra in [
        ("dense", DENSE_K, {}),
        ("sparse", SPARSE_K, {}),
        ("shared", SPARSE_K, {"indexer_types": SHARED_TYPES}),
    ]:
        hf = hf_model(k, **extra)
        path = save(hf, tmp_path_factory.mktemp(name))
        out[name] = (hf, ls.load_model(path), path)
    return out


def logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1).gather(-1, targets[:, None])[:, 0]


@pytest.fixture(scope="module")
def group():
    prompt = random_ids(1, P, seed=1)[0]
    gen = torch.Generator().manual_seed(2)
    responses = [torch.randint(0, VOCAB, (n,), generator=gen) for n in RESPONSE_LENGTHS]
    return prompt, responses


def hf_continuation(hf, prompt, responses, mask_k: int | None = None) -> list[torch.Tensor]:
    """Log-probs of each response from one transformers forward over prompt + response[:-1] (no cache)."""
    want = []
    for r in responses:
        ids = torch.cat([prompt, r[:-1]])[None]
        mask = None if mask_k is None else first_k_mask(ids.shape[1], mask_k)
        want.append(logprobs(hf_logits(hf, ids, mask)[0, P - 1 :], r))
    return want


# --- DSA selections as computed (a spy on select_topk) ----------------------------------------------------------


@pytest.fixture
def recorded_selections(monkeypatch):
    """Every select_topk call the MLA layers make, in call order: (first own position, index scores over all
    positions [B, T, L], (pos, valid))."""
    calls = []
    real = sparse_module.select_topk

    def spy(blocks, k):
        blocks = list(blocks)
        out = real(iter(blocks), k)
        calls.append((int(blocks[-1][0][0]), torch.cat([b for _, b in blocks], dim=-1), out))
        return out

    monkeypatch.setattr(sparse_module, "select_topk", spy)
    return calls


def assert_clear_cut(calls, k: int, min_gap: float = 1e-6) -> int:
    """The premise of comparing selections with transformers (whose topk breaks ties arbitrarily): for every query
    with more than k visible positions, the k-th and (k+1)-th best index scores differ by more than rounding.
    Returns how many queries had to drop positions (so a test can check the sparse path really ran)."""
    dropped = 0
    for _, scores, _ in calls:
        top = scores.sort(dim=-1, descending=True).values
        over = (scores > float("-inf")).sum(-1) > k
        if k < scores.shape[-1]:
            gap = (top[..., k - 1] - top[..., k])[over]
            assert gap.numel() == 0 or float(gap.min()) > min_gap, float(gap.min())
        dropped += int(over.sum())
    return dropped


# --- loading ---------------------------------------------------------------------------------------------------------


def test_layout_and_parameters_match_transformers(checkpoints):
    hf, ours, path = checkpoints["dense"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa"
    assert cfg["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"]
    assert_same_parameters(ours, hf)
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    # the router's correction bias is a buffer (not a parameter) and is loaded too
    hf_bias = {n: b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")}
    our_bias = {n: b for n, b in ours.named_buffers() if n.endswith("e_score_correction_bias")}
    assert sorted(hf_bias) == sorted(our_bias) == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2, 3)]
    for n, b in hf_bias.items():
        assert float(b.abs().max()) > 0.01
        assert torch.equal(our_bias[n], b), n
    # build_model from the same config.json gives the same architecture
    built = ls.build_model(cfg)
    assert [(n, tuple(p.shape)) for n, p in built.named_parameters()] == [
        (n, tuple(p.shape)) for n, p in hf.named_parameters()
    ]
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["SwiGLU", "MoE", "MoE", "MoE"]


def test_shared_indexer_layers_have_no_indexer(checkpoints):
    hf, ours, _ = checkpoints["shared"]
    assert list(hf.config.indexer_types) == SHARED_TYPES
    assert [hasattr(layer.self_attn, "indexer") for layer in ours.model.layers] == [True, False, True, False]
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in hf.named_parameters()]


def test_load_bfloat16_keeps_router_and_indexer_head_fp32(checkpoints):
    hf, ours, path = checkpoints["dense"]
    ours16 = ls.load_model(path, dtype=torch.bfloat16)
    kept = 0
    assert ours16.model.rotary_emb.inv_freq.dtype == torch.float32  # computed, not loaded: outside the state dict
    for n, t in ours16.state_dict(keep_vars=True).items():
        if n.endswith(FP32_SUFFIXES):
            assert t.dtype == torch.float32, n
            kept += 1
        else:
            assert t.dtype == torch.bfloat16, n
    assert kept == 3 * 2 + 4  # router weight + bias in 3 MoE layers, indexer head weights in 4 layers
    # fp32 tensors are loaded exactly, not through bf16
    theirs = {**dict(hf.named_parameters()), **dict(hf.named_buffers())}
    for n, t in [*ours16.named_parameters(), *ours16.named_buffers()]:
        if n.endswith(FP32_SUFFIXES):
            assert torch.equal(t, theirs[n]), n
    # build_model casts the same way
    built = ls.build_model(our_config(DENSE_K), dtype=torch.bfloat16)
    for n, t in built.state_dict(keep_vars=True).items():
        assert t.dtype == (torch.float32 if n.endswith(FP32_SUFFIXES) else torch.bfloat16), n

    ids = random_ids(2, 40, seed=7)
    with torch.no_grad():
        got = ours16(ids)
        want = ours(ids)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_err(got.float(), want) <= 5e-2
    assert max_abs(got, want) > 0  # bf16 really in use
    # the prefix state follows the model dtype
    state = ls.capture(ours16, ids[0], ls.EngineConfig(prompt_chunk=16))
    assert all(t.dtype == torch.bfloat16 for layer in state.layers for t in layer.tensors())


# --- full-sequence parity --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dense", "sparse", "shared"])
def test_full_pass_logits(checkpoints, recorded_selections, name):
    hf, ours, _ = checkpoints[name]
    ids = random_ids(2, 60, seed=3)
    want = hf_logits(hf, ids)
    with torch.no_grad():
        got = ours(ids)
    if name == "dense":
        assert recorded_selections == []
    else:  # one selection per full-indexer layer, most queries drop positions
        assert len(recorded_selections) == (4 if name == "sparse" else 2)
        assert assert_clear_cut(recorded_selections, SPARSE_K) >= len(recorded_selections) * 2 * (60 - SPARSE_K)
    assert got.shape == want.shape == (2, 60, VOCAB)
    assert max_abs(got, want) <= 1e-4
    assert float(want.abs().max()) > 0.5  # O(1) logits: the tolerance means something
    if name != "dense":
        # the selection matters: the same weights with DSA keeping everything give other logits
        dense = checkpoints["dense"][0]
        assert max_abs(hf_logits(dense, ids), want) > 1e-2


def test_shared_layers_reuse_previous_selection(checkpoints, recorded_selections, monkeypatch):
    """A "shared" layer attends over what the previous full layer selected (as transformers), not over everything."""
    hf, ours, _ = checkpoints["shared"]
    ids = random_ids(1, 60, seed=4)
    with torch.no_grad():
        got = ours(ids)
    assert len(recorded_selections) == 2  # only layers 0 and 2 run an indexer
    assert_clear_cut(recorded_selections, SPARSE_K)
    want = hf_logits(hf, ids)
    assert max_abs(got, want) <= 1e-4
    # the comparison is sensitive to it: with the shared layers attending densely the logits move
    real = mla_module.MLAttention._select
    dense_when_shared = lambda self, *a, **kw: real(self, *a, **kw) if hasattr(self, "indexer") else None  # noqa: E731
    monkeypatch.setattr(mla_module.MLAttention, "_select", dense_when_shared)
    with torch.no_grad():
        assert max_abs(ours(ids), want) > 1e-3


VARIANTS = {
    "grouped_routing_unnormalised": dict(n_group=4, topk_group=2, norm_topk_prob=False),
    "yarn_mscale": dict(
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 256,
                         "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    ),
    "attention_bias_shared": dict(attention_bias=True, indexer_types=["full", "full", "shared", "shared"]),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_transformers(tmp_path, group, variant):
    """Group-limited routing without top-k normalisation, YaRN RoPE with mscale (which also scales the softmax),
    attention biases with two shared layers in a row: full pass and continuation, sparse DSA."""
    hf = hf_model(SPARSE_K, seed=1, **VARIANTS[variant])
    ours = ls.load_model(save(hf, tmp_path))
    assert ours.model.layers[0].self_attn.scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    ids = random_ids(2, 60, seed=3)
    with torch.no_grad():
        got = ours(ids)
    assert max_abs(got, hf_logits(hf, ids)) <= 1e-4
    prompt, responses = group
    got = ls.score(ours, ls.capture(ours, prompt, ls.EngineConfig(prompt_chunk=16)), responses,
                   engine=ls.EngineConfig(branch_batch=3))
    for g, w in zip(got, hf_continuation(hf, prompt, responses)):
        assert max_abs(g, w) <= 1e-4


def test_full_pass_logits_padding_free_batch_rows_independent(checkpoints):
    """Rows of a batch do not see each other (selection and attention are per row)."""
    _, ours, _ = checkpoints["sparse"]
    ids = random_ids(3, 45, seed=5)
    with torch.no_grad():
        batch = ours(ids)
        for i in range(3):
            assert max_abs(batch[i], ours(ids[i : i + 1])[0]) <= 1e-5


# --- continuation from the prefix state ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def continuations(checkpoints, group):
    prompt, responses = group
    return {name: hf_continuation(hf, prompt, responses) for name, (hf, _, _) in checkpoints.items()}


@pytest.mark.parametrize("name", ["dense", "sparse", "shared"])
@pytest.mark.parametrize("chunk,branch_batch", [(16, 1), (16, 3), (7, 2), (1000, 3)])
def test_continuation_logprobs(checkpoints, group, continuations, recorded_selections, name, chunk, branch_batch):
    _, ours, _ = checkpoints[name]
    prompt, responses = group
    state = ls.capture(ours, prompt, ls.EngineConfig(prompt_chunk=chunk))
    assert state.length == P - 1
    assert state.chunks[-1][1] == P - 1
    got = ls.score(ours, state, responses, engine=ls.EngineConfig(branch_batch=branch_batch))
    if name != "dense":
        assert assert_clear_cut(recorded_selections, SPARSE_K) > 0
    want = continuations[name]
    assert [tuple(g.shape) for g in got] == [(n,) for n in RESPONSE_LENGTHS]
    for g, w in zip(got, want):
        assert max_abs(g, w) <= 1e-4
    all_w = torch.cat(want)
    assert float(all_w.max()) <= 0 and float(all_w.std()) > 0.1


@pytest.mark.parametrize("name", ["sparse", "shared"])
def test_continuation_with_prefix_scored_in_small_blocks(checkpoints, group, continuations, monkeypatch, name):
    """The prefix's index scores stream through select_topk in blocks (KEY_BLOCK, 4096 by default): with blocks of
    5 tokens the running top-k is merged across many blocks, and the result is unchanged."""
    _, ours, _ = checkpoints[name]
    prompt, responses = group
    monkeypatch.setattr(sparse_module, "KEY_BLOCK", 5)
    got = ls.score(ours, ls.capture(ours, prompt, ls.EngineConfig(prompt_chunk=16)), responses,
                   engine=ls.EngineConfig(branch_batch=2))
    for g, w in zip(got, continuations[name]):
        assert max_abs(g, w) <= 1e-4


def test_sparse_continuation_depends_on_selection(continuations):
    for d, s in zip(continuations["dense"], continuations["sparse"]):
        if d.numel() > 3:
            assert max_abs(d, s) > 1e-3


# --- DSA tie-breaking at model level --------------------------------------------------------------------------------


def zero_indexers(model: torch.nn.Module) -> torch.nn.Module:
    """All index scores become 0 (w_h * relu(0)): every visible position ties."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for layer in model.model.layers:
            idx = getattr(layer.self_attn, "indexer", None)
            if idx is not None:
                idx.wq_b.weight.zero_()
                idx.weights_proj.weight.zero_()
    return model


@pytest.mark.parametrize("key_block", [4096, 4])
def test_all_tied_scores_select_lowest_positions(checkpoints, group, recorded_selections, monkeypatch, key_block):
    """With every index score equal, each query keeps the SPARSE_K lowest visible positions, in the full pass, in
    chunked capture (ties across prefix blocks and the chunk) and in the replay; logits equal transformers with an
    explicit mask that keeps exactly those positions (its DSA keeping everything)."""
    hf_dense, _, _ = checkpoints["dense"]
    ours = zero_indexers(checkpoints["sparse"][1])
    monkeypatch.setattr(sparse_module, "KEY_BLOCK", key_block)  # 4: ties across many prefix blocks
    prompt, responses = group

    ids = random_ids(1, 40, seed=6)
    with torch.no_grad():
        got = ours(ids)
    assert max_abs(got, hf_logits(hf_dense, ids, first_k_mask(40, SPARSE_K))) <= 1e-4
    assert max_abs(got, hf_logits(hf_dense, ids)) > 1e-2  # the mask matters

    recorded_selections.clear()
    state = ls.capture(ours, prompt, ls.EngineConfig(prompt_chunk=9))
    got = ls.score(ours, state, responses, engine=ls.EngineConfig(branch_batch=3))
    want = hf_continuation(hf_dense, prompt, responses, mask_k=SPARSE_K)
    for g, w in zip(got, want):
        assert max_abs(g, w) <= 1e-4
    assert len(recorded_selections) > 4
    assert all(float(scores[scores > float("-inf")].abs().max()) == 0 for _, scores, _ in recorded_selections)
    for start, _, (pos, valid) in recorded_selections:
        t = pos.shape[1]
        for j in range(t):
            visible = start + j + 1
            m = min(SPARSE_K, visible)
            assert valid[:, j].sum(-1).tolist() == [m] * pos.shape[0]
            for b in range(pos.shape[0]):
                assert pos[b, j][valid[b, j]].tolist() == list(range(m)), (start, j)


# --- per-expert checkpoint keys, MTP layers ---------------------------------------------------------------------------


def per_expert_checkpoint(src: Path, dst: Path, drop: str | None = None, extra: dict | None = None) -> Path:
    """Rewrite the fused experts as per-expert gate/up/down keys (gate = first half of gate_up's rows)."""
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for key, t in tensors.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            base = key[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif key.endswith("mlp.experts.down_proj"):
            base = key[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[key] = t
    if drop is not None:
        del out[drop]
    out.update(extra or {})
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_per_expert_keys_load_like_fused(checkpoints, tmp_path):
    _, ours, path = checkpoints["sparse"]
    n = HF_TINY["num_hidden_layers"]
    mtp = {  # a multi-token-prediction layer after the last decoder layer, as GLM-5 checkpoints carry
        f"model.layers.{n}.self_attn.q_a_proj.weight": torch.randn(32, 64),
        f"model.layers.{n}.eh_proj.weight": torch.randn(64, 128),
        f"model.layers.{n}.mlp.experts.0.gate_proj.weight": torch.randn(32, 64),
        f"model.layers.{n}.shared_head.norm.weight": torch.randn(64),
    }
    split = per_expert_checkpoint(path, tmp_path / "split", extra=mtp)
    keys = load_file(str(split / "model.safetensors")).keys()
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in keys
    assert not any(k.endswith("gate_up_proj") for k in keys)
    loaded = ls.load_model(split)
    for (na, a), (nb, b) in zip(loaded.named_parameters(), ours.named_parameters()):
        assert na == nb and torch.equal(a, b), na
    ids = random_ids(2, 30, seed=8)
    with torch.no_grad():
        assert torch.equal(loaded(ids), ours(ids))


def test_per_expert_keys_missing_one_projection(checkpoints, tmp_path):
    _, _, path = checkpoints["dense"]
    broken = per_expert_checkpoint(path, tmp_path / "broken", drop="model.layers.2.mlp.experts.5.up_proj.weight")
    with pytest.raises(ValueError, match="experts"):
        ls.load_model(broken)


# --- absorbed MLA == the expanded form ------------------------------------------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_interleaved(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... rotated by pos * theta^(-2i/d); output: rotated evens, then rotated odds.
    x: [B, T, d] or [B, T, H, d]."""
    d = x.shape[-1]
    ang = pos.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [T, d/2]
    if x.dim() == 4:
        ang = ang[:, None]
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def expanded_mla(attn, x: torch.Tensor, scale: float, theta: float, keep: torch.Tensor | None = None) -> torch.Tensor:
    """float64 MLA over positions 0..T-1, the textbook way: per-head K/V up-projected from the latent with
    kv_b_proj, the RoPE key shared by all heads, causal softmax (optionally also limited to `keep` [B, T, T])."""
    w = {n: p.detach().double() for n, p in attn.named_parameters()}
    x = x.double()
    b, t, _ = x.shape
    h, nope, rdim, vdim = attn.heads, attn.nope, attn.rope_dim, attn.v_dim
    pos = torch.arange(t)
    q = rms(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"]) @ w["q_b_proj.weight"].T
    q = q.view(b, t, h, nope + rdim)
    q = torch.cat([q[..., :nope], rope_interleaved(q[..., nope:], pos, theta)], dim=-1)
    ckv = x @ w["kv_a_proj_with_mqa.weight"].T
    c = rms(ckv[..., :RANK], w["kv_a_layernorm.weight"])
    k_rope = rope_interleaved(ckv[..., RANK:], pos, theta)  # [B, T, rope]
    kv = (c @ w["kv_b_proj.weight"].T).view(b, t, h, nope + vdim)
    k = torch.cat([kv[..., :nope], k_rope[:, :, None].expand(b, t, h, rdim)], dim=-1)
    v = kv[..., nope:]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None].expand(b, t, t)
    if keep is not None:
        mask = mask & keep
    s = s.masked_fill(~mask[:, None], float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v).reshape(b, t, h * vdim)
    return o @ w["o_proj.weight"].T


def keep_from(recorded, b: int, t: int) -> torch.Tensor:
    """[B, T, T] boolean: the positions each query attends to, from recorded (first own position, (pos, valid))."""
    keep = torch.zeros(b, t, t, dtype=torch.bool)
    for start, _, (pos, valid) in recorded:
        for j in range(pos.shape[1]):
            for i in range(b):
                keep[i, start + j, pos[i, j][valid[i, j]]] = True
    return keep


@pytest.mark.parametrize("name", ["dense", "sparse"])
@pytest.mark.parametrize("split", [0, 23])
def test_absorbed_mla_equals_expanded(checkpoints, recorded_selections, name, split):
    """One layer's self_attn on random inputs, without a prefix (split 0) and continuing from the latent state of
    the first `split` tokens, vs the expanded float64 computation over all tokens."""
    hf, ours, _ = checkpoints[name]
    attn = ours.model.layers[2].self_attn
    b, t = 2, 40
    x = torch.randn(b, t, HF_TINY["hidden_size"], generator=torch.Generator().manual_seed(9))
    scale = (HF_TINY["qk_nope_head_dim"] + ROPE) ** -0.5  # default RoPE: no YaRN mscale
    assert attn.scale == pytest.approx(scale)
    theta = hf.config.rope_parameters["rope_theta"]
    rot = ours.model.rotary_emb
    recorded_selections.clear()
    with torch.no_grad():
        if split == 0:
            got = attn(x, rot(0, t, x.dtype, x.device), Segment())
        else:
            seg = Segment(collect=True)
            first = attn(x[:, :split], rot(0, split, x.dtype, x.device), seg)
            own = seg.emitted[attn.layer_idx]
            assert own.kv.shape == (b, split, RANK + ROPE)
            # a prefix state is shared by all rows: continue each row from its own state, one at a time
            outs = []
            for i in range(b):
                prefix = [None] * len(ours.model.layers)
                prefix[attn.layer_idx] = LatentState(own.kv[i], own.index_k[i])
                seg_i = Segment(start=split, prefix=PrefixView(prefix, split))
                outs.append(attn(x[i : i + 1, split:], rot(split, t - split, x.dtype, x.device), seg_i))
            got = torch.cat([first, torch.cat(outs)], dim=1)
    if name == "sparse":
        # per-row calls record batch 1 selections; build the keep mask per row
        keep = torch.zeros(b, t, t, dtype=torch.bool)
        if split == 0:
            keep = keep_from(recorded_selections, b, t)
        else:
            assert len(recorded_selections) == 1 + b
            keep[:, :split, :split] = keep_from(recorded_selections[:1], b, split)
            for i, (start, scores, sel) in enumerate(recorded_selections[1:]):
                keep[i : i + 1, split:] = keep_from([(start - split, scores, sel)], 1, t)[:, : t - split]
        assert not keep.tril().all()  # really sparse
        # each query keeps SPARSE_K of its visible positions (or all of them)
        counts = keep.sum(-1)
        assert torch.equal(counts, torch.clamp(torch.arange(1, t + 1), max=SPARSE_K).expand(b, t))
    else:
        assert recorded_selections == []  # dense path: no selection at all
        keep = None
    want = expanded_mla(attn, x, scale, theta, keep)
    assert got.shape == want.shape == (b, t, HF_TINY["hidden_size"])
    assert float(want.abs().max()) > 0.1
    assert max_abs(got, want) <= 1e-5


# --- the prefix state ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sparse", "shared"])
def test_prefix_state_matches_transformers_cache(checkpoints, group, name):
    hf, ours, _ = checkpoints[name]
    prompt, responses = group
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(input_ids=prompt[None, :-1], cache=cache, use_cache=True)
    state = ls.capture(ours, prompt, ls.EngineConfig(prompt_chunk=16))
    types = list(hf.config.indexer_types)
    assert len(state.layers) == 4
    for i, (s, c) in enumerate(zip(state.layers, cache.layers)):
        assert isinstance(s, LatentState)
        assert s.kv.shape == (P - 1, RANK + ROPE) and s.kv.dtype == torch.float32
        # transformers caches the normalised latent as keys and the RoPE'd key as values
        assert c.keys.shape == (1, 1, P - 1, RANK) and c.values.shape == (1, 1, P - 1, ROPE)
        assert max_abs(s.kv[:, :RANK], c.keys[0, 0]) <= 1e-4, i
        assert max_abs(s.kv[:, RANK:], c.values[0, 0]) <= 1e-4, i
        if types[i] == "full":
            assert s.index_k.shape == (P - 1, HF_TINY["index_head_dim"])
            assert max_abs(s.index_k, c.indexer_keys[0]) <= 1e-4, i
            assert s.tensors() == (s.kv, s.index_k)
        else:
            assert s.index_k is None
            assert s.tensors() == (s.kv,)
    # the state is what the first layer computes from the embeddings directly (an independent check of layer 0)
    attn = ours.model.layers[0].self_attn
    with torch.no_grad():
        x = ours.model.layers[0].input_layernorm(ours.model.embed_tokens(prompt[:-1]))
        c = attn.kv_a_proj_with_mqa(x)[:, :RANK]
        c = rms(c.double(), attn.kv_a_layernorm.weight.double())
    assert max_abs(state.layers[0].kv[:, :RANK], c) <= 1e-5
    # the byte count the state-size tool predicts is the captured state's
    cfg = json.loads((checkpoints[name][2] / "config.json").read_text())
    assert state_size(cfg, P - 1, "fp32")["total_bytes"] == state.nbytes


def test_state_unchanged_by_score(checkpoints, group):
    _, ours, _ = checkpoints["sparse"]
    prompt, responses = group
    state = ls.capture(ours, prompt, ls.EngineConfig(prompt_chunk=16))
    snapshot = state_tensors(state)
    first = ls.score(ours, state, responses, engine=ls.EngineConfig(branch_batch=3))
    again = ls.score(ours, state, responses, engine=ls.EngineConfig(branch_batch=1))
    for a, b in zip(again, first):
        assert max_abs(a, b) <= 1e-5
    after = state_tensors(state)
    assert len(after) == len(snapshot) == 4 * 2
    assert all(torch.equal(a, b) for a, b in zip(snapshot, after))


def test_glm5_state_size_per_token():
    path = Path(__file__).resolve().parents[1] / "fixtures" / "reference-configs" / "glm5" / "config.json"
    cfg = json.loads(path.read_text())
    r = state_size(cfg, 200_000, "bf16")
    # 78 layers x (512 latent + 64 RoPE key + 128 indexer key) x 2 bytes
    assert r["bytes_per_token"] == 109_824
    assert r["fixed_bytes"] == 0
    assert r["layers"] == 78


# --- gradients: exact == naive ---------------------------------------------------------------------------------------

GRAD_KINDS = {  # DSA keeping everything; selecting 10 of up to 38 positions; the same with shared-indexer layers
    "dense": dict(index_topk=DENSE_K),
    "sparse": dict(index_topk=10),
    "shared": dict(index_topk=10, indexer_types=SHARED_TYPES),
}
G_LENGTHS = (5, 1, 9, 4)
ADV = [1.0, -0.5, 0.7, -1.2]
GRAD_P = 30


def grad_model(kind: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = ls.build_model(our_config(**GRAD_KINDS[kind]), dtype=dtype)
    return randomise(model, seed)


def grad_group(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (GRAD_P,), generator=g)
    return prompt, [torch.randint(0, VOCAB, (n,), generator=g) for n in G_LENGTHS]


def grad_of(model, mode, prompt, responses, **engine):
    model.zero_grad(set_to_none=True)
    stats = ls.grpo_backward(model, prompt, responses, ADV, mode=mode, engine=ls.EngineConfig(**engine))
    return flat_grad(model), stats


@pytest.fixture(scope="module")
def naive_grads():
    """The model and its naive gradient per (kind, dtype), computed once."""
    cache = {}

    def get(kind, dtype):
        if (kind, dtype) not in cache:
            model = grad_model(kind, dtype)
            cache[(kind, dtype)] = (model, grad_of(model, "naive", *grad_group()))
        return cache[(kind, dtype)]

    return get


@pytest.mark.parametrize("kind", list(GRAD_KINDS))
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_exact_equals_naive_fp32(naive_grads, kind, chunk):
    model, (g_naive, s_naive) = naive_grads(kind, torch.float32)
    g_exact, s_exact = grad_of(model, "exact", *grad_group(), prompt_chunk=chunk)
    assert rel_err(g_exact, g_naive) <= 1e-5
    assert s_exact["loss"] == pytest.approx(s_naive["loss"], abs=1e-6)
    assert s_exact["tokens"] == sum(G_LENGTHS)
    # the routed experts, the prompt-side attention and the router all get gradient
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert float(grads["model.layers.2.mlp.experts.gate_up_proj"].abs().max()) > 0
    assert float(grads["model.layers.1.mlp.gate.weight"].abs().max()) > 0
    assert float(grads["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].abs().max()) > 0


@pytest.mark.parametrize("kind", list(GRAD_KINDS))
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_exact_equals_naive_fp64(naive_grads, kind, chunk):
    model, (g_naive, _) = naive_grads(kind, torch.float64)
    g_exact, _ = grad_of(model, "exact", *grad_group(), prompt_chunk=chunk)
    assert rel_err(g_exact, g_naive) <= 1e-10


@pytest.mark.parametrize("kind", list(GRAD_KINDS))
def test_exact_zero_graph_budget_and_branch_batch(naive_grads, monkeypatch, kind):
    model, (g_naive, _) = naive_grads(kind, torch.float64)
    for budget in (0, 2 * 7 * activation_bytes_per_token(model)):
        g_exact, _ = grad_of(model, "exact", *grad_group(), prompt_chunk=7, prompt_graph_budget=budget, branch_batch=3)
        assert rel_err(g_exact, g_naive) <= 1e-10
    monkeypatch.setattr(sparse_module, "KEY_BLOCK", 3)  # prefix index scores streamed in blocks of 3
    g_exact, _ = grad_of(model, "exact", *grad_group(), prompt_chunk=5, prompt_graph_budget=0, branch_batch=2)
    assert rel_err(g_exact, g_naive) <= 1e-10


@pytest.mark.parametrize("kind", ["sparse", "shared"])
def test_gradient_group_has_clear_cut_selection(recorded_selections, kind):
    """The sparse gradient configurations drop positions, without near-ties that rounding could flip."""
    model = grad_model(kind, torch.float32)
    prompt, responses = grad_group()
    with torch.no_grad():
        for r in responses:
            model(torch.cat([prompt, r[:-1]])[None])
    assert assert_clear_cut(recorded_selections, GRAD_KINDS[kind]["index_topk"], min_gap=1e-5) > 0


def test_indexer_gets_no_gradient(naive_grads):
    """As in transformers, the selection is not differentiated: the indexer weights get no gradient at all."""
    model, _ = naive_grads("sparse", torch.float64)
    grad_of(model, "exact", *grad_group(), prompt_chunk=7)
    for n, p in model.named_parameters():
        if ".indexer." in n:
            assert p.grad is None or float(p.grad.abs().max()) == 0, n


@pytest.mark.parametrize("kind", list(GRAD_KINDS))
def test_detached_differs_from_naive(naive_grads, kind):
    model, (g_naive, _) = naive_grads(kind, torch.float64)
    g_det, _ = grad_of(model, "detached", *grad_group(), prompt_chunk=7)
    assert rel_err(g_det, g_naive) > 1e-3
