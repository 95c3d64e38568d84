"""Per-layer checkpointing on a split prompt chunk (each rank its block): after the chunk's forward a rank holds
its layers' inputs and the state it emitted, not the earlier blocks' K/V its split attention gathered per layer
(they are saved for the backward like the rest, and checkpointing drops them until then). With blocks long enough
for their query tiles, the attention layers recompute tile by tile, and the exact gradient on 2 and 3 ranks is
one process's naive gradient."""

from __future__ import annotations

import gc

import pytest
import torch

import longstraw as ls
from longstraw.engine.chunks import chunk_segment
from longstraw.models.common import recompute
from longstraw.parallel import SequenceParallel, full_tensor, shard_model
from longstraw.tools.rehearse import LiveBytes
from tests.conftest import flat_grad, rel_err, tiny_model
from tests.parallel.launch import run_ranks

CHUNK = 12


def held_after_forward(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Bytes alive after a checkpointed forward of the last prompt chunk with autograd, and this rank's tokens."""
    sp = SequenceParallel()
    model = tiny_model("qwen3")
    prompt = torch.randint(0, 97, (3 * CHUNK + 1,), generator=torch.Generator().manual_seed(0))
    state = ls.capture(model, prompt, ls.EngineConfig(prompt_chunk=CHUNK), parallel=sp)
    live = LiveBytes("cpu")
    for t in [*model.parameters(), *model.buffers(), state.prompt_ids,
              *(x for layer in state.layers for x in layer.tensors())]:
        live.ignore(t)  # there before the forward
    with live:
        ids, seg = chunk_segment(state, len(state.chunks) - 1, parallel=sp, checkpoint_layers=True)
        with torch.enable_grad():
            model.emit_states(ids, seg)
        gc.collect()  # what only a cycle still holds is not held
        held = live.now
    return {"held": torch.tensor(held), "tokens": torch.tensor(ids.shape[1])}


def test_checkpointed_split_chunk_holds_layer_inputs_and_emitted_state():
    """Equal blocks on 3 ranks: every rank holds about the same, although rank r's attention gathered r earlier
    blocks (which would add r x 2 KB here)."""
    world = 3
    cfg = tiny_model("qwen3").config
    kv = cfg.num_key_value_heads * cfg.head_dim
    ranks = run_ranks(world, held_after_forward, timeout=90)
    t = CHUNK // world
    assert all(int(out["tokens"]) == t for out in ranks)
    held = [int(out["held"]) for out in ranks]
    assert all(abs(h - held[0]) <= 512 for h in held), held
    # each layer's input (and the last one's output), the K/V each layer emitted, the rotary cos/sin of the block
    bound = (cfg.num_hidden_layers + 1) * t * cfg.hidden_size * 4 + cfg.num_hidden_layers * t * 2 * kv * 4 + \
        2 * t * cfg.head_dim * 4 + 64
    assert held[0] <= bound


TILED_CHUNK = 16  # blocks of 5 to 8 tokens on 2 and 3 ranks: at least the tiny models' 5 query tiles
ADV = [1.0, -0.3, -0.7]


def _tiled_group():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 97, (45,), generator=g), [torch.randint(0, 97, (n,), generator=g) for n in (6, 2, 9)]


def tiled_rank(rank: int, world: int, arch: str, zero: int) -> dict[str, torch.Tensor]:
    """The exact gradient with per-layer checkpointing on this rank (ZeRO-3: FSDP2 gathers each layer's weights
    for its tiles), and how many layer backwards ran in tiles."""
    tiled = [0]
    backward = recompute._QueryTiles.backward

    def counted(ctx, *grads):
        tiled[0] += 1
        return backward(ctx, *grads)

    recompute._QueryTiles.backward = staticmethod(counted)
    model = tiny_model(arch, dtype=torch.float64)
    sp = SequenceParallel()
    if zero:
        shard_model(model, zero, sp)
    prompt, responses = _tiled_group()
    engine = ls.EngineConfig(prompt_chunk=TILED_CHUNK, checkpoint_layers=True, prompt_order="chunks",
                             prompt_graph_budget=0)
    ls.grpo_backward(model, prompt, responses, ADV, mode="exact", engine=engine, parallel=sp)
    grad = torch.cat([full_tensor(p.grad).flatten() for p in model.parameters()])
    return {"grad": grad, "tiled": torch.tensor(tiled[0])}


@pytest.mark.parametrize("arch,world,zero", [("qwen3", 2, 0), ("qwen3", 3, 0), ("qwen3_5_text", 3, 0),
                                             ("qwen3", 2, 3)])
def test_query_tiled_split_chunks_keep_the_exact_gradient(arch, world, zero):
    """Earlier blocks' keys gathered per layer and their gradient sent back once, after the last tile."""
    model = tiny_model(arch, dtype=torch.float64)
    prompt, responses = _tiled_group()
    ls.grpo_backward(model, prompt, responses, ADV, mode="naive")
    want = flat_grad(model)
    for r in run_ranks(world, tiled_rank, arch, zero, timeout=120):
        assert int(r["tiled"]) > 0
        assert rel_err(r["grad"], want) <= 1e-10
