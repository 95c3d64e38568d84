"""Per-layer activation checkpointing (`EngineConfig.checkpoint_layers`): the prompt chunks and branches keep only
their layers' inputs for the backward and run each layer again in it. The gradient stays naive's (fp64 <= 1e-10)
for every family, with LoRA, with kept capture graphs, and where DSA layers reuse an earlier layer's selection."""

import pytest
import torch

import longstraw as ls
from longstraw.engine import activation_bytes_per_token
from longstraw.engine.budget import _saved_bytes
from longstraw.engine.policy import plan_group
from longstraw.engine.chunks import empty_state, run_chunk, store_chunk
from longstraw.segment import PrefixView, Segment
from longstraw.tools.rehearse import LiveBytes
from tests.conftest import GLM, rel_err, tiny_model, with_adapters
from tests.engine.test_exact import grad_of, group

SHARED_DSA = {**GLM, "indexer_types": ["full", "shared", "full", "shared"]}


def _model(model_type: str, lora: bool = False):
    if model_type.startswith("glm"):
        torch.manual_seed(0)
        model = ls.build_model(SHARED_DSA if model_type == "glm_shared" else GLM, dtype=torch.float64)
    else:
        model = tiny_model(model_type, dtype=torch.float64)
    return with_adapters(model) if lora else model


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text", "glm_moe_dsa", "glm_shared"])
@pytest.mark.parametrize("lora", [False, True])
def test_checkpointed_exact_equals_naive(model_type, lora):
    model = _model(model_type, lora)
    prompt, responses = group(prompt_len=50)
    cfg = ls.EngineConfig(prompt_chunk=7, prompt_graph_budget=0, checkpoint_layers=True, branch_batch=2)
    g_naive, s_naive = grad_of(model, "naive", prompt, responses)
    g_exact, s_exact = grad_of(model, "exact", prompt, responses, engine=cfg)
    assert rel_err(g_exact, g_naive) <= 1e-10
    assert s_exact["loss"] == pytest.approx(s_naive["loss"], abs=1e-12)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "glm_shared"])
def test_checkpointed_kept_graphs_keep_gradient(model_type):
    """Capture keeps the last chunks' graphs checkpointed; the prompt backward uses them and recomputes the rest."""
    model = _model(model_type)
    prompt, responses = group(prompt_len=50)
    cfg = ls.EngineConfig(prompt_chunk=7, prompt_graph_budget=10**12, checkpoint_layers=True)
    g_naive, _ = grad_of(model, "naive", prompt, responses)
    g_exact, _ = grad_of(model, "exact", prompt, responses, engine=cfg)
    assert rel_err(g_exact, g_naive) <= 1e-10


def _chunk_saved_bytes(model, checkpoint: bool, tokens: int = 64) -> int:
    """Bytes autograd keeps for one prompt chunk of `tokens` tokens on a one-token prefix."""
    ids = torch.arange(1 + tokens) % model.config.vocab_size
    state = empty_state(model, ids[:2], 1)
    with torch.no_grad():
        store_chunk(model, state, 0, run_chunk(model, state, 0))
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    seg = Segment(start=1, prefix=PrefixView(state.layers, 1), collect=True, checkpoint_layers=checkpoint)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.emit_states(ids[None, 1:], seg)
    return sum(storages.values())


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_checkpointing_keeps_only_layer_inputs(model_type):
    """With checkpointing a chunk's graph holds each layer's input (layers x hidden per token), many times less
    than the whole model's activations."""
    model = tiny_model(model_type, dtype=torch.float32)
    tokens = 64
    full = _chunk_saved_bytes(model, False, tokens)
    kept = _chunk_saved_bytes(model, True, tokens)
    inputs = len(model.decoder_layers) * tokens * model.config.hidden_size * 4
    assert kept <= inputs * 1.05
    assert full >= 5 * kept


def test_auto_follows_free_memory(monkeypatch):
    """auto: a forward with autograd checkpoints its layers when its whole activations exceed a quarter of the free
    memory; a prompt chunk (the plan's `checkpoint_layers`) and a branch batch (`checkpoints`) alike."""
    model = tiny_model("qwen3")
    per_token = activation_bytes_per_token(model)
    monkeypatch.setattr("longstraw.engine.policy.free_bytes", lambda device: 4 * per_token * 1000)
    plan = lambda chunk, setting=None: plan_group(model, ls.EngineConfig(prompt_chunk=chunk,  # noqa: E731
                                                                        checkpoint_layers=setting), 2001, exact=False)
    assert not plan(1000).checkpoints(1000) and plan(1000).checkpoints(1001)
    assert not plan(1000).checkpoint_layers and plan(1001).checkpoint_layers
    assert plan(1000, True).checkpoints(1) and not plan(1000, False).checkpoints(10**9)


def _recompute_peak(tiles: int | None, tokens: int, intermediate: int) -> int:
    """The most bytes alive at once (weights left out) in a forward and backward of checkpointed layers over
    `tokens` tokens, recomputed in `tiles` query tiles (1: whole; None: the model's own choice)."""
    model = tiny_model("qwen3", intermediate_size=intermediate)
    if tiles is not None:
        for layer in model.decoder_layers:
            layer.mlp.recompute_tiles = tiles
    ids = torch.arange(tokens) % model.config.vocab_size
    live = LiveBytes("cpu")
    for t in [*model.parameters(), *model.buffers()]:
        live.ignore(t)
    with live:
        x = model.model.embed_tokens(ids[None]).detach()
        rope = model.model.rotary_emb(0, tokens, x.dtype, x.device)
        seg = Segment(checkpoint_layers=True)
        for layer in model.decoder_layers:
            x = model._layer(layer, x, rope, seg)
        x.backward(torch.ones_like(x))
    return live.peak


def test_query_tiles_lower_the_recompute_peak():
    """A recomputed attention layer runs over query tiles (3 x intermediate / hidden of them): its backward never
    holds the chunk's MLP activations (about six tensors of tokens x intermediate) at once."""
    tokens, intermediate = 256, 512
    assert tiny_model("qwen3", intermediate_size=intermediate).decoder_layers[0].mlp.recompute_tiles == 24
    whole = _recompute_peak(1, tokens, intermediate)
    tiled = _recompute_peak(None, tokens, intermediate)
    assert tiled <= whole - 4 * tokens * intermediate * 4
