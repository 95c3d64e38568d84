"""The three modes: exact == naive (fp32 <= 1e-5, fp64 <= 1e-10); detached == the prompt-detached gradient.

References are independent of the code under test: naive is itself checked against the GRPO loss computed with
transformers' model on full prompt+response forwards, and detached against transformers continuing from a
DynamicCache built without autograd.
"""

import copy

import pytest
import torch

import longstraw as ls
from longstraw.engine import activation_bytes_per_token
from longstraw.grpo import token_weights
from tests.conftest import GLM, flat_grad, rel_err, tiny_model, with_adapters

G_LENGTHS = (5, 1, 9, 4)
ADV = [1.0, -0.5, 0.7, -1.2]


def group(prompt_len=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (prompt_len,), generator=g)
    return prompt, [torch.randint(0, 97, (n,), generator=g) for n in G_LENGTHS]


def grad_of(model, mode, prompt, responses, adv=ADV, **kw):
    model.zero_grad(set_to_none=True)
    stats = ls.grpo_backward(model, prompt, responses, adv, mode=mode, **kw)
    return flat_grad(model), stats


ARCHS = ["qwen3", "llama", "qwen2", "qwen3_5_text"]


@pytest.mark.parametrize("model_type", ARCHS)
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_exact_equals_naive_fp32(model_type, chunk):
    model = tiny_model(model_type)
    prompt, responses = group()
    g_naive, s_naive = grad_of(model, "naive", prompt, responses)
    g_exact, s_exact = grad_of(model, "exact", prompt, responses, engine=ls.EngineConfig(prompt_chunk=chunk))
    assert rel_err(g_exact, g_naive) <= 1e-5
    assert s_exact["loss"] == pytest.approx(s_naive["loss"], abs=1e-6)
    assert s_exact["tokens"] == sum(G_LENGTHS)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_exact_equals_naive_fp64(model_type, chunk):
    model = tiny_model(model_type, dtype=torch.float64)
    prompt, responses = group()
    g_naive, _ = grad_of(model, "naive", prompt, responses)
    g_exact, _ = grad_of(model, "exact", prompt, responses, engine=ls.EngineConfig(prompt_chunk=chunk))
    assert rel_err(g_exact, g_naive) <= 1e-10


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("budget", ["zero", "partial", "whole"])
@pytest.mark.parametrize("branch_batch", [1, 3])
def test_graph_budget_and_branch_batch_keep_gradient(model_type, budget, branch_batch):
    model = tiny_model(model_type, dtype=torch.float64)
    prompt, responses = group(prompt_len=50)
    per_chunk = 7 * activation_bytes_per_token(model)
    bytes_ = {"zero": 0, "partial": 3 * per_chunk, "whole": 10**12}[budget]
    cfg = ls.EngineConfig(prompt_chunk=7, prompt_graph_budget=bytes_, branch_batch=branch_batch)
    g_naive, _ = grad_of(model, "naive", prompt, responses)
    g_exact, _ = grad_of(model, "exact", prompt, responses, engine=cfg)
    assert rel_err(g_exact, g_naive) <= 1e-10


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text", "glm_moe_dsa"])
@pytest.mark.parametrize("budget", ["zero", "partial"])
@pytest.mark.parametrize("lora", [False, True])
def test_layer_major_prompt_backward_keeps_gradient(model_type, budget, lora):
    """prompt_order 'layers' (each layer over every chunk, from checkpoints of every k-th layer's inputs), alone
    or after the chunks whose graphs capture kept: naive's gradient, adapters included."""
    if model_type == "glm_moe_dsa":
        torch.manual_seed(0)
        model = ls.build_model(GLM, dtype=torch.float64)
    else:
        model = tiny_model(model_type, dtype=torch.float64)
    if lora:
        with_adapters(model)
    prompt, responses = group(prompt_len=50)
    per_chunk = 7 * activation_bytes_per_token(model)
    cfg = ls.EngineConfig(prompt_chunk=7, prompt_order="layers",
                          prompt_graph_budget={"zero": 0, "partial": 3 * per_chunk}[budget])
    g_naive, _ = grad_of(model, "naive", prompt, responses)
    g_exact, _ = grad_of(model, "exact", prompt, responses, engine=cfg)
    assert rel_err(g_exact, g_naive) <= 1e-10


def test_layer_major_order_refuses_shared_dsa_selection():
    model = ls.build_model({**GLM, "indexer_types": ["full", "shared", "full", "shared"]}, dtype=torch.float64)
    prompt, responses = group()
    with pytest.raises(ValueError, match="prompt_order 'chunks' or 'auto'"):
        grad_of(model, "exact", prompt, responses, engine=ls.EngineConfig(prompt_chunk=7, prompt_order="layers"))
    g_naive, _ = grad_of(model, "naive", prompt, responses)
    g_auto, _ = grad_of(model, "exact", prompt, responses, engine=ls.EngineConfig(prompt_chunk=7))
    assert rel_err(g_auto, g_naive) <= 1e-10


@pytest.mark.parametrize("every", [2, 3, 100])
@pytest.mark.parametrize("budget", ["zero", "partial"])
def test_sparse_boundaries_keep_gradient(every, budget):
    """Recurrent states kept only at every n-th chunk start, the rest regenerated during the prompt backward."""
    model = tiny_model("qwen3_5_text", dtype=torch.float64)
    prompt, responses = group(prompt_len=60)
    bytes_ = {"zero": 0, "partial": 2 * 7 * activation_bytes_per_token(model)}[budget]
    cfg = ls.EngineConfig(prompt_chunk=7, prompt_graph_budget=bytes_, boundary_every=every)
    g_naive, _ = grad_of(model, "naive", prompt, responses)
    g_exact, _ = grad_of(model, "exact", prompt, responses, engine=cfg)
    assert rel_err(g_exact, g_naive) <= 1e-10


def test_boundary_interval():
    from longstraw.engine.policy import boundary_interval

    assert boundary_interval(None, 100, 10, 8000) == 1  # every boundary fits an eighth of the free memory
    assert boundary_interval(None, 100, 10, 7999) == 10
    assert boundary_interval(None, 101, 10, 7999) == 11
    assert boundary_interval(None, 1026, 154_000_000, 8 * 10**10) == 33
    assert boundary_interval(4, 1026, 154_000_000, 8 * 10**10) == 4


def test_kept_chunk_count_follows_budget():
    from longstraw.engine.budget import kept_chunk_count

    model = tiny_model()
    chunks = [7, 7, 7, 3]
    per = activation_bytes_per_token(model)
    measured = lambda: activation_bytes_per_token(model)  # noqa: E731
    assert kept_chunk_count(chunks, 0, lambda: pytest.fail("no budget: nothing to measure")) == 0
    assert kept_chunk_count(chunks, 3 * per, measured) == 1
    assert kept_chunk_count(chunks, 10 * per, measured) == 2
    assert kept_chunk_count(chunks, 10**12, measured) == 4


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_detached_differs_from_naive_and_drops_only_the_prompt_path(model_type):
    model = tiny_model(model_type, dtype=torch.float64)
    prompt, responses = group()
    g_naive, _ = grad_of(model, "naive", prompt, responses)
    g_det, _ = grad_of(model, "detached", prompt, responses, engine=ls.EngineConfig(prompt_chunk=7))
    assert rel_err(g_det, g_naive) > 1e-3
    # the same gradient from transformers, continuing each branch from a cache built without autograd
    # (fp32 bound: transformers computes norms and RoPE in fp32 even for fp64 weights)
    hf = hf_twin(model)
    ref = hf_detached_grad(hf, model, prompt, responses, ADV)
    assert rel_err(g_det, ref) <= 1e-5


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_off_policy_with_clipping_exact_equals_naive(model_type):
    model = tiny_model(model_type, dtype=torch.float64)
    prompt, responses = group()
    state = ls.capture(model, prompt)
    cur = ls.score(model, state, responses)
    old = [c + 0.4 * torch.randn_like(c) for c in cur]  # ratios well outside [0.8, 1.2] for some tokens
    cfg = ls.EngineConfig(prompt_chunk=7)
    g_naive, s_naive = grad_of(model, "naive", prompt, responses, old_logprobs=old, engine=cfg)
    g_exact, s_exact = grad_of(model, "exact", prompt, responses, old_logprobs=old, engine=cfg)
    assert 0.0 < s_exact["clip_frac"] < 1.0
    assert s_exact["clip_frac"] == s_naive["clip_frac"]
    assert rel_err(g_exact, g_naive) <= 1e-10


def test_kl_term_exact_equals_naive():
    model = tiny_model(dtype=torch.float64)
    prompt, responses = group()
    ref_model = tiny_model(dtype=torch.float64, seed=7)
    ref = ls.score(ref_model, ls.capture(ref_model, prompt), responses)
    cfg = dict(config=ls.GRPOConfig(kl_coef=0.3), engine=ls.EngineConfig(prompt_chunk=7))
    g_naive, s_naive = grad_of(model, "naive", prompt, responses, ref_logprobs=ref, **cfg)
    g_exact, s_exact = grad_of(model, "exact", prompt, responses, ref_logprobs=ref, **cfg)
    g_nokl, _ = grad_of(model, "exact", prompt, responses, engine=ls.EngineConfig(prompt_chunk=7))
    assert s_exact["kl"] > 0 and s_exact["kl"] == pytest.approx(s_naive["kl"], rel=1e-10)
    assert rel_err(g_exact, g_naive) <= 1e-10
    assert rel_err(g_exact, g_nokl) > 1e-3


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_naive_matches_transformers_loss(loss_type):
    """Our naive mode == autograd of the GRPO loss written out directly on transformers' model."""
    model = tiny_model(dtype=torch.float64)
    prompt, responses = group()
    state = ls.capture(model, prompt)
    old = [c + 0.3 * torch.randn_like(c) for c in ls.score(model, state, responses)]
    cfg = ls.GRPOConfig(loss_type=loss_type, clip_low=0.1, clip_high=0.3)
    g_naive, stats = grad_of(model, "naive", prompt, responses, old_logprobs=old, config=cfg)
    g_exact, _ = grad_of(model, "exact", prompt, responses, old_logprobs=old, config=cfg)
    hf = hf_twin(model)
    hf.zero_grad()
    lengths = [r.numel() for r in responses]
    if loss_type == "grpo":
        w = [1 / (len(lengths) * n) for n in lengths]
    elif loss_type == "dapo":
        w = [1 / sum(lengths)] * len(lengths)
    else:
        w = [1 / (len(lengths) * max(lengths))] * len(lengths)
    total = 0.0
    for r, a, o, wi in zip(responses, ADV, old, w):
        logits = hf(torch.cat([prompt, r])[None]).logits[0, prompt.numel() - 1 : -1]
        lp = torch.log_softmax(logits, -1).gather(-1, r[:, None])[:, 0]
        ratio = torch.exp(lp - o)
        obj = torch.minimum(ratio * a, torch.clamp(ratio, 0.9, 1.3) * a)
        total = total - (obj * wi).sum()
    total.backward()
    ref = hf_flat_grad(hf, model)
    # fp32-level bounds: transformers computes norms and RoPE in fp32 even for fp64 weights
    assert stats["loss"] == pytest.approx(total.item(), rel=1e-5)
    assert rel_err(g_naive, ref) <= 1e-5
    assert rel_err(g_exact, g_naive) <= 1e-10
    assert w == pytest.approx(token_weights(lengths, cfg))


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_bf16_step_matches_naive_loosely(model_type):
    model = tiny_model(model_type, dtype=torch.bfloat16)
    prompt, responses = group(prompt_len=64)
    g_naive, _ = grad_of(model, "naive", prompt, responses)
    g_exact, stats = grad_of(model, "exact", prompt, responses, engine=ls.EngineConfig(prompt_chunk=16))
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.isfinite(g_exact).all()
    assert rel_err(g_exact.float(), g_naive.float()) <= 3e-2
    kv = 63 * 2 * 2 * 16 * 2  # tokens x (K,V) x kv_heads x head_dim x bf16
    if model_type == "qwen3":
        assert stats["state_bytes"] == kv * 3
    else:  # 2 attention layers + 6 linear layers of conv tail (bf16) and delta-rule state (fp32)
        conv_dim = 2 * 2 * 8 + 4 * 8
        assert stats["state_bytes"] == kv * 2 + 6 * (conv_dim * 3 * 2 + 4 * 8 * 8 * 4)


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = ls.group_advantages(r)
    assert adv.sum().abs() < 1e-12
    assert adv[0] == pytest.approx(0.5 / (r.std().item() + 1e-4))
    assert torch.allclose(ls.group_advantages(r, scale=False), r.double() - 0.5)
    assert torch.equal(ls.group_advantages([3.0, 3.0]), torch.zeros(2, dtype=torch.float64))


# ---- transformers twins -------------------------------------------------------------------------------------


def hf_twin(model):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(model.config.raw)
    hf_cfg = AutoConfig.for_model(**cfg)
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=next(model.parameters()).dtype)
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf.eval()


def hf_flat_grad(hf, model):
    named = dict(hf.named_parameters())
    return torch.cat([named[n].grad.flatten() for n, _ in model.named_parameters()])


def _out_of_place_recurrent_update(self, recurrent_states, state_idx=0, **kwargs):
    """transformers copies the new delta-rule state into the cached tensor in place (for CUDA graphs), which
    autograd rejects when that tensor was read by the same forward; assigning keeps the math and allows grad."""
    if not self.is_recurrent_states_initialized[state_idx]:
        self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
    self.recurrent_states[state_idx] = recurrent_states
    return recurrent_states


def hf_detached_grad(hf, model, prompt, responses, adv):
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionLayer

    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        hf(prompt[None, :-1], cache=cache, use_cache=True)
    hf.zero_grad()
    w = token_weights([r.numel() for r in responses], ls.GRPOConfig())
    for r, a, wi in zip(responses, adv, w):
        branch = torch.cat([prompt[-1:], r[:-1]])[None]
        pos = torch.arange(prompt.numel() - 1, prompt.numel() - 1 + r.numel())[None]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(LinearAttentionLayer, "update_recurrent_state", _out_of_place_recurrent_update)
            logits = hf(branch, cache=copy.deepcopy(cache), use_cache=True, position_ids=pos).logits[0]
        lp = torch.log_softmax(logits, -1).gather(-1, r[:, None])[:, 0]
        ratio = torch.exp(lp - lp.detach())
        (-(ratio * a).sum() * wi).backward()
    return hf_flat_grad(hf, model)
