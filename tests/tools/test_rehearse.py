"""`longstraw plan --rehearse`: the step's code under fake tensors with a fake process group. On tiny Qwen3.5 and
GLM-5 models (GLM-5: expert-parallel, its routing taken as balanced in the rehearsal) its peak per rank matches
what the same tracker sees in a real run on 2 gloo ranks (capture, replay, exact prompt backward, optimizer
step), within 10%."""


import pytest
import torch

import longstraw as ls
from longstraw.parallel import SequenceParallel, shard_model
from longstraw.tools.plan import Cluster, EngineChoice, Workload, plan
from longstraw.tools.rehearse import LiveBytes, format_rehearsal, rehearse
from tests.conftest import GLM, tiny_config
from tests.parallel.launch import run_ranks

TOKENS, CHUNK, G, R = 256, 32, 4, 16


def _plan(cfg: dict) -> dict:
    return plan(cfg, Workload(TOKENS, responses=G, response_tokens=R), Cluster(2, 1e-4, zero=3, precision="fp32"),
                EngineChoice(chunk=CHUNK, checkpoint_layers=True, activation_bytes=100_000))


def real_rank(rank: int, world: int, cfg: dict, settings: dict) -> dict[str, torch.Tensor]:
    """Two real steps on this rank; the second's storages tracked (the rehearsal's optimizer holds its moments
    from the start, as a run does after its first step)."""
    torch.manual_seed(0)
    model = ls.build_model(cfg, dtype=torch.float32)
    group = SequenceParallel()
    shard_model(model, 3, group)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 97, (TOKENS,), generator=gen)
    responses = [torch.randint(0, 97, (R,), generator=gen) for _ in range(G)]
    engine = ls.EngineConfig(**settings)
    opt = torch.optim.AdamW(list(model.parameters()), foreach=False)

    def step() -> None:
        state = ls.capture(model, prompt, engine, parallel=group, exact=True)
        dstate = ls.new_dstate(state)
        branches = ls.engine.Branches.group(responses, [0.5, -0.5, 1.0, -1.0], ls.GRPOConfig(), vocab_size=97)
        ls.replay(model, state, branches, ls.GRPOConfig(), dstate, engine=engine, parallel=group)
        ls.prompt_backward(model, state, dstate, engine=engine.model_copy(update={"prompt_order": "chunks"}),
                           parallel=group)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    live = LiveBytes("cpu")
    for p in model.parameters():
        live.add(p.to_local())
        for t in opt.state[p].values():
            live.add(t.to_local() if hasattr(t, "to_local") else t)
    with live:
        step()
    return {"peak": torch.tensor(live.peak)}


@pytest.mark.parametrize("cfg", [tiny_config("qwen3_5_text"), GLM], ids=["qwen3_5", "glm"])
def test_rehearsal_peak_matches_a_real_run_on_two_ranks(cfg):
    p = _plan(cfg)
    settings = dict(prompt_chunk=CHUNK, prompt_graph_budget=0, boundary_every=p["boundary_every"],
                    prompt_order="chunks", checkpoint_layers=True, head_chunk=p["head_chunk"])
    fake = rehearse(cfg, TOKENS, 2, p, ranks=[0, 1], responses=G, response_tokens=R, kernels=False)
    real = [int(r["peak"]) for r in run_ranks(2, real_rank, cfg, settings, timeout=180)]
    for rank, peak in enumerate(real):
        print(f"rank {rank}: rehearsal {fake['ranks'][rank]['peak_bytes']:,} bytes, real {peak:,} "
              f"({fake['ranks'][rank]['peak_bytes'] / peak:.3f})")
        assert fake["ranks"][rank]["peak_bytes"] == pytest.approx(peak, rel=0.10), (rank, fake, real)
    assert "rank 1: peak" in format_rehearsal(fake)


def test_rehearsal_refuses_what_it_cannot_run():
    cfg = tiny_config("qwen3_5_text")
    with pytest.raises(ValueError, match="one sequence-parallel group"):
        rehearse(cfg, TOKENS, 2, {**_plan(cfg), "sp": 1})
    with pytest.raises(ValueError, match="--prompt-order chunks"):
        rehearse(cfg, TOKENS, 2, {**_plan(cfg), "prompt_order": "layers"})
