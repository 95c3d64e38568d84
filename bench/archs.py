"""The benchmark architectures: tiny models of each family, as transformers config.json dicts."""

from __future__ import annotations


def dense_config(max_pos: int) -> dict:
    """A tiny Qwen3-type dense model (HF config.json layout)."""
    return {
        "model_type": "qwen3",
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }


def qwen3_5_config(max_pos: int) -> dict:
    """A tiny Qwen3.5 hybrid (qwen3_5_text layout): 4 layers = 3 Gated DeltaNet + 1 gated full attention."""
    return {
        **dense_config(max_pos),
        "model_type": "qwen3_5_text",
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    }


def glm_moe_dsa_config(max_pos: int) -> dict:
    """A tiny GLM-5 (glm_moe_dsa): 4 layers of MLA + DSA indexer (top-256), 1 dense then 3 MoE layers."""
    return {
        "model_type": "glm_moe_dsa",
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "index_topk": 256,
        "index_head_dim": 32,
        "index_n_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-5,
    }


def dense_wide_config(max_pos: int) -> dict:
    """A wider dense model (4 layers, hidden 1024, ~60M parameters): weight products a real share of a step."""
    return {**dense_config(max_pos), "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
            "num_key_value_heads": 4, "head_dim": 64}


ARCHS = {"dense": dense_config, "dense-wide": dense_wide_config, "qwen3_5": qwen3_5_config,
         "glm_moe_dsa": glm_moe_dsa_config}
