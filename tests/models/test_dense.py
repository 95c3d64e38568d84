"""Parity of the dense families (llama, qwen2, qwen3) with transformers' own implementations.

Each test builds a tiny random transformers *ForCausalLM, randomises every parameter (biases and norm weights
included, so that a misplaced bias or norm would show), saves it with save_pretrained, loads it with
longstraw.load_model and compares parameter names/shapes and logits.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import longstraw as ls
from tests.conftest import TINY, assert_same_parameters, rel_err

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}

HF_TINY = TINY  # the shared tiny shape, as transformers config kwargs


def hf_model(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny transformers model (eager attention, fp32, eval) with every parameter random and O(1)-sized."""
    config_cls, model_cls = FAMILIES[model_type]
    cfg = config_cls(**{**HF_TINY, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def save(model: torch.nn.Module, path) -> None:
    model.save_pretrained(path)
    assert list(path.glob("*.safetensors")), "transformers did not write safetensors"


def random_ids(batch: int = 2, seq: int = 37, vocab: int = 97, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


@torch.no_grad()
def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def check_parity(hf, path, seq: int = 37, tol: float = 1e-4) -> torch.nn.Module:
    save(hf, path)
    ours = ls.load_model(path)
    assert_same_parameters(ours, hf)
    ids = random_ids(2, seq, hf.config.vocab_size)
    want = hf_logits(hf, ids)
    got = our_logits(ours, ids)
    assert got.shape == want.shape == (2, seq, hf.config.vocab_size)
    assert max_abs(got, want) <= tol
    # the comparison is meaningful: logits are O(1) and differ between positions
    assert float(want.abs().max()) > 0.1
    return ours


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_parity(model_type, tmp_path):
    check_parity(hf_model(model_type), tmp_path)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_tied_embeddings(model_type, tmp_path):
    hf = hf_model(model_type, tie_word_embeddings=True)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    ours = check_parity(hf, tmp_path)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(ours.named_parameters())
    # the head really reads the (loaded) embedding
    assert torch.equal(ours.lm_head.weight, hf.model.embed_tokens.weight)


def test_tied_embeddings_with_lm_head_in_checkpoint(tmp_path):
    """Some checkpoints of tied models also store lm_head.weight; it is the same tensor and must load."""
    from safetensors.torch import load_file, save_file

    hf = hf_model("qwen3", tie_word_embeddings=True)
    save(hf, tmp_path)
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(f), metadata={"format": "pt"})
    ours = ls.load_model(tmp_path)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = random_ids()
    assert max_abs(our_logits(ours, ids), hf_logits(hf, ids)) <= 1e-4


def test_llama_attention_and_mlp_bias(tmp_path):
    hf = hf_model("llama", attention_bias=True, mlp_bias=True)
    names = dict(hf.named_parameters())
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"model.layers.0.self_attn.{n}.bias" in names
    for n in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.0.mlp.{n}.bias" in names
    check_parity(hf, tmp_path)


def test_qwen3_attention_bias(tmp_path):
    hf = hf_model("qwen3", attention_bias=True)
    names = dict(hf.named_parameters())
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"model.layers.0.self_attn.{n}.bias" in names
    check_parity(hf, tmp_path)


def test_qwen2_has_qkv_bias_but_no_o_bias(tmp_path):
    hf = hf_model("qwen2")
    ours = check_parity(hf, tmp_path)
    names = dict(ours.named_parameters())
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names


ROPES = {
    "llama3": (
        dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
        512,
    ),
    "linear": (dict(rope_type="linear", factor=2.0), 512),
    # max_position_embeddings / original = factor, as transformers expects for yarn
    "yarn": (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64), 256),
}


@pytest.mark.parametrize(
    "model_type,rope", [("llama", "llama3"), ("llama", "linear"), ("llama", "yarn"), ("qwen3", "yarn")]
)
def test_rope_variants(model_type, rope, tmp_path):
    params, max_pos = ROPES[rope]
    seq = 200
    hf = hf_model(
        model_type, rope_parameters={"rope_theta": 10000.0, **params}, max_position_embeddings=max_pos
    )
    cfg = json.loads(hf.config.to_json_string())
    assert cfg["rope_parameters"]["rope_type"] == rope
    check_parity(hf, tmp_path, seq=seq)
    # the scaling matters at these positions: the same weights with default RoPE give other logits
    plain = hf_model(model_type, max_position_embeddings=max_pos)
    plain.load_state_dict(hf.state_dict())
    ids = random_ids(2, seq, hf.config.vocab_size)
    assert max_abs(hf_logits(plain, ids), hf_logits(hf, ids)) > 1e-2


OLD_FORMAT_ROPES = {
    "linear": {"type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    # transformers falls back to max_position_embeddings when original_max_position_embeddings is absent
    "yarn-no-original": {"type": "yarn", "factor": 4.0},
}


@pytest.mark.parametrize("rope", list(OLD_FORMAT_ROPES))
def test_old_format_rope_scaling(rope, tmp_path):
    """Pre-v5 config.json layout: top-level rope_theta plus rope_scaling (as many hub checkpoints still have).

    The reference is transformers reading the very same directory with from_pretrained."""
    seq, max_pos = 200, 256
    hf = hf_model("llama", max_position_embeddings=max_pos)
    save(hf, tmp_path)
    cfg_file = tmp_path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = 50000.0
    cfg["rope_scaling"] = OLD_FORMAT_ROPES[rope]
    cfg_file.write_text(json.dumps(cfg))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert ref.config.rope_parameters["rope_theta"] == 50000.0
    assert ref.config.rope_parameters["rope_type"] == rope.split("-")[0]
    ours = ls.load_model(tmp_path)
    ids = random_ids(2, seq, 97)
    want = hf_logits(ref, ids)
    assert max_abs(our_logits(ours, ids), want) <= 1e-4
    # the scaled RoPE is in effect
    assert max_abs(hf_logits(hf, ids), want) > 1e-2


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_load_bfloat16(model_type, tmp_path):
    hf = hf_model(model_type)
    save(hf, tmp_path)
    ours = ls.load_model(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ids = random_ids()
    got = our_logits(ours, ids)
    assert got.dtype == torch.bfloat16
    want = hf_logits(hf, ids)
    assert torch.isfinite(got).all()
    assert rel_err(got.float(), want) <= 5e-2
    # bf16 is really used (the logits are not bit-identical to fp32 ones)
    assert max_abs(got, want) > 0


def test_unknown_model_type(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=97).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as e:
        ls.load_model(tmp_path)
    msg = str(e.value)
    assert "gpt2" in msg
    for t in ("llama", "qwen2", "qwen3", "qwen3_5", "glm_moe_dsa"):
        assert t in msg
    assert set(ls.SUPPORTED_MODEL_TYPES) == {"llama", "qwen2", "qwen3", "qwen3_5", "qwen3_5_text", "glm_moe_dsa"}


def test_unsupported_rope_type(tmp_path):
    cfg = transformers.LlamaConfig(**HF_TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    cfg.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] == "dynamic"
    with pytest.raises(ValueError, match="dynamic"):
        ls.load_model(tmp_path)
    with pytest.raises(ValueError, match="dynamic"):
        ls.build_model(json.loads((tmp_path / "config.json").read_text()))


def test_sliding_window_rejected(tmp_path):
    hf = hf_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert "sliding_attention" in hf.config.layer_types
    save(hf, tmp_path)
    with pytest.raises(ValueError, match="sliding"):
        ls.load_model(tmp_path)


def test_build_model_matches_loaded_architecture(tmp_path):
    """build_model from the same config.json gives the same parameter names/shapes as transformers."""
    hf = hf_model("qwen3")
    save(hf, tmp_path)
    built = ls.build_model(json.loads((tmp_path / "config.json").read_text()))
    got = [(n, tuple(p.shape)) for n, p in built.named_parameters()]
    assert got == [(n, tuple(p.shape)) for n, p in hf.named_parameters()]
