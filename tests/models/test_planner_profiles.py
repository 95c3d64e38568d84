"""Every registered family declares a complete planner profile (models/planner.py), the planner reads it, and no
family's model_type is named in longstraw/tools/."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch

import longstraw as ls
from longstraw.models.common.attention import Attention
from longstraw.models.common.mla import MLAttention
from longstraw.models.planner import FamilyPlanner, HeadAttention, LatentSparseAttention
from longstraw.models.registry import FAMILIES, Family, build, config_from_hf, planner_profile
from longstraw.tools.activations import activation_profile
from longstraw.tools.plan import _attention_extras, _query_bytes
from tests.conftest import GLM, tiny_config

ROOT = Path(__file__).resolve().parents[2]
REF = ROOT / "tests" / "fixtures" / "reference-configs"

# a tiny config of every registered model_type: a family registered without one fails test_every_type_is_covered
TINY = {
    "llama": tiny_config("llama"),
    "qwen2": tiny_config("qwen2"),
    "qwen3": tiny_config("qwen3"),
    "qwen3_5_text": tiny_config("qwen3_5_text"),
    "qwen3_5": {"model_type": "qwen3_5", "text_config": tiny_config("qwen3_5_text")},
    "glm_moe_dsa": dict(GLM),
}


def test_every_type_is_covered():
    assert set(TINY) == set(ls.SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", list(TINY))
def test_every_family_has_a_complete_profile(model_type):
    hf = TINY[model_type]
    profile = planner_profile(model_type)
    assert isinstance(profile, FamilyPlanner)
    cfg = config_from_hf(hf)
    kinds = profile.layer_kinds(cfg)
    assert len(kinds) == cfg.num_hidden_layers and all(isinstance(k, str) and k for k in kinds)
    for kind in dict.fromkeys(kinds):
        proxy = config_from_hf(profile.proxy_config(hf, kind, 2))
        assert proxy.num_hidden_layers == 2 and profile.layer_kinds(proxy) == (kind, kind)
        assert proxy.hidden_size == cfg.hidden_size
    # the declared geometry is the one the built model's attention layers have
    geometry = profile.attention(cfg)
    with torch.device("meta"):
        model = build(hf)
    mixers = [m for m in model.modules() if isinstance(m, (Attention, MLAttention))]
    assert mixers
    for m in mixers:
        if isinstance(geometry, HeadAttention):
            assert isinstance(m, Attention) and (m.heads, m.head_dim) == (geometry.heads, geometry.head_dim)
        else:
            assert isinstance(geometry, LatentSparseAttention) and isinstance(m, MLAttention)
            assert (m.heads, m.rank, m.rope_dim, m.index_topk) == \
                (geometry.heads, geometry.latent_dim, geometry.rope_dim, geometry.top_k)
    for m in model.modules():
        if hasattr(m, "indexer") and m.indexer is not None:
            assert (m.indexer.heads, m.indexer.head_dim) == (geometry.index_heads, geometry.index_head_dim)


def test_moe_proxies_keep_the_experts_a_token_uses():
    profile = planner_profile("glm_moe_dsa")
    proxy = config_from_hf(profile.proxy_config(GLM, "sparse", 1))
    assert proxy.n_routed_experts == GLM["num_experts_per_tok"] < GLM["n_routed_experts"]


def test_multimodal_qwen3_5_proxies_are_its_text_model():
    proxy = planner_profile("qwen3_5").proxy_config(TINY["qwen3_5"], "full_attention", 1)
    assert proxy["model_type"] == "qwen3_5_text" and "text_config" not in proxy
    assert proxy["linear_num_value_heads"] == TINY["qwen3_5_text"]["linear_num_value_heads"]


def test_a_family_without_a_profile_is_refused_by_name(monkeypatch):
    dense = FAMILIES["qwen3"]
    monkeypatch.setitem(FAMILIES, "toy", Family(dense.config, dense.model, None))
    with pytest.raises(ValueError, match=r"DenseConfig family \(model_type 'toy'\) declares no planner profile.*"
                                         r"FamilyPlanner"):
        planner_profile("toy")
    with pytest.raises(ValueError, match="declares no planner profile"):  # the planner asks before measuring
        activation_profile({**tiny_config("qwen3"), "model_type": "toy"})
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        planner_profile("gpt2")


def test_an_unknown_attention_geometry_is_refused():
    with pytest.raises(ValueError, match="attention geometry object has no byte count"):
        _query_bytes(object(), 2, 4)


@pytest.mark.parametrize("ranks", [1, 32])
def test_reference_attention_bytes_from_config_json(ranks):
    """The planner's attention terms for the reference configs, from the config.json keys (not the profile)."""
    glm = json.loads((REF / "glm5" / "config.json").read_text())
    qwen = json.loads((REF / "qwen3_5-27b" / "config.json").read_text())
    with torch.device("meta"):
        g = _attention_extras(build(glm), 1000, 2, ranks)
        q = _attention_extras(build(qwen), 1000, 2, ranks)
    heads, row = glm["num_attention_heads"], glm["kv_lora_rank"] + glm["qk_rope_head_dim"]
    assert g["query"] == heads * row * 2 + glm["index_n_heads"] * glm["index_head_dim"] * 2
    assert g["candidates"] == glm["index_topk"] * 12
    assert g["query_backward"] == heads * glm["kv_lora_rank"] * 2 and g["own_query_backward"] == 3 * heads * row * 4
    q_row = qwen["num_attention_heads"] * qwen["head_dim"] * 2
    assert q["query"] == (q_row if ranks > 1 else 0) and q["candidates"] == q["own_query_backward"] == 0
    assert q["query_backward"] == q_row * (7 if ranks > 1 else 5)


def model_type_strings(source: str, model_types: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, string) of each string constant in `source` that names one of `model_types` as a word."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if set(re.findall(r"\w+", node.value)) & set(model_types):
                found.append((node.lineno, node.value))
    return found


def test_the_tools_name_no_model_type():
    tools = sorted((ROOT / "longstraw" / "tools").rglob("*.py"))
    assert len(tools) > 4
    found = [f"{p.relative_to(ROOT)}:{line}: {text!r}" for p in tools
             for line, text in model_type_strings(p.read_text(), ls.SUPPORTED_MODEL_TYPES)]
    assert not found, "the tools branch on a family; declare it in the family's planner profile " \
                      "(models/planner.py) instead:\n" + "\n".join(found)


def test_the_model_type_scan_finds_one():
    src = 'def f(cfg):\n    """Plans."""\n    return cfg.model_type == "glm_moe_dsa" or "qwen3" in cfg.name\n'
    assert model_type_strings(src, ls.SUPPORTED_MODEL_TYPES) == [(3, "glm_moe_dsa"), (3, "qwen3")]
