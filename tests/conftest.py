"""Shared helpers: tiny random HF-style configs and checkpoints saved with transformers' save_pretrained."""

from __future__ import annotations

import pytest
import torch

import longstraw as ls

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


# Qwen3.5 hybrid: 8 layers = 2 x (3 Gated DeltaNet + 1 gated full attention), grouped linear heads
TINY_QWEN3_5 = dict(
    TINY,
    num_hidden_layers=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


# GLM-5 shape: MLA + DSA indexer (top-20, so prompts of a few dozen tokens run the sparse path) + MoE
GLM = dict(
    model_type="glm_moe_dsa", vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=12, index_topk=20, index_head_dim=16, index_n_heads=8, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=1024,
    routed_scaling_factor=2.5,
)


def tiny_config(model_type: str = "qwen3", **overrides) -> dict:
    """A tiny config dict in transformers' config.json layout."""
    base = TINY_QWEN3_5 if model_type.startswith("qwen3_5") else TINY
    return {"model_type": model_type, **base, **overrides}


def tiny_model(model_type: str = "qwen3", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return ls.build_model(tiny_config(model_type, **overrides), dtype=dtype)


def with_adapters(model: torch.nn.Module, targets: tuple[str, ...] = ("o_proj", "down_proj")) -> torch.nn.Module:
    """`model` with rank-4 LoRA adapters on `targets`, their B initialised non-zero (PEFT starts B at zero) so
    that every adapter has a gradient path."""
    torch.manual_seed(1)
    ls.add_lora(model, r=4, target_modules=list(targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros_like(p).flatten() for p in model.parameters()])


def assert_same_parameters(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """Same parameter names, shapes and order as the transformers model, and the same values."""
    got = [(n, tuple(p.shape)) for n, p in ours.named_parameters()]
    want = [(n, tuple(p.shape)) for n, p in theirs.named_parameters()]
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    assert got == want  # same order too, so optimizer state saved by position carries over
    named = dict(theirs.named_parameters())
    for n, p in ours.named_parameters():
        assert torch.equal(p.detach().float(), named[n].detach().float()), n


def state_tensors(state: ls.PrefixState) -> list[torch.Tensor]:
    """Copies of every layer's tensors of a prefix state, in layer order (to compare states, or one state before
    and after something that must not write into it)."""
    return [t.clone() for layer in state.layers for t in layer.tensors()]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny tensors gain nothing from threads, and OpenMP spin-waits make a loaded machine 10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(1234)
    yield


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--each-value-once", action="store_true",
                     help="of a parametrized test, run only the cases that cover each parameter value once (what "
                          "`make test` runs on the oldest torch: every test and every value, not every product)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With --each-value-once, run of each parametrized test a few cases that between them hold every
    (parameter, value) pair it has, chosen greedily (the case bringing the most new pairs first); the rest are
    deselected. The full products run on the newest torch."""
    if not config.getoption("--each-value-once"):
        return
    cases: dict[str, list[tuple[pytest.Item, set]]] = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is not None:
            pairs = {(name, repr(value)) for name, value in spec.params.items()}
            cases.setdefault(item.nodeid.split("[")[0], []).append((item, pairs))
    drop = set()
    for group in cases.values():
        missing = set().union(*(pairs for _, pairs in group))
        chosen = set()
        while missing:
            item, pairs = max(group, key=lambda case: len(case[1] & missing))
            chosen.add(item)
            missing -= pairs
        drop |= {item for item, _ in group if item not in chosen}
    if drop:
        config.hook.pytest_deselected(items=[item for item in items if item in drop])
        items[:] = [item for item in items if item not in drop]
