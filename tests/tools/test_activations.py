"""The planner's activation profile: proxies of one and two layers per kind predict what a whole model's chunk
saves for autograd (CPU path), with and without per-layer checkpointing; on the GPU path the gated delta rule
counts what flash-linear-attention's chunk kernel saves instead of the torch form's matrices."""

import pytest
import torch

import longstraw as ls
from longstraw.engine import activation_bytes_per_token
from longstraw.tools.activations import activation_profile, fla_saved_bytes
from tests.conftest import GLM, tiny_config
from tests.engine.test_checkpoint_layers import _chunk_saved_bytes


def _config(arch: str) -> dict:
    return dict(GLM) if arch == "glm_moe_dsa" else tiny_config(arch)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text", "glm_moe_dsa"])
def test_profile_predicts_the_whole_model(arch):
    """The CPU profile (fp32) against the whole model's measured bytes per token, and against a checkpointed
    chunk's saved bytes."""
    cfg = _config(arch)
    profile = activation_profile(cfg, gpu=False, dtype=torch.float32)
    torch.manual_seed(0)
    model = ls.build_model(cfg, dtype=torch.float32)
    whole = activation_bytes_per_token(model)
    assert profile.whole == pytest.approx(whole, rel=0.05)
    tokens = 64
    kept = _chunk_saved_bytes(model, True, tokens)  # layer inputs only: the recomputed layer comes in the backward
    assert kept == pytest.approx(profile.layers * profile.hidden_bytes * tokens, rel=0.05)
    assert profile.per_token(True) * tokens >= kept


def test_gpu_profile_counts_the_delta_rule_kernel():
    """The linear layers' GPU bytes: the CPU measure less the torch form's tensors plus the kernel's."""
    cfg = tiny_config("qwen3_5_text")
    cpu = {k.name: k.bytes_per_token for k in activation_profile(cfg, gpu=False).kinds}
    gpu = {k.name: k.bytes_per_token for k in activation_profile(cfg, gpu=True).kinds}
    assert gpu["full_attention"] == cpu["full_attention"]  # flash-style attention saves the same on both
    assert gpu["linear_attention"] < cpu["linear_attention"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    assert hv > hk  # grouped value heads: q and k are saved at the key heads, not repeated to the value heads
    kernel = fla_saved_bytes(torch.empty(1, 1, hk, dk), torch.empty(1, 1, hk, dk), torch.empty(1, 1, hv, dv))
    # per key head q, k bf16 and their 2 fp32 norm factors; per value head v bf16, the fp32 gate, beta bf16, A bf16
    assert kernel == hk * (2 * 2 * dk + 2 * 4) + hv * (2 * dv + 4 + 2 + 2 * 64)
    assert gpu["linear_attention"] >= kernel
