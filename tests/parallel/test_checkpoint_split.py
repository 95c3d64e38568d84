"""Per-layer checkpointing on a split prompt chunk (each rank its block): after the chunk's forward a rank holds
its layers' inputs and the state it emitted, not the earlier blocks' K/V its split attention gathered per layer
(they are saved for the backward like the rest, and checkpointing drops them until then)."""

from __future__ import annotations

import gc

import torch

import longstraw as ls
from longstraw.engine.chunks import chunk_segment
from longstraw.parallel import SequenceParallel
from longstraw.tools.rehearse import LiveBytes
from tests.conftest import tiny_model
from tests.parallel.launch import run_ranks

CHUNK = 12


def held_after_forward(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Bytes alive after a checkpointed forward of the last prompt chunk with autograd, and this rank's tokens."""
    sp = SequenceParallel()
    model = tiny_model("qwen3")
    prompt = torch.randint(0, 97, (3 * CHUNK + 1,), generator=torch.Generator().manual_seed(0))
    state = ls.capture(model, prompt, CHUNK, parallel=sp)
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
