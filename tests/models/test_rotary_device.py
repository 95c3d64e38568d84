"""RoPE's inverse frequencies go where the model goes (issue 36): `Rotary.inv_freq` is a non-persistent fp32
buffer, placed at build (the default device, meta included) and by every move (`.to`, `to_empty`, `.cuda`),
never lazily inside the forward (which made the first compiled call skip CUDA graphs and recompile); it stays out
of the state dict, so HF checkpoints load as they are. The reference values are transformers' own buffer and the
default RoPE formula written here."""

from __future__ import annotations

import pytest
import torch
import transformers

import longstraw as ls
from longstraw.models.registry import build
from tests.conftest import TINY, tiny_config

NAME = "model.rotary_emb.inv_freq"


def formula(theta: float = 10000.0, dim: int = TINY["head_dim"]) -> torch.Tensor:
    """Default RoPE: theta^(-2i/dim), i = 0 .. dim/2 - 1, in fp32."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


def inv_freq(model: torch.nn.Module) -> torch.Tensor:
    return dict(model.named_buffers())[NAME]


def test_a_buffer_outside_the_state_dict(tmp_path):
    """Our state dict has exactly transformers' keys (neither holds inv_freq), and an HF checkpoint loads with it
    computed: transformers' values, bit for bit."""
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY))
    hf.save_pretrained(tmp_path)
    ours = ls.load_model(tmp_path)
    assert NAME in dict(ours.named_buffers())
    assert not any("inv_freq" in k for k in ours.state_dict())
    assert set(ours.state_dict()) == set(hf.state_dict())  # (TINY unties the embeddings)
    assert inv_freq(ours).dtype == torch.float32
    assert torch.equal(inv_freq(ours), hf.model.rotary_emb.inv_freq)
    assert torch.allclose(inv_freq(ours), formula(hf.config.rope_parameters["rope_theta"]), rtol=1e-6, atol=0)


def test_built_on_meta_it_gets_its_values_where_the_model_lands():
    with torch.device("meta"):
        model = build(tiny_config())
    assert inv_freq(model).is_meta  # nothing on the host while the model has no storage
    model.to_empty(device="cpu")  # FSDP's shard_from_rank0 path
    assert inv_freq(model).device.type == "cpu" and torch.equal(inv_freq(model), formula())
    with torch.device("meta"):
        model = build(tiny_config())
    model.load_state_dict(ls.build_model(tiny_config()).state_dict(), assign=True)  # load_model's path
    model.to("cpu")
    assert torch.equal(inv_freq(model), formula())


def test_moves_carry_it_and_casts_keep_it_fp32():
    model = ls.build_model(tiny_config(), dtype=torch.bfloat16)
    assert inv_freq(model).dtype == torch.float32 and torch.equal(inv_freq(model), formula())
    model.to(torch.float16)
    assert inv_freq(model).dtype == torch.float32 and torch.equal(inv_freq(model), formula())
    model.to("meta")
    assert inv_freq(model).is_meta
    model.to_empty(device="cpu")
    assert torch.equal(inv_freq(model), formula())


def test_the_forward_does_not_move_it():
    """Asked for positions on a device the model is not on, the forward says so (it used to move inv_freq there
    inside the call); on the model's own device it computes them there."""
    model = ls.build_model(tiny_config())
    rotary = model.model.rotary_emb
    with pytest.raises(ValueError, match=r"inv_freq is on cpu but the positions are asked on meta: move the whole "):
        rotary(0, 5, torch.float32, torch.device("meta"))
    assert inv_freq(model).device.type == "cpu"
    model.to("meta")
    cos, sin = rotary(3, 5, torch.bfloat16, torch.device("meta"))
    assert cos.is_meta and cos.shape == (5, TINY["head_dim"]) and cos.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_before_any_call():
    model = ls.build_model(tiny_config(), device="cuda")
    assert inv_freq(model).device.type == "cuda"
    assert torch.equal(inv_freq(model).cpu(), formula())
    model.cpu()
    assert inv_freq(model).device.type == "cpu"
