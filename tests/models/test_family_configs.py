"""Family configs parsed from config.json: keys that set the shapes are required (a clear error names all that
are missing), optional ones keep transformers' defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longstraw.models import config_from_hf
from tests.conftest import GLM, tiny_config

REF = Path(__file__).resolve().parents[1] / "fixtures" / "reference-configs"


@pytest.mark.parametrize("family,cfg,drop", [
    ("qwen3", tiny_config("qwen3"), ["hidden_size"]),
    ("qwen3_5", tiny_config("qwen3_5_text"), ["linear_num_value_heads", "linear_key_head_dim"]),
    ("glm_moe_dsa", GLM, ["kv_lora_rank", "index_head_dim"]),
])
def test_missing_shape_keys_are_named(family, cfg, drop):
    bad = {k: v for k, v in cfg.items() if k not in drop}
    with pytest.raises(ValueError) as e:
        config_from_hf(bad)
    msg = str(e.value)
    assert all(k in msg for k in drop) and "no safe default" in msg


def test_multimodal_qwen3_5_reads_its_text_config():
    text = tiny_config("qwen3_5_text")
    outer = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True}
    c = config_from_hf(outer)
    assert c.linear_num_value_heads == text["linear_num_value_heads"] and c.tie_word_embeddings
    assert c.fingerprint == config_from_hf({**text, "tie_word_embeddings": True}).fingerprint


def test_reference_configs_parse():
    q = config_from_hf(json.loads((REF / "qwen3_5-27b" / "config.json").read_text()))
    g = config_from_hf(json.loads((REF / "glm5" / "config.json").read_text()))
    assert q.layer_types.count("full_attention") == 16 and q.linear_num_value_heads == 48
    assert g.num_hidden_layers == 78 and g.kv_lora_rank == 512
