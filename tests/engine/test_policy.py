"""One memory policy (engine/policy.py): `longstraw plan`, from config.json alone, and the engine, measuring the
built model and asking the free memory, resolve the same plan for the same set-up."""

from __future__ import annotations

import pytest
import torch

import longstraw as ls
from longstraw.engine.policy import plan_group
from longstraw.tools.plan import Cluster, EngineChoice, Workload, plan
from tests.conftest import tiny_config

TOKENS, RESPONSE = 1000, 5000


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("gpu_gb", [1e-5, 1e-4, 100.0])  # sparse boundaries to every boundary kept
@pytest.mark.parametrize("chunk,checkpoint", [(64, False), (128, True)])
def test_the_planner_and_the_engine_resolve_alike(monkeypatch, model_type, gpu_gb, chunk, checkpoint):
    hf = tiny_config(model_type, vocab_size=97, max_position_embeddings=8192)
    planned = plan(hf, Workload(TOKENS, response_tokens=RESPONSE), Cluster(1, gpu_gb, zero=0, precision="fp32"),
                   EngineChoice(chunk=chunk, checkpoint_layers=checkpoint, activation_bytes=100_000))
    model = ls.build_model(hf, dtype=torch.float32)
    monkeypatch.setattr("longstraw.engine.policy.free_bytes", lambda device: int(gpu_gb * 1e9))
    engine = ls.EngineConfig(prompt_chunk=planned["chunk"], checkpoint_layers=planned["checkpoint_layers"],
                             prompt_order=planned["prompt_order_setting"], prompt_graph_budget=0)
    resolved = plan_group(model, engine, TOKENS, exact=True)
    assert (resolved.prompt_chunk, resolved.checkpoint_layers) == (chunk, checkpoint)
    assert resolved.boundary_every == planned["boundary_every"]
    assert resolved.prompt_order == planned["prompt_order"]
    assert min(resolved.head_chunk, RESPONSE) == planned["head_chunk"]  # a head chunk spans at most one response
    # the engine's capture runs the plan it resolved
    state = ls.capture(model, torch.randint(0, 97, (TOKENS,)), engine, exact=True)
    assert state.boundary_every == resolved.boundary_every and state.graphs is None


def test_the_set_ups_reach_both_boundary_rules(monkeypatch):
    """The control: the GPU sizes above give sparse boundaries on a model with fixed-size states, and every one."""
    hf = tiny_config("qwen3_5_text", vocab_size=97, max_position_embeddings=8192)
    every = {gb: plan(hf, Workload(TOKENS), Cluster(1, gb, zero=0, precision="fp32"),
                      EngineChoice(chunk=64, checkpoint_layers=False, activation_bytes=100_000))["boundary_every"]
             for gb in (1e-5, 100.0)}
    assert every[1e-5] > 1 and every[100.0] == 1
